#include "engine/requests.h"

#include <algorithm>

#include "util/ticks.h"
#include "verbs/log.h"

namespace hixl::engine {

uint64_t Requests::add(std::shared_ptr<Link> link, uint64_t path_req, uint64_t user_data, int timeout_ms,
                       Clock::time_point deadline, const Shape& shape) {
  std::lock_guard<util::Mutex> g(mu_);
  auto [id, r] = reqs_.emplace();  // filled in place: every field (a reused slot keeps old values)
  if (!id) return 0;
  r->link = std::move(link);
  r->path_req = path_req;
  r->user_data = user_data;
  r->shape = shape;
  r->timeout_ms = timeout_ms;
  r->deadline = deadline;
  r->expired = false;
  r->final_status = -1;
  r->final_error.clear();
  if (deadline < next_deadline_) next_deadline_ = deadline;
  return id;
}

rdma::RequestResult Requests::poll_locked(Request& r) {
  if (r.final_status >= 0) return {TransferStatus(r.final_status), r.final_error};
  // Past its deadline: its link is being aborted (the path may already say FAILED because of that
  // abort). finish_expired() decides between TIMEOUT and FAILED within seconds.
  if (r.expired) return rdma::RequestResult(TransferStatus::kWaiting);
  rdma::RequestResult res = r.link->path->status(r.path_req);
  if (res.status == TransferStatus::kFailed) {  // say why, when it is the link that went (heartbeat, peer, abort)
    std::lock_guard<util::Mutex> g(r.link->mu);
    if (r.link->down) res.error += " (the link to " + r.link->key + " was closed: " + r.link->down_reason + ")";
  }
  return res;
}

std::shared_ptr<Link> Requests::end_locked(uint64_t id, Request& r, const rdma::RequestResult& res) {
  if (res.status == TransferStatus::kFailed || res.status == TransferStatus::kTimeout)
    log::warn("transfer request " + std::to_string(id) +
              (res.status == TransferStatus::kFailed ? " failed: " : " timed out: ") + res.error);
  metrics_.transfer_ended(&counts_, r.shape.op, r.link->transport, res.status, r.shape.bytes, r.shape.descriptors,
                          util::ticks() - r.shape.start_ticks);
  std::shared_ptr<Link> link = std::move(r.link);
  reqs_.erase(id);
  return link;
}

std::optional<rdma::RequestResult> Requests::status(uint64_t id) {
  std::shared_ptr<Link> ended;  // declared first: released after mu_ (see end_locked)
  std::lock_guard<util::Mutex> g(mu_);
  Request* r = reqs_.find(id);
  if (!r) return std::nullopt;
  rdma::RequestResult res = poll_locked(*r);
  if (res.status != TransferStatus::kWaiting) ended = end_locked(id, *r, res);
  return res;
}

std::pair<std::shared_ptr<transport::DataPath>, uint64_t> Requests::path_of(uint64_t id) const {
  std::lock_guard<util::Mutex> g(mu_);
  const Request* r = reqs_.find(id);
  if (!r) return {nullptr, 0};
  return {r->link->path, r->path_req};
}

std::vector<TransferResult> Requests::all(uint64_t max_count, bool skip_waiting) {
  std::vector<std::shared_ptr<Link>> ended;  // released after mu_ (see end_locked)
  std::lock_guard<util::Mutex> g(mu_);
  std::vector<uint64_t> ids;
  ids.reserve(reqs_.size());
  reqs_.for_each([&](uint64_t id, Request&) { ids.push_back(id); });
  std::sort(ids.begin(), ids.end());  // ids grow with issue order: oldest first
  std::vector<TransferResult> out;
  for (uint64_t id : ids) {
    if (out.size() >= max_count) break;
    Request& r = *reqs_.find(id);
    rdma::RequestResult res = poll_locked(r);
    const uint64_t user_data = r.user_data;
    if (res.status != TransferStatus::kWaiting) {
      ended.push_back(end_locked(id, r, res));
    } else if (skip_waiting) {
      continue;
    }
    out.push_back({id, user_data, int(res.status)});
  }
  return out;
}

void Requests::wait_change(Clock::time_point until) {
  std::unique_lock<util::Mutex> lk(mu_);
  cv_.wait_until(lk, until);
}

std::vector<std::shared_ptr<Link>> Requests::expire(Clock::time_point now) {
  std::vector<std::shared_ptr<Link>> to_abort;
  std::lock_guard<util::Mutex> g(mu_);
  if (now < next_deadline_) return to_abort;
  next_deadline_ = Clock::time_point::max();
  reqs_.for_each([&](uint64_t id, Request& r) {
    if (r.deadline == Clock::time_point::max() || r.expired || r.final_status >= 0) return;
    if (r.deadline > now) {
      next_deadline_ = std::min(next_deadline_, r.deadline);
      return;
    }
    r.deadline = Clock::time_point::max();  // decided now: never looked at again
    if (r.link->path->wait_done(r.path_req, milliseconds(0))) return;  // ended in time; its status waits for the user
    r.expired = true;
    r.final_error = "transfer_async(req=" + std::to_string(id) + ") to " + r.link->key + ": not complete within " +
                    std::to_string(r.timeout_ms) + " ms";
    if (!r.link->aborting.exchange(true)) to_abort.push_back(r.link);
  });
  return to_abort;
}

void Requests::finish_expired(const std::shared_ptr<Link>& link, bool confirmed) {
  {
    std::lock_guard<util::Mutex> g(mu_);
    reqs_.for_each([&](uint64_t, Request& r) {
      if (r.link != link || !r.expired || r.final_status >= 0) return;
      (void)r.link->path->status(r.path_req);  // the path's record of it (FAILED: closed) is not needed
      if (confirmed) {
        r.final_status = int(TransferStatus::kTimeout);
        r.final_error += "; the link was aborted and the peer confirmed it stopped too: none of its writes can land "
                         "later";
      } else {
        r.final_status = int(TransferStatus::kFailed);
        r.final_error += "; the link was aborted, but the peer did not confirm it stopped: writes already on the "
                         "wire may still land";
      }
    });
  }
  cv_.notify_all();
}

void Requests::add_counts_to(Metrics::Snapshot* s) const {
  std::lock_guard<util::Mutex> g(mu_);
  counts_.add_to(s);
}

void Requests::clear() {
  std::vector<std::shared_ptr<Link>> links;  // released after mu_ (see end_locked)
  std::lock_guard<util::Mutex> g(mu_);
  reqs_.for_each([&](uint64_t, Request& r) { links.push_back(std::move(r.link)); });
  reqs_.clear();  // keeps its sequence: an id issued before is never issued again
  next_deadline_ = Clock::time_point::max();
}

}  // namespace hixl::engine
