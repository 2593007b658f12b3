#include "transport/data_path.h"

#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::transport {

using std::chrono::milliseconds;

RdmaPath::RdmaPath(std::shared_ptr<rdma::Endpoint> ep, FlagSink sink) : ep_(std::move(ep)), sink_(std::move(sink)) {
  flags_ = std::thread([this] {
    while (!stop_ && !ep_->closed()) {
      try {
        if (auto v = ep_->wait_imm(milliseconds(100))) {
          sink_(*v);
          for (uint32_t w : ep_->poll_imm(256)) sink_(w);
        }
      } catch (const std::exception& e) {
        log::warn(std::string("rdma path: receiving completion flags stopped: ") + e.what());
        return;
      }
    }
  });
}

RdmaPath::~RdmaPath() { close(); }

uint64_t RdmaPath::submit(Op op, const std::vector<Desc>& d, milliseconds timeout, Flag flag) {
  if (flag && op != Op::kWrite) throw Error("rdma path: a completion flag needs a WRITE");
  rdma::Op o = op == Op::kRead ? rdma::Op::kRead : flag ? rdma::Op::kWriteImm : rdma::Op::kWrite;
  return ep_->submit(o, d, flag.value_or(0), timeout);
}

void RdmaPath::close() {
  stop_ = true;
  ep_->close();
  std::lock_guard<std::mutex> g(join_mu_);
  if (flags_.joinable() && flags_.get_id() != std::this_thread::get_id()) flags_.join();
}

QueuedPath::~QueuedPath() { stop_worker(); }

Result QueuedPath::run(const Job& job) {
  if (closed()) return {Status::kFailed, std::string(name()) + " path closed"};
  if (Clock::now() >= job.deadline) return {Status::kTimeout, std::string(name()) + " path: deadline passed in the queue"};
  Result r = execute(job.op, job.descs, job.deadline);
  if (r.status == Status::kCompleted && job.flag) {
    try {
      flag_sender_(*job.flag);
    } catch (const std::exception& e) {
      return {Status::kFailed, std::string(name()) + " path: the bytes landed, but the completion flag " +
                                   std::to_string(*job.flag) + " could not be sent: " + e.what()};
    }
  }
  return r;
}

bool QueuedPath::closed() const {
  std::lock_guard<std::mutex> g(mu_);
  return closed_;
}

uint64_t QueuedPath::submit(Op op, const std::vector<Desc>& descs, milliseconds timeout, Flag flag) {
  if (flag && (op != Op::kWrite || !flag_sender_)) throw Error(std::string(name()) + " path: a completion flag needs a WRITE");
  uint64_t id;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) throw Error(std::string(name()) + " path is closed");
    id = next_id_++;
    live_[id] = true;
    // Asynchronous requests queue. So does a flagged synchronous one while earlier requests are
    // queued or running: its flag must follow their bytes (the caller then waits with its deadline).
    if (timeout.count() < 0 || (flag && (!queue_.empty() || worker_busy_))) {
      auto deadline = timeout.count() < 0 ? Clock::time_point::max() : Clock::now() + timeout;
      queue_.push_back({id, op, descs, flag, deadline});
      if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
      cv_.notify_all();
      return id;
    }
  }
  // Synchronous: run here (run_mu_ waits for the worker's current job; unflagged jobs queued earlier
  // may still follow, like requests on independent QPs).
  Result r;
  {
    std::lock_guard<std::mutex> g(run_mu_);
    r = run({id, op, descs, flag, Clock::now() + timeout});
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
      worker_busy_ = true;
    }
    Result r;
    {
      std::lock_guard<std::mutex> g(run_mu_);
      r = run(job);
    }
    std::lock_guard<std::mutex> g(mu_);
    worker_busy_ = false;
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

bool QueuedPath::wait_done(uint64_t req, milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  auto pred = [&] { return done_.count(req) || !live_.count(req); };
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
