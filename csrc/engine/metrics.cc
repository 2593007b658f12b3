#include "engine/metrics.h"

#include <algorithm>

#include "util/ticks.h"

namespace hixl::engine {

namespace {
constexpr auto kRelaxed = std::memory_order_relaxed;

// kBuckets in nanoseconds (an observation equal to a bound falls in that bound's bucket, as in Prometheus).
constexpr std::array<uint64_t, Metrics::kBuckets.size()> bucket_nanos() {
  std::array<uint64_t, Metrics::kBuckets.size()> out{};
  for (size_t i = 0; i < out.size(); ++i) out[i] = uint64_t(Metrics::kBuckets[i] * 1e9 + 0.5);
  return out;
}
constexpr auto kBucketNanos = bucket_nanos();
static_assert([] {
  for (size_t i = 1; i < kBucketNanos.size(); ++i)
    if (kBucketNanos[i] < 2 * kBucketNanos[i - 1]) return false;
  return true;
}(), "bounds at least 2x apart (kFirstBucketOfLog2 leaves one step at most)");
// [k]: the first bucket whose bound >= 2^k.
constexpr std::array<uint8_t, 64> first_bucket_of_log2() {
  std::array<uint8_t, 64> out{};
  for (size_t k = 0; k < 64; ++k) {
    size_t b = 0;
    while (b < kBucketNanos.size() && kBucketNanos[b] < (uint64_t(1) << k)) ++b;
    out[k] = uint8_t(b);
  }
  return out;
}
constexpr auto kFirstBucketOfLog2 = first_bucket_of_log2();

int status_index(TransferStatus s) {
  switch (s) {
    case TransferStatus::kCompleted: return 0;
    case TransferStatus::kFailed: return 1;
    case TransferStatus::kTimeout: return 2;
    default: return -1;
  }
}

inline void bump(std::atomic<uint64_t>& c, uint64_t v) { c.fetch_add(v, kRelaxed); }
inline void bump(uint64_t& c, uint64_t v) { c += v; }
inline uint64_t read(const std::atomic<uint64_t>& c) { return c.load(kRelaxed); }
inline uint64_t read(uint64_t c) { return c; }
}  // namespace

Metrics::Metrics() : ns_per_tick_(util::ns_per_tick()) {}

template <class C>
void Metrics::count(TransferCounts<C>* c, TransferOp op, wire::Transport t, TransferStatus status, uint64_t bytes,
                    uint64_t descriptors, uint64_t took_ticks) const {
  const int o = op == TransferOp::kWrite ? 1 : 0;
  const int tr = int(t) - 1;
  const int s = status_index(status);
  if (tr < 0 || tr >= kTransports || s < 0) return;
  bump(c->transfers[o][tr][s], 1);
  if (s == 0) bump(c->bytes[o][tr], bytes);
  bump(c->descriptors[o][tr], descriptors);
  const uint64_t ns = uint64_t(double(int64_t(took_ticks) > 0 ? took_ticks : 0) * ns_per_tick_);
  // Start at the first bound >= 2^floor(log2 ns): the bounds are at least 2x apart, so at most one
  // step is left (no scan from the first bucket).
  size_t b = kFirstBucketOfLog2[63 - __builtin_clzll(ns | 1)];
  while (b < kBucketNanos.size() && ns > kBucketNanos[b]) ++b;
  bump(c->seconds_buckets[o][b], 1);
  bump(c->nanos_sum[o], ns);
}
template void Metrics::count(TransferCounts<std::atomic<uint64_t>>*, TransferOp, wire::Transport, TransferStatus,
                             uint64_t, uint64_t, uint64_t) const;
template void Metrics::count(TransferCounts<uint64_t>*, TransferOp, wire::Transport, TransferStatus, uint64_t,
                             uint64_t, uint64_t) const;

template <class C>
void Metrics::TransferCounts<C>::add_to(Snapshot* s) const {
  for (int o = 0; o < kOps; ++o) {
    for (int t = 0; t < kTransports; ++t) {
      for (int st = 0; st < kStatuses; ++st) s->transfers[o][t][st] += read(transfers[o][t][st]);
      s->bytes[o][t] += read(bytes[o][t]);
      s->descriptors[o][t] += read(descriptors[o][t]);
    }
    for (size_t b = 0; b <= kBuckets.size(); ++b) s->seconds_buckets[o][b] += read(seconds_buckets[o][b]);
    s->seconds_sum[o] += double(read(nanos_sum[o])) * 1e-9;
  }
}
template struct Metrics::TransferCounts<std::atomic<uint64_t>>;
template struct Metrics::TransferCounts<uint64_t>;

Metrics::Snapshot Metrics::snapshot() const {
  Snapshot s;
  sync_.add_to(&s);
  for (int c = 0; c < int(Cause::kCount); ++c) s.links_closed[c] = links_closed_[c].load(kRelaxed);
  s.notifies_sent = notifies_sent_.load(kRelaxed);
  s.notifies_received = notifies_received_.load(kRelaxed);
  for (int r = 0; r < int(Refused::kCount); ++r) s.refused[r] = refused_[r].load(kRelaxed);
  return s;
}

const char* Metrics::op_name(int op) { return op == 1 ? "write" : "read"; }
const char* Metrics::transport_name(int t) {
  return t >= 0 && t < kTransports ? wire::transport_name(wire::Transport(t + 1)) : "?";
}
const char* Metrics::status_name(int s) {
  static const char* const k[] = {"completed", "failed", "timeout"};
  return s >= 0 && s < kStatuses ? k[s] : "?";
}
const char* Metrics::cause_name(int c) {
  static const char* const k[] = {"disconnect", "peer_closed", "heartbeat", "abort",     "transfer_error", "stuck_frame",
                                  "stalled",    "superseded",  "finalize",  "auth",      "async_event"};
  static_assert(sizeof k / sizeof *k == size_t(Cause::kCount));
  return c >= 0 && c < int(Cause::kCount) ? k[c] : "?";
}
const char* Metrics::refused_name(int r) {
  static const char* const k[] = {"range", "access", "limit", "param"};
  static_assert(sizeof k / sizeof *k == size_t(Refused::kCount));
  return r >= 0 && r < int(Refused::kCount) ? k[r] : "?";
}

}  // namespace hixl::engine
