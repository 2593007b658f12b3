// Measurement loops that run entirely in C++ (the "C++ path" of the benchmarks): perftest-style
// write ping-pong latency and windowed streaming bandwidth through rdma::Endpoint's public API.
#pragma once

#include <cstdint>
#include <vector>

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
};

// Streams `iters` requests of `descs_per_req` descriptors of `size` bytes each, keeping up to
// `window` requests outstanding; waits for all. local/remote ranges cycle through `span` bytes.
StreamResult write_stream(rdma::Endpoint& ep, rdma::Op op, uint64_t local_addr, uint64_t remote_addr, uint32_t rkey,
                          uint64_t span, uint64_t size, uint32_t descs_per_req, uint32_t iters, uint32_t window);

}  // namespace hixl::perf
