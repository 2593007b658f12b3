// Measurement loops that run entirely in C++ (the "C++ path" of the benchmarks): perftest-style
// write ping-pong latency, per-call latency and windowed streaming bandwidth through rdma::Endpoint's
// public API, and the same two loops through the engine (hixl.Hixl's C++ side, any transport).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "transport/rdma_endpoint.h"

namespace hixl::perf {

// One side of a ping-pong. Both sides own a buffer of 2*size bytes registered on their endpoint:
// [0,size) is sent from, [size,2*size) receives the peer's writes (remote_recv_addr is the peer's).
// The initiator writes first; each side spins on the last byte of its receive half for the
// iteration marker, then answers. Returns per-iteration round-trip times in nanoseconds (initiator)
// or an empty vector (responder).
std::vector<uint64_t> write_pingpong(rdma::Endpoint& ep, uint8_t* local_buf, uint64_t remote_recv_addr,
                                     uint32_t rkey, uint64_t size, uint32_t iters, bool initiator,
                                     uint32_t timeout_ms);

struct StreamResult {
  uint64_t elapsed_ns = 0;
  uint64_t bytes = 0;
  uint64_t requests = 0;
  // Per-request latency under load: submit -> the moment this loop saw it complete (median, p99).
  uint64_t req_p50_ns = 0;
  uint64_t req_p99_ns = 0;
};

// Streams `iters` requests of `descs_per_req` descriptors of `size` bytes each, keeping up to
// `window` requests outstanding; waits for all. local/remote ranges cycle through `span` bytes.
// kWriteImm carries `imm` on each request's last work request (the peer must drain its receives).
StreamResult write_stream(rdma::Endpoint& ep, rdma::Op op, uint64_t local_addr, uint64_t remote_addr, uint32_t rkey,
                          uint64_t span, uint64_t size, uint32_t descs_per_req, uint32_t iters, uint32_t window,
                          uint32_t imm = 0);

// `iters` requests one at a time (submit, wait for its completion); returns each one's time in ns.
std::vector<uint64_t> op_latency(rdma::Endpoint& ep, rdma::Op op, uint64_t local_addr, uint64_t remote_addr,
                                 uint32_t rkey, uint64_t size, uint32_t descs_per_req, uint32_t iters,
                                 uint32_t timeout_ms);

// Consumes `count` immediates arriving on ep (WRITE_WITH_IMM from the peer), replenishing receives.
// Returns how many arrived before timeout_ms of silence.
uint64_t drain_imm(rdma::Endpoint& ep, uint64_t count, uint32_t timeout_ms);

// The engine (any transport). flag >= 0: WRITE with a completion flag (write-with-imm on RDMA).
StreamResult engine_stream(engine::Engine& e, const std::string& remote, engine::TransferOp op, int64_t flag,
                           uint64_t local_addr, uint64_t remote_addr, uint64_t span, uint64_t size,
                           uint32_t descs_per_req, uint32_t iters, uint32_t window, uint32_t timeout_ms);
// transfer_sync one call at a time; each call's time in ns.
std::vector<uint64_t> engine_latency(engine::Engine& e, const std::string& remote, engine::TransferOp op,
                                     int64_t flag, uint64_t local_addr, uint64_t remote_addr, uint64_t size,
                                     uint32_t descs_per_req, uint32_t iters, uint32_t timeout_ms);

}  // namespace hixl::perf
