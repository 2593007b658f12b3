// The inbox: what peers send this engine to read — notifies (name, message; at most
// kMaxUnreadNotifies unread per peer, counted across reconnects, and kMaxHeldNotifies /
// kMaxHeldNotifyBytes from all peers together), completion flags, and flag
// failures (a flag that will not come: the peer's fail_flag, or its link closed). The eventfd is
// readable exactly while flags or failures are pending (for select/poll/asyncio), and a flag
// waiter wakes for either.
//
// Locks: `notify_mu_` and `flag_mu_`, each a leaf guarding its own queue.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine/types.h"

namespace hixl::engine {

class Inbox {
 public:
  Inbox() = default;
  ~Inbox();
  Inbox(const Inbox&) = delete;
  Inbox& operator=(const Inbox&) = delete;

  // Makes the flag eventfd (throws hixl::Error); `owner` names the engine in log messages.
  void open(const std::string& owner);
  int flag_fd() const { return flag_fd_; }  // -1 before open()

  // A peer's notify: kSuccess (queued), kResourceExhausted (that peer has kMaxUnreadNotifies unread,
  // or the engine-wide bounds are reached),
  // kParamInvalid (name or message over kMaxNotifyBytes: our senders never do this).
  int offer_notify(const std::string& peer, std::string name, std::string msg);
  std::vector<Notify> take_notifies();  // every queued notify, oldest first; the unread counts restart
  // Blocks up to timeout_ms (< 0: no limit) until a notify is queued or the inbox is closed.
  void wait_notifies(int timeout_ms);

  // A flag from `peer` (beyond kMaxPendingFlags unread: dropped, with an error logged).
  void push_flag(const std::string& peer, uint32_t value);
  std::vector<FlagEvent> poll_flags(size_t max);
  // Blocks up to timeout_ms (< 0: no limit) for a flag or a failure (*out holds the flags: it may be
  // empty when a failure woke it); false when the inbox was closed.
  bool wait_flags(size_t max, int timeout_ms, std::vector<FlagEvent>* out);
  // A flag failure (bounded as flags are). Kept only once someone polled failures: until then they
  // are dropped, so that a user who never reads them is neither woken by them nor holds them.
  void push_failure(FlagFailure f);
  std::vector<FlagFailure> poll_failures(size_t max);  // the first call subscribes

  // The engine is finalizing: every waiter returns now, and every later wait at once.
  void close();

 private:
  std::vector<FlagEvent> take_flags_locked(size_t max);
  void signal_locked();    // something was queued: the eventfd becomes readable, waiters wake
  void unsignal_locked();  // after a take: not readable once both queues are empty

  std::string owner_;
  std::mutex notify_mu_;
  std::condition_variable notify_cv_;
  std::deque<Notify> notifies_;
  std::map<std::string, size_t> unread_;  // peer -> unread notifies (kept across reconnects)
  size_t held_bytes_ = 0;                 // names and messages of notifies_ (kMaxHeldNotifyBytes)
  bool full_logged_ = false;              // the engine-wide bound was hit since the last take
  bool closed_ = false;                   // under both locks

  std::mutex flag_mu_;
  std::condition_variable flag_cv_;
  std::deque<FlagEvent> flags_;
  std::deque<FlagFailure> failures_;
  bool failures_wanted_ = false;  // poll_failures() was called
  bool signalled_ = false;  // the eventfd's counter is > 0
  int flag_fd_ = -1;        // eventfd: counter > 0 exactly while flags_ or failures_ is not empty
};

}  // namespace hixl::engine
