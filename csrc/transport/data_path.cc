#include "transport/data_path.h"

#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::transport {

using std::chrono::milliseconds;

QueuedPath::~QueuedPath() { stop_worker(); }

Result QueuedPath::run(Op op, const std::vector<Desc>& descs, Flag flag, Clock::time_point deadline) {
  if (closed()) return {Status::kFailed, std::string(name()) + " path closed"};
  if (Clock::now() >= deadline) return {Status::kTimeout, std::string(name()) + " path: deadline passed in the queue"};
  Result r = execute(op, descs, deadline);
  if (r.status == Status::kCompleted && flag) {
    try {
      flag_sender_(*flag);
    } catch (const std::exception& e) {
      return {Status::kFailed, std::string(name()) + " path: the bytes landed, but the completion flag " +
                                   std::to_string(*flag) + " could not be sent: " + e.what()};
    }
  }
  return r;
}

bool QueuedPath::closed() const { return closed_.load(std::memory_order_acquire); }

void QueuedPath::finish(uint64_t id, Result r) {
  std::lock_guard<std::mutex> g(mu_);
  --running_;
  if (Entry* e = reqs_.find(id)) {
    e->done = true;
    e->result = std::move(r);
  }
  cv_.notify_all();
}

uint64_t QueuedPath::submit(Op op, const std::vector<Desc>& descs, milliseconds timeout, Flag flag) {
  if (flag && (op != Op::kWrite || !flag_sender_)) throw Error(std::string(name()) + " path: a completion flag needs a WRITE");
  const bool async = timeout.count() < 0;
  const uint64_t inline_max = async ? inline_bytes() : 0;
  bool small = inline_max > 0;
  if (small) {
    uint64_t bytes = 0;
    for (const Desc& d : descs)
      if ((bytes += d.length) > inline_max) {
        small = false;
        break;
      }
  }
  const auto deadline = async ? Clock::time_point::max() : Clock::now() + timeout;
  uint64_t id;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) throw Error(std::string(name()) + " path is closed");
    id = reqs_.add(Entry{});
    if (!id)
      throw Error(std::string(name()) + " path: " + std::to_string(reqs_.size()) +
                      " requests not yet collected with status()/wait()", EAGAIN);
    const bool idle = queue_.empty() && running_ == 0;
    // Asynchronous requests queue (unless small and nothing is ahead of them). So does a flagged
    // synchronous one while earlier requests are queued or running: its flag must follow their
    // bytes (the caller then waits with its deadline).
    if ((async && !(small && idle)) || (!async && flag && !idle)) {
      queue_.push_back({id, op, descs, flag, deadline});
      if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
      cv_.notify_all();
      return id;
    }
    ++running_;
  }
  // Here: synchronous (run_mu_ waits for the worker's current job, until our deadline; unflagged
  // jobs queued earlier may still follow, like requests on independent QPs), or small with nothing
  // ahead of it.
  finish(id, run_locked(op, descs, flag, deadline));
  return id;
}

Result QueuedPath::run_locked(Op op, const std::vector<Desc>& descs, Flag flag, Clock::time_point deadline) {
  std::unique_lock<std::timed_mutex> g(run_mu_, std::defer_lock);
  if (deadline == Clock::time_point::max())
    g.lock();
  else if (!g.try_lock_until(deadline))
    return {Status::kTimeout, std::string(name()) + " path: the link's request before this one still ran at the deadline"};
  return run(op, descs, flag, deadline);
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
      ++running_;
    }
    finish(job.id, run_locked(job.op, job.descs, job.flag, job.deadline));
  }
}

Result QueuedPath::status(uint64_t req) {
  std::lock_guard<std::mutex> g(mu_);
  Entry* e = reqs_.find(req);
  if (!e) return {Status::kFailed, "unknown request " + std::to_string(req)};
  if (!e->done) return Result(Status::kWaiting);
  Result r = std::move(e->result);
  reqs_.erase(req);
  return r;
}

bool QueuedPath::wait_done(uint64_t req, milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  auto pred = [&] {
    const Entry* e = reqs_.find(req);
    return !e || e->done;
  };
  if (timeout.count() < 0) {
    cv_.wait(lk, pred);
    return true;
  }
  return cv_.wait_for(lk, timeout, pred);
}

Result QueuedPath::wait(uint64_t req, milliseconds timeout) {
  wait_done(req, timeout);
  return status(req);
}

void QueuedPath::stop_worker() {
  bool first;
  {
    std::lock_guard<std::mutex> g(mu_);
    first = !closed_;
    closed_ = true;  // submit() refuses from now on, so worker_ is not started any more
    for (auto& j : queue_)
      if (Entry* e = reqs_.find(j.id)) {
        e->done = true;
        e->result = {Status::kFailed, std::string(name()) + " path closed before the request ran"};
      }
    queue_.clear();
    cv_.notify_all();
  }
  if (first) interrupt();  // a running execute() notices closed() or its sockets failing
  std::lock_guard<std::mutex> j(join_mu_);
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

void QueuedPath::close() {
  stop_worker();
  std::lock_guard<std::timed_mutex> run(run_mu_);  // a synchronous execute() in another thread has returned
}

}  // namespace hixl::transport
