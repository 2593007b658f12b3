#include "perf/perf.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <thread>

#include "util/ticks.h"
#include "verbs/error.h"

namespace hixl::perf {

using Clock = std::chrono::steady_clock;

namespace {
uint64_t ns_since(Clock::time_point t0) {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

// Per-iteration timestamps come from the CPU's cycle counter (util/ticks.h): three clock reads per
// ping-pong iteration added ~2.5 us to an 8 B half round trip in the TCG guest. Ticks are converted
// to ns with a rate measured against steady_clock across the whole loop (two clock reads per loop).
using util::ticks;

class TickRate {
 public:
  TickRate() : c0_(Clock::now()), t0_(ticks()) {}
  double ns_per_tick() const {
    uint64_t dt = ticks() - t0_;
    uint64_t ns = ns_since(c0_);
    return dt ? double(ns) / double(dt) : 1.0;
  }
  // Converts tick deltas in place.
  void to_ns(std::vector<uint64_t>& v) const {
    double k = ns_per_tick();
    for (auto& x : v) x = uint64_t(double(x) * k);
  }

 private:
  Clock::time_point c0_;
  uint64_t t0_;
};

// Spins until *p == want. The clock is read only every 4096 spins (the deadline starts then), so
// the fast path costs no clock read at all.
void spin_for_marker(volatile uint8_t* p, uint8_t want, uint32_t timeout_ms, uint32_t iter) {
  uint32_t n = 0;
  Clock::time_point deadline{};
  while (*p != want) {
    if ((++n & 0xfff) == 0) {
      auto now = Clock::now();
      if (deadline == Clock::time_point{}) deadline = now + std::chrono::milliseconds(timeout_ms);
      else if (now > deadline)
        throw Error("write_pingpong: no answer from the peer for iteration " + std::to_string(iter), ETIMEDOUT);
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
}

void finish(rdma::Endpoint& ep, uint64_t req, uint32_t timeout_ms) {
  auto r = ep.wait(req, std::chrono::milliseconds(timeout_ms));
  if (r.status != rdma::Status::kCompleted)
    throw Error("perf: request did not complete (status " + std::to_string(int(r.status)) + "): " + r.error);
}

void check_shape(const char* fn, uint64_t size, uint32_t descs, uint32_t window, uint64_t span) {
  if (size == 0 || descs == 0 || window == 0 || span < size)
    throw Error(std::string(fn) + ": size, descs_per_req and window must be > 0 and span >= size");
}

// Descriptor k of a run: consecutive `size` slots cycling through `span` bytes (local and remote alike).
struct Slots {
  uint64_t size, slots, next = 0;
  Slots(uint64_t span, uint64_t sz) : size(sz), slots(span / sz) {}
  uint64_t take() { return (next++ % slots) * size; }
};

// Median and p99 (nearest rank) of request latencies (ticks), in place. Two selections, not a sort:
// a sort's n log n would grow faster than the stream and land in bench/callgrind.py's per-request
// difference of two stream lengths (~105 instructions per request at 1,000 and 3,000), counted as
// the request path's although it runs after the clock stopped.
void summarize(std::vector<uint64_t>& lat, const TickRate& rate, StreamResult& r) {
  if (lat.empty()) return;
  const size_t i50 = (lat.size() - 1) / 2;
  const size_t i99 = std::min(lat.size() - 1, size_t(double(lat.size()) * 0.99));
  std::nth_element(lat.begin(), lat.begin() + i99, lat.end());
  std::nth_element(lat.begin(), lat.begin() + i50, lat.begin() + i99 + 1);  // every one before i99 is <= it
  double k = rate.ns_per_tick();
  r.req_p50_ns = uint64_t(double(lat[i50]) * k);
  r.req_p99_ns = uint64_t(double(lat[i99]) * k);
}

void engine_check(engine::Engine& e, int rc, const char* what) {
  if (rc != engine::kSuccess)
    throw Error(std::string("perf: ") + what + " returned " + engine::code_name(rc) + ": " + e.last_error());
}

void engine_finish(engine::Engine& e, uint64_t req, uint32_t timeout_ms) {
  auto [rc, st] = e.transfer_wait(req, int(timeout_ms));
  engine_check(e, rc, "transfer_wait");
  if (st != int(engine::TransferStatus::kCompleted))
    throw Error("perf: engine request did not complete (status " + std::to_string(st) + "): " + e.last_error());
}

// The windowed loop of both streams: `iters` requests of d.size() descriptors of `size` bytes, each
// descriptor at the next slot of `span` (make(offset) builds it), at most `window` outstanding.
// submit(descs, i) -> request id; finish(request) waits for it and throws unless it completed.
template <class D, class Make, class Submit, class Finish>
StreamResult windowed_stream(std::vector<D>& d, uint64_t span, uint64_t size, uint32_t iters, uint32_t window,
                             Make make, Submit submit, Finish finish) {
  Slots slots(span, size);
  // (request, submit tick), oldest at `head`: a ring of `window` slots (a deque cost ~65 instructions a
  // request, inside the timed loop and in callgrind's count of the request path)
  std::vector<std::pair<uint64_t, uint64_t>> inflight(std::min(window, std::max(iters, 1u)));
  size_t head = 0, live = 0;
  std::vector<uint64_t> lat;
  lat.reserve(iters);
  auto reap = [&] {
    finish(inflight[head].first);
    lat.push_back(ticks() - inflight[head].second);
    head = head + 1 == inflight.size() ? 0 : head + 1;
    --live;
  };
  TickRate rate;
  auto t0 = Clock::now();
  for (uint32_t i = 0; i < iters; ++i) {
    for (auto& x : d) x = make(slots.take());
    if (live == inflight.size()) reap();
    uint64_t ts = ticks();
    uint64_t req = submit(d, i);
    size_t tail = head + live;
    inflight[tail >= inflight.size() ? tail - inflight.size() : tail] = {req, ts};
    ++live;
  }
  while (live) reap();
  StreamResult res;
  res.elapsed_ns = ns_since(t0);
  res.bytes = uint64_t(iters) * d.size() * size;
  res.requests = iters;
  summarize(lat, rate, res);
  return res;
}

// `iters` calls one at a time; call(i) returns once that call completed. Each call's time in ns.
template <class Call>
std::vector<uint64_t> one_at_a_time(uint32_t iters, Call call) {
  std::vector<uint64_t> out;
  out.reserve(iters);
  TickRate rate;
  for (uint32_t i = 0; i < iters; ++i) {
    uint64_t t0 = ticks();
    call(i);
    out.push_back(ticks() - t0);
  }
  rate.to_ns(out);
  return out;
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
  TickRate rate;
  for (uint32_t i = 0; i < iters; ++i) {
    uint8_t marker = uint8_t(i % 255 + 1);
    uint64_t t0 = ticks();
    if (!initiator) spin_for_marker(inbox_last, marker, timeout_ms, i);
    *send_last = marker;
    pending.push_back(ep.submit(rdma::Op::kWrite, d));
    if (initiator) {
      spin_for_marker(inbox_last, marker, timeout_ms, i);
      rtt.push_back(ticks() - t0);
    }
    while (!pending.empty()) {
      auto r = ep.status(pending.front());
      if (r.status == rdma::Status::kWaiting) break;
      if (r.status != rdma::Status::kCompleted) throw Error("write_pingpong: write failed: " + r.error);
      pending.pop_front();
    }
  }
  for (uint64_t req : pending) finish(ep, req, timeout_ms);
  rate.to_ns(rtt);
  return rtt;
}

StreamResult write_stream(rdma::Endpoint& ep, rdma::Op op, uint64_t local_addr, uint64_t remote_addr, uint32_t rkey,
                          uint64_t span, uint64_t size, uint32_t descs_per_req, uint32_t iters, uint32_t window,
                          uint32_t imm) {
  check_shape("write_stream", size, descs_per_req, window, span);
  std::vector<rdma::Desc> d(descs_per_req);
  return windowed_stream(
      d, span, size, iters, window,
      [&](uint64_t off) { return rdma::Desc{local_addr + off, remote_addr + off, size, rkey}; },
      [&](const std::vector<rdma::Desc>& descs, uint32_t) { return ep.submit(op, descs, imm); },
      [&](uint64_t req) { finish(ep, req, 60000); });
}

std::vector<uint64_t> op_latency(rdma::Endpoint& ep, rdma::Op op, uint64_t local_addr, uint64_t remote_addr,
                                 uint32_t rkey, uint64_t size, uint32_t descs_per_req, uint32_t iters,
                                 uint32_t timeout_ms) {
  check_shape("op_latency", size, descs_per_req, 1, std::max<uint64_t>(size, 1));
  std::vector<rdma::Desc> d(descs_per_req);
  for (uint32_t k = 0; k < descs_per_req; ++k) d[k] = {local_addr + k * size, remote_addr + k * size, size, rkey};
  return one_at_a_time(iters, [&](uint32_t i) { finish(ep, ep.submit(op, d, i), timeout_ms); });
}

uint64_t drain_imm(rdma::Endpoint& ep, uint64_t count, uint32_t timeout_ms) {
  uint64_t got = 0;
  uint32_t idle = 0;  // empty polls in a row; the clock is read every 64th only
  Clock::time_point quiet_since{};
  while (got < count) {
    auto v = ep.poll_imm(size_t(std::min<uint64_t>(count - got, 256)));
    if (!v.empty()) {
      got += v.size();
      idle = 0;
      continue;
    }
    if (ep.closed() || ep.dead()) break;
    if ((++idle & 63) == 0) {
      auto now = Clock::now();
      if (idle == 64) quiet_since = now;
      else if (now - quiet_since > std::chrono::milliseconds(timeout_ms)) break;
    }
    std::this_thread::yield();  // a busy consumer, as a receiver replenishing its queue would be
  }
  return got;
}

StreamResult engine_stream(engine::Engine& e, const std::string& remote, engine::TransferOp op, int64_t flag,
                           uint64_t local_addr, uint64_t remote_addr, uint64_t span, uint64_t size,
                           uint32_t descs_per_req, uint32_t iters, uint32_t window, uint32_t timeout_ms) {
  check_shape("engine_stream", size, descs_per_req, window, span);
  std::vector<engine::OpDesc> d(descs_per_req);
  return windowed_stream(
      d, span, size, iters, window,
      [&](uint64_t off) { return engine::OpDesc{local_addr + off, remote_addr + off, size}; },
      [&](const std::vector<engine::OpDesc>& descs, uint32_t i) {
        auto [rc, req] = e.transfer_async(remote, op, descs, i, flag);
        engine_check(e, rc, "transfer_async");
        return req;
      },
      [&](uint64_t req) { engine_finish(e, req, timeout_ms); });
}

std::vector<uint64_t> engine_latency(engine::Engine& e, const std::string& remote, engine::TransferOp op,
                                     int64_t flag, uint64_t local_addr, uint64_t remote_addr, uint64_t size,
                                     uint32_t descs_per_req, uint32_t iters, uint32_t timeout_ms) {
  check_shape("engine_latency", size, descs_per_req, 1, size);
  std::vector<engine::OpDesc> d(descs_per_req);
  for (uint32_t k = 0; k < descs_per_req; ++k) d[k] = {local_addr + k * size, remote_addr + k * size, size};
  return one_at_a_time(iters, [&](uint32_t) {
    engine_check(e, e.transfer_sync(remote, op, d, int(timeout_ms), flag), "transfer_sync");
  });
}

}  // namespace hixl::perf
