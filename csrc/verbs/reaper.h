// Releases objects in one background thread, for destructors that can block in the kernel for as
// long as a link is stuck. ibv_destroy_qp is one: Soft-RoCE (rxe) waits until every packet of the
// queue pair still in its NIC's transmit queue has left, so with the link stalled (a peer host
// frozen) it returned only when the peer went on, 100 s later. Run on a caller's transfer_wait() or
// the engine's progress thread, that one wait became everybody's. rdma::Endpoint hands its queue pair
// here (the QP holds its CQs, channels and PD, so they go after it, in order).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace hixl::verbs {

class Reaper {
 public:
  // The process's reaper. Never destroyed: its thread may be blocked in the kernel at exit.
  static Reaper& instance();
  // The release logs a warning naming `what` when it takes longer than this.
  static constexpr std::chrono::milliseconds kSlow{1000};

  explicit Reaper(bool detached = false) : detached_(detached) {}
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;
  ~Reaper();  // (a test's own reaper) joins its thread after releasing what is queued

  // Drops obj's reference in the reaper's thread, in the order handed over; returns at once.
  void release(std::shared_ptr<void> obj, std::string what);
  // Objects handed over and not yet released.
  size_t pending() const;
  // Waits until nothing is pending or the timeout passed; true when nothing is.
  bool drain(std::chrono::milliseconds timeout);

 private:
  void run();
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<void>, std::string>> queue_;
  size_t busy_ = 0;  // 1 while the thread releases an object it took off queue_
  const bool detached_;  // the process's: its thread is never joined
  bool started_ = false, stop_ = false;
  std::unique_ptr<std::thread> thread_;
};

}  // namespace hixl::verbs
