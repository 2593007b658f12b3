// Metrics: what the engine did, as counters an operator can scrape (hixl.Hixl.metrics(), and
// /metrics with HixlMetricsPort: python/hixl/metrics.py turns a Snapshot into Prometheus families).
//
// Counters are written where the event happens and read only by snapshot(); nothing is counted per
// descriptor. An async transfer ends under the lock of the request table (Requests), which counts
// it in a plain TransferCounts of its own, guarded by that lock: no atomic read-modify-write on the
// request path (the engine merges it into the snapshot). Everything else (sync transfers, links,
// notifies, refusals) is a relaxed atomic here. Counts grow until the engine object goes.
//
//   transfers (ended)   by op x transport x status   count, bytes (COMPLETED only), descriptors
//   transfer seconds    by op (histogram)            submit -> the end seen (sync: the call returns;
//                                                    async: the status call that reported it)
//   links closed        by cause                     (Cause; "auth": a handshake refused for it)
//   notifies            sent (acknowledged) / received (delivered to our inbox)
//   refused transfers   by reason                    range, access, limit, param
//
// Lock: none (leaf; atomics only).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "engine/types.h"
#include "wire/control.h"

namespace hixl::engine {

class Metrics {
 public:
  Metrics();
  // Indices of the label values (names: metrics.cc's *_name(), and the bindings).
  static constexpr int kOps = 2;         // TransferOp: read 0, write 1
  static constexpr int kTransports = 3;  // rdma 0, shm 1, tcp 2 (wire::Transport - 1)
  static constexpr int kStatuses = 3;    // completed 0, failed 1, timeout 2
  enum class Cause : int {
    kDisconnect = 0,   // our disconnect()
    kPeerClosed,       // the peer said goodbye, or its control connection ended
    kHeartbeat,        // no frame from the peer within the heartbeat bound
    kAbort,            // a link aborted (a transfer past its timeout; by us or by the peer)
    kTransferError,    // a transfer failed on the link (a work completion in error, a copy failing)
    kStuckFrame,       // a control frame left incomplete past its bound
    kStalled,          // the peer stopped reading: our replies to it could not be written (link.h)
    kSuperseded,       // a newer connection from the same peer replaced it
    kFinalize,         // our finalize()
    kAuth,             // a handshake refused for authentication (no link was made)
    kAsyncEvent,       // the RDMA device reported a fatal event for the link's queue pair or port
    kCount
  };
  enum class Refused : int { kRange = 0, kAccess, kLimit, kParam, kCount };
  // Upper bounds of the transfer-seconds buckets (the last, +Inf, is implicit).
  static constexpr std::array<double, 18> kBuckets{1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                                   1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   0.5,  1.0,  2.5,    10.0};

  struct Snapshot {
    // [op][transport][status]
    uint64_t transfers[kOps][kTransports][kStatuses] = {};
    uint64_t bytes[kOps][kTransports] = {};        // of COMPLETED transfers
    uint64_t descriptors[kOps][kTransports] = {};  // of ended transfers
    // [op]: per-bucket counts (not cumulative; the last is +Inf) and the sum of seconds
    uint64_t seconds_buckets[kOps][kBuckets.size() + 1] = {};
    double seconds_sum[kOps] = {};
    uint64_t links_closed[int(Cause::kCount)] = {};
    uint64_t notifies_sent = 0, notifies_received = 0;
    uint64_t refused[int(Refused::kCount)] = {};
  };

  // Ended transfers by op x transport x status, their bytes, descriptors and seconds; C is
  // std::atomic<uint64_t> (Metrics' own) or uint64_t (a part's, guarded by its lock).
  template <class C>
  struct TransferCounts {
    C transfers[kOps][kTransports][kStatuses] = {};
    C bytes[kOps][kTransports] = {};
    C descriptors[kOps][kTransports] = {};
    C seconds_buckets[kOps][kBuckets.size() + 1] = {};
    C nanos_sum[kOps] = {};
    void add_to(Snapshot* s) const;
  };
  using LocalCounts = TransferCounts<uint64_t>;

  // A transfer ended with `status` (TransferStatus: COMPLETED, FAILED or TIMEOUT; others ignored).
  // took_ticks: util::ticks() since the submission (the cycle counter: no clock read per transfer).
  void transfer_ended(TransferOp op, wire::Transport t, TransferStatus status, uint64_t bytes, uint64_t descriptors,
                      uint64_t took_ticks) {
    count(&sync_, op, t, status, bytes, descriptors, took_ticks);
  }
  // The same, into a part's own counts (its lock held).
  void transfer_ended(LocalCounts* local, TransferOp op, wire::Transport t, TransferStatus status, uint64_t bytes,
                      uint64_t descriptors, uint64_t took_ticks) const {
    count(local, op, t, status, bytes, descriptors, took_ticks);
  }
  void link_closed(Cause c) { links_closed_[int(c)].fetch_add(1, std::memory_order_relaxed); }
  void notify_sent() { notifies_sent_.fetch_add(1, std::memory_order_relaxed); }
  void notify_received() { notifies_received_.fetch_add(1, std::memory_order_relaxed); }
  void refused(Refused r) { refused_[int(r)].fetch_add(1, std::memory_order_relaxed); }

  // Everything but the parts' own counts (which LocalCounts::add_to() adds).
  Snapshot snapshot() const;

  static const char* op_name(int op);
  static const char* transport_name(int t);  // index t: wire::transport_name(Transport(t + 1))
  static const char* status_name(int s);
  static const char* cause_name(int c);
  static const char* refused_name(int r);

 private:
  template <class C>
  void count(TransferCounts<C>* c, TransferOp op, wire::Transport t, TransferStatus status, uint64_t bytes,
             uint64_t descriptors, uint64_t took_ticks) const;

  using Counter = std::atomic<uint64_t>;
  TransferCounts<Counter> sync_;
  Counter links_closed_[int(Cause::kCount)] = {};
  Counter notifies_sent_{0}, notifies_received_{0};
  Counter refused_[int(Refused::kCount)] = {};
  const double ns_per_tick_;  // util::ns_per_tick(), read once
};

}  // namespace hixl::engine
