// Requests: the async transfers the user has not yet seen end (transfer_async's ids), their
// deadlines, and the expiry of those past them. The table is an IdSlab (util/id_slab.h): adding,
// finding and consuming a request costs no allocation and no tree walk; ids still grow with issue
// order. A terminal status is reported exactly once: the
// status calls consume it under the table's lock, so two threads polling one request cannot turn a
// COMPLETED into "unknown request".
//
// A request's end is counted in the engine's Metrics when its terminal status is reported.
//
// Lock: `mu_` (with `cv_`: an expired request got its final status). A Link's `mu` may be taken
// while it is held (to say why a link went down), never the other way round.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/link.h"
#include "engine/metrics.h"
#include "util/id_slab.h"
#include "util/mutex.h"

namespace hixl::engine {

// What a request's end is counted with (Metrics::transfer_ended).
struct RequestShape {
  TransferOp op = TransferOp::kWrite;
  uint32_t descriptors = 0;
  uint64_t bytes = 0;
  uint64_t start_ticks = 0;  // util::ticks() at submission
};

class Requests {
 public:
  using Shape = RequestShape;
  explicit Requests(Metrics& metrics) : metrics_(metrics) {}
  // A submitted request on link's path (its path request id); deadline Clock::time_point::max(): none.
  // 0 when IdSlab::kMaxLive requests are outstanding (the caller reports RESOURCE_EXHAUSTED).
  uint64_t add(std::shared_ptr<Link> link, uint64_t path_req, uint64_t user_data, int timeout_ms,
               Clock::time_point deadline, const Shape& shape = {});

  // Its status (consumed when terminal); nullopt for an id never issued or already reported.
  std::optional<rdma::RequestResult> status(uint64_t id);
  // The path and path request a waiter may block on without this lock (null path: unknown id).
  std::pair<std::shared_ptr<transport::DataPath>, uint64_t> path_of(uint64_t id) const;
  // Up to max_count requests, oldest first (terminal ones consumed); skip_waiting leaves out the rest.
  std::vector<TransferResult> all(uint64_t max_count, bool skip_waiting);
  // Until an expired request got its final status, or `until`.
  void wait_change(Clock::time_point until);

  // Marks the requests past their deadline at `now` that had not ended; returns their links (each
  // once: the caller aborts them and then calls finish_expired()).
  std::vector<std::shared_ptr<Link>> expire(Clock::time_point now);
  // The abort of link ended: its expired requests report TIMEOUT (confirmed) or FAILED.
  void finish_expired(const std::shared_ptr<Link>& link, bool confirmed);

  void clear();
  // Adds the counts of the requests that ended here (Metrics, counted under mu_) to *s.
  void add_counts_to(Metrics::Snapshot* s) const;

 private:
  struct Request {
    std::shared_ptr<Link> link;
    uint64_t path_req = 0;
    uint64_t user_data = 0;
    Shape shape;
    int timeout_ms = 0;                                     // 0: no deadline
    Clock::time_point deadline = Clock::time_point::max();
    bool expired = false;                                   // past its deadline, its link being aborted
    int final_status = -1;                                  // set once that abort ended (TIMEOUT or FAILED)
    std::string final_error;
    void on_erase() {  // IdSlab::erase: drop the link now (its queue pair may be waiting to go)
      link.reset();
      final_error.clear();
    }
  };
  // A request's status without consuming it from reqs_ (mu_ held); the path's is consumed.
  rdma::RequestResult poll_locked(Request& r);
  // A request's terminal status was reported (mu_ held): log it, count it, drop it. Returns its link
  // for the caller to release after mu_: the last reference to a closed link may be this request's,
  // and the link's teardown (its queue pairs, each of which the kernel may hold for a while when
  // packets of it are still queued on a stalled NIC) must not stall every other request's status.
  std::shared_ptr<Link> end_locked(uint64_t id, Request& r, const rdma::RequestResult& res);

  Metrics& metrics_;
  Metrics::LocalCounts counts_;  // the requests that ended, by op, transport and status (mu_)
  mutable util::Mutex mu_;
  std::condition_variable_any cv_;
  util::IdSlab<Request> reqs_;
  // No live request has a deadline before this (a lower bound: expire() scans the table only once
  // it passed, then recomputes it), so the watchdog's tick costs nothing while nothing can expire.
  Clock::time_point next_deadline_ = Clock::time_point::max();
};

}  // namespace hixl::engine
