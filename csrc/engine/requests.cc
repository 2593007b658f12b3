#include "engine/requests.h"

#include "verbs/log.h"

namespace hixl::engine {

uint64_t Requests::add(std::shared_ptr<Link> link, uint64_t path_req, uint64_t user_data, int timeout_ms,
                       Clock::time_point deadline) {
  std::lock_guard<std::mutex> g(mu_);
  const uint64_t id = next_++;
  Request& r = reqs_[id];
  r.link = std::move(link);
  r.path_req = path_req;
  r.user_data = user_data;
  r.timeout_ms = timeout_ms;
  r.deadline = deadline;
  if (deadline != Clock::time_point::max()) deadlines_.insert({deadline, id});
  return id;
}

rdma::RequestResult Requests::poll_locked(Request& r) {
  if (r.final_status >= 0) return {TransferStatus(r.final_status), r.final_error};
  // Past its deadline: its link is being aborted (the path may already say FAILED because of that
  // abort). finish_expired() decides between TIMEOUT and FAILED within seconds.
  if (r.expired) return {TransferStatus::kWaiting, ""};
  rdma::RequestResult res = r.link->path->status(r.path_req);
  if (res.status == TransferStatus::kFailed) {  // say why, when it is the link that went (heartbeat, peer, abort)
    std::lock_guard<std::mutex> g(r.link->mu);
    if (r.link->down) res.error += " (the link to " + r.link->key + " was closed: " + r.link->down_reason + ")";
  }
  return res;
}

void Requests::erase_locked(std::map<uint64_t, Request>::iterator it) {
  if (it->second.deadline != Clock::time_point::max()) deadlines_.erase({it->second.deadline, it->first});
  reqs_.erase(it);
}

namespace {
void log_end(uint64_t id, const rdma::RequestResult& res) {
  if (res.status == TransferStatus::kFailed || res.status == TransferStatus::kTimeout)
    log::warn("transfer request " + std::to_string(id) +
              (res.status == TransferStatus::kFailed ? " failed: " : " timed out: ") + res.error);
}
}  // namespace

std::optional<rdma::RequestResult> Requests::status(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = reqs_.find(id);
  if (it == reqs_.end()) return std::nullopt;
  rdma::RequestResult res = poll_locked(it->second);
  if (res.status != TransferStatus::kWaiting) {
    erase_locked(it);
    log_end(id, res);
  }
  return res;
}

std::pair<std::shared_ptr<transport::DataPath>, uint64_t> Requests::path_of(uint64_t id) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = reqs_.find(id);
  if (it == reqs_.end()) return {nullptr, 0};
  return {it->second.link->path, it->second.path_req};
}

std::vector<TransferResult> Requests::all(uint64_t max_count, bool skip_waiting) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<TransferResult> out;
  for (auto it = reqs_.begin(); it != reqs_.end() && out.size() < max_count;) {
    rdma::RequestResult res = poll_locked(it->second);
    uint64_t id = it->first, user_data = it->second.user_data;
    if (res.status != TransferStatus::kWaiting) {
      log_end(id, res);
      auto next = std::next(it);
      erase_locked(it);
      it = next;
    } else {
      ++it;
      if (skip_waiting) continue;
    }
    out.push_back({id, user_data, int(res.status)});
  }
  return out;
}

void Requests::wait_change(Clock::time_point until) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_until(lk, until);
}

std::vector<std::shared_ptr<Link>> Requests::expire(Clock::time_point now) {
  std::vector<std::shared_ptr<Link>> to_abort;
  std::lock_guard<std::mutex> g(mu_);
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    const uint64_t id = deadlines_.begin()->second;
    deadlines_.erase(deadlines_.begin());
    auto it = reqs_.find(id);
    if (it == reqs_.end()) continue;
    Request& r = it->second;
    if (r.expired || r.final_status >= 0) continue;
    r.deadline = Clock::time_point::max();  // out of deadlines_ now
    if (r.link->path->wait_done(r.path_req, milliseconds(0))) continue;  // ended in time; its status waits for the user
    r.expired = true;
    r.final_error = "transfer_async(req=" + std::to_string(id) + ") to " + r.link->key + ": not complete within " +
                    std::to_string(r.timeout_ms) + " ms";
    if (!r.link->aborting.exchange(true)) to_abort.push_back(r.link);
  }
  return to_abort;
}

void Requests::finish_expired(const std::shared_ptr<Link>& link, bool confirmed) {
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [id, r] : reqs_) {
      (void)id;
      if (r.link != link || !r.expired || r.final_status >= 0) continue;
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
    }
  }
  cv_.notify_all();
}

void Requests::clear() {
  std::lock_guard<std::mutex> g(mu_);
  reqs_.clear();
  deadlines_.clear();
}

}  // namespace hixl::engine
