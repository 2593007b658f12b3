#include "verbs/reaper.h"

#include <thread>

#include "verbs/log.h"

namespace hixl::verbs {

Reaper& Reaper::instance() {
  static Reaper* r = new Reaper(true);  // leaked on purpose (see reaper.h)
  return *r;
}

Reaper::~Reaper() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_ && thread_->joinable()) thread_->join();
}

void Reaper::release(std::shared_ptr<void> obj, std::string what) {
  if (!obj) return;
  std::lock_guard<std::mutex> g(mu_);
  queue_.emplace_back(std::move(obj), std::move(what));
  if (!started_) {
    started_ = true;
    thread_ = std::make_unique<std::thread>([this] { run(); });
    if (detached_) thread_->detach();
  }
  cv_.notify_all();
}

size_t Reaper::pending() const {
  std::lock_guard<std::mutex> g(mu_);
  return queue_.size() + busy_;
}

bool Reaper::drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, timeout, [this] { return queue_.empty() && busy_ == 0; });
}

void Reaper::run() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, and everything released
    auto [obj, what] = std::move(queue_.front());
    queue_.pop_front();
    busy_ = 1;
    lk.unlock();
    const auto t0 = std::chrono::steady_clock::now();
    obj.reset();  // the destructor may block (reaper.h)
    const auto took = std::chrono::steady_clock::now() - t0;
    if (took > kSlow)
      log::warn(what + " took " +
                std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) +
                " ms to release (in the background: nobody waited for it)");
    lk.lock();
    busy_ = 0;
    cv_.notify_all();
  }
}

}  // namespace hixl::verbs
