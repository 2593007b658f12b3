#include "perf/perf.h"

#include <atomic>
#include <chrono>
#include <deque>

#include "verbs/error.h"

namespace hixl::perf {

using Clock = std::chrono::steady_clock;

namespace {
void spin_for_marker(volatile uint8_t* p, uint8_t want, Clock::time_point deadline, uint32_t iter) {
  uint32_t n = 0;
  while (*p != want) {
    if ((++n & 0xfff) == 0 && Clock::now() > deadline)
      throw Error("write_pingpong: no answer from the peer for iteration " + std::to_string(iter), ETIMEDOUT);
  }
  std::atomic_thread_fence(std::memory_order_acquire);
}

void finish(rdma::Endpoint& ep, uint64_t req, uint32_t timeout_ms) {
  auto r = ep.wait(req, std::chrono::milliseconds(timeout_ms));
  if (r.status != rdma::Status::kCompleted)
    throw Error("perf: request did not complete (status " + std::to_string(int(r.status)) + "): " + r.error);
}
}  // namespace

std::vector<uint64_t> write_pingpong(rdma::Endpoint& ep, uint8_t* buf, uint64_t remote_recv_addr, uint32_t rkey,
                                     uint64_t size, uint32_t iters, bool initiator, uint32_t timeout_ms) {
  if (size == 0) throw Error("write_pingpong: size must be > 0");
  std::vector<uint64_t> rtt;
  rtt.reserve(initiator ? iters : 0);
  volatile uint8_t* inbox_last = buf + 2 * size - 1;
  uint8_t* send_last = buf + size - 1;
  std::vector<rdma::Desc> d{{reinterpret_cast<uint64_t>(buf), remote_recv_addr, size, rkey}};
  std::deque<uint64_t> pending;  // reap completions lazily, as perftest does with its CQ moderation
  for (uint32_t i = 0; i < iters; ++i) {
    uint8_t marker = uint8_t(i % 255 + 1);
    auto t0 = Clock::now();
    auto deadline = t0 + std::chrono::milliseconds(timeout_ms);
    if (!initiator) spin_for_marker(inbox_last, marker, deadline, i);
    *send_last = marker;
    pending.push_back(ep.submit(rdma::Op::kWrite, d));
    if (initiator) {
      spin_for_marker(inbox_last, marker, deadline, i);
      rtt.push_back(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count()));
    }
    while (!pending.empty()) {
      auto r = ep.status(pending.front());
      if (r.status == rdma::Status::kWaiting) break;
      if (r.status != rdma::Status::kCompleted) throw Error("write_pingpong: write failed: " + r.error);
      pending.pop_front();
    }
  }
  for (uint64_t req : pending) finish(ep, req, timeout_ms);
  return rtt;
}

StreamResult write_stream(rdma::Endpoint& ep, rdma::Op op, uint64_t local_addr, uint64_t remote_addr, uint32_t rkey,
                          uint64_t span, uint64_t size, uint32_t descs_per_req, uint32_t iters, uint32_t window) {
  if (size == 0 || descs_per_req == 0 || window == 0 || span < size)
    throw Error("write_stream: size, descs_per_req and window must be > 0 and span >= size");
  uint64_t slots = span / size;
  std::vector<rdma::Desc> d(descs_per_req);
  std::deque<uint64_t> inflight;
  uint64_t slot = 0;
  auto t0 = Clock::now();
  for (uint32_t i = 0; i < iters; ++i) {
    for (auto& x : d) {
      uint64_t off = (slot++ % slots) * size;
      x = {local_addr + off, remote_addr + off, size, rkey};
    }
    if (inflight.size() >= window) {
      finish(ep, inflight.front(), 60000);
      inflight.pop_front();
    }
    inflight.push_back(ep.submit(op, d));
  }
  for (uint64_t r : inflight) finish(ep, r, 60000);
  StreamResult res;
  res.elapsed_ns = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
  res.bytes = uint64_t(iters) * descs_per_req * size;
  res.requests = iters;
  return res;
}

}  // namespace hixl::perf
