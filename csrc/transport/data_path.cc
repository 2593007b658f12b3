#include "transport/data_path.h"

#include "verbs/error.h"

namespace hixl::transport {

using std::chrono::milliseconds;

QueuedPath::~QueuedPath() { stop_worker(); }

bool QueuedPath::closed() const {
  std::lock_guard<std::mutex> g(mu_);
  return closed_;
}

uint64_t QueuedPath::submit(Op op, const std::vector<Desc>& descs, milliseconds timeout) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) throw Error(std::string(name()) + " path is closed");
    id = next_id_++;
    live_[id] = true;
    if (timeout.count() < 0) {
      queue_.push_back({id, op, descs});
      if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
      cv_.notify_all();
      return id;
    }
  }
  // Synchronous: run here, after whatever was queued before (run_mu_ keeps submission order for the
  // worker's current job; queued jobs submitted earlier may still follow, like independent QPs).
  Result r;
  {
    std::lock_guard<std::mutex> run(run_mu_);
    if (closed()) {
      r = {Status::kFailed, std::string(name()) + " path closed"};
    } else {
      r = execute(op, descs, Clock::now() + timeout);
    }
  }
  std::lock_guard<std::mutex> g(mu_);
  done_[id] = r;
  cv_.notify_all();
  return id;
}

void QueuedPath::worker_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return closed_ || !queue_.empty(); });
      if (closed_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    Result r;
    {
      std::lock_guard<std::mutex> run(run_mu_);
      r = closed() ? Result{Status::kFailed, std::string(name()) + " path closed"}
                   : execute(job.op, job.descs, Clock::time_point::max());
    }
    std::lock_guard<std::mutex> g(mu_);
    done_[job.id] = r;
    cv_.notify_all();
  }
}

Result QueuedPath::status(uint64_t req) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = done_.find(req);
  if (it != done_.end()) {
    Result r = it->second;
    done_.erase(it);
    live_.erase(req);
    return r;
  }
  if (live_.count(req)) return {Status::kWaiting, ""};
  return {Status::kFailed, "unknown request " + std::to_string(req)};
}

Result QueuedPath::wait(uint64_t req, milliseconds timeout) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    auto pred = [&] { return done_.count(req) || !live_.count(req); };
    if (timeout.count() < 0)
      cv_.wait(lk, pred);
    else
      cv_.wait_for(lk, timeout, pred);
  }
  return status(req);
}

void QueuedPath::stop_worker() {
  bool first;
  {
    std::lock_guard<std::mutex> g(mu_);
    first = !closed_;
    closed_ = true;  // submit() refuses from now on, so worker_ is not started any more
    for (auto& j : queue_) done_[j.id] = {Status::kFailed, std::string(name()) + " path closed before the request ran"};
    queue_.clear();
    cv_.notify_all();
  }
  if (first) interrupt();  // a running execute() notices closed() or its sockets failing
  std::lock_guard<std::mutex> j(join_mu_);
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

void QueuedPath::close() {
  stop_worker();
  std::lock_guard<std::mutex> run(run_mu_);  // a synchronous execute() in another thread has returned
}

}  // namespace hixl::transport
