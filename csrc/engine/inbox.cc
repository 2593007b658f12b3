#include "engine/inbox.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>

#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::engine {

namespace {
// Waits on cv (lk held) until pred holds, for at most timeout_ms (< 0: no limit).
template <class Pred>
void wait_up_to(std::condition_variable& cv, std::unique_lock<std::mutex>& lk, int timeout_ms, Pred pred) {
  if (timeout_ms < 0)
    cv.wait(lk, pred);
  else
    cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), pred);
}
}  // namespace

Inbox::~Inbox() {
  if (flag_fd_ >= 0) ::close(flag_fd_);
}

void Inbox::open(const std::string& owner) {
  owner_ = owner;
  if (flag_fd_ >= 0) return;
  int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) throw_errno("eventfd", errno);
  flag_fd_ = fd;
}

int Inbox::offer_notify(const std::string& peer, std::string name, std::string msg) {
  if (name.size() > kMaxNotifyBytes || msg.size() > kMaxNotifyBytes) return kParamInvalid;
  std::lock_guard<std::mutex> g(notify_mu_);
  size_t& unread = unread_[peer];  // per peer, so reconnecting does not reset it
  if (unread >= kMaxUnreadNotifies) return kResourceExhausted;
  const size_t bytes = name.size() + msg.size();
  if (notifies_.size() >= kMaxHeldNotifies || held_bytes_ + bytes > kMaxHeldNotifyBytes) {
    if (!full_logged_)
      log::warn("engine " + owner_ + ": " + std::to_string(notifies_.size()) + " notifies (" +
                std::to_string(held_bytes_) + " bytes) unread, the most one engine holds (" +
                std::to_string(kMaxHeldNotifies) + ", " + std::to_string(kMaxHeldNotifyBytes) +
                " bytes): refusing more (RESOURCE_EXHAUSTED) until get_notifies() reads them; first from " + peer);
    full_logged_ = true;
    return kResourceExhausted;
  }
  ++unread;
  held_bytes_ += bytes;
  notifies_.push_back({std::move(name), std::move(msg)});
  notify_cv_.notify_all();
  return kSuccess;
}

std::vector<Notify> Inbox::take_notifies() {
  std::lock_guard<std::mutex> g(notify_mu_);
  std::vector<Notify> out(std::make_move_iterator(notifies_.begin()), std::make_move_iterator(notifies_.end()));
  notifies_.clear();
  unread_.clear();
  held_bytes_ = 0;
  full_logged_ = false;
  return out;
}

void Inbox::wait_notifies(int timeout_ms) {
  std::unique_lock<std::mutex> lk(notify_mu_);
  wait_up_to(notify_cv_, lk, timeout_ms, [&] { return !notifies_.empty() || closed_; });
}

namespace {
// Up to max entries from the front of q, oldest first.
template <class T>
std::vector<T> take_front(std::deque<T>& q, size_t max) {
  std::vector<T> out;
  while (!q.empty() && out.size() < max) {
    out.push_back(std::move(q.front()));
    q.pop_front();
  }
  return out;
}
}  // namespace

void Inbox::push_flag(const std::string& peer, uint32_t value) {
  std::lock_guard<std::mutex> g(flag_mu_);
  if (flags_.size() >= kMaxPendingFlags) {
    log::error("engine " + owner_ + ": " + std::to_string(flags_.size()) +
               " completion flags pending, nobody reads them: dropping flag " + std::to_string(value) + " from " + peer);
    return;
  }
  flags_.push_back({peer, value});
  signal_locked();
}

void Inbox::push_failure(FlagFailure f) {
  std::lock_guard<std::mutex> g(flag_mu_);
  if (!failures_wanted_) return;
  if (failures_.size() >= kMaxPendingFlags) {
    log::error("engine " + owner_ + ": " + std::to_string(failures_.size()) +
               " flag failures pending, nobody reads them: dropping one from " + f.peer + ": " + f.reason);
    return;
  }
  failures_.push_back(std::move(f));
  signal_locked();
}

void Inbox::signal_locked() {
  if (!signalled_ && flag_fd_ >= 0) {
    uint64_t one = 1;
    ssize_t rc = ::write(flag_fd_, &one, sizeof one);
    (void)rc;
    signalled_ = true;
  }
  flag_cv_.notify_all();
}

void Inbox::unsignal_locked() {
  if (signalled_ && flags_.empty() && failures_.empty()) {
    uint64_t v;
    ssize_t rc = ::read(flag_fd_, &v, sizeof v);  // back to "not readable"
    (void)rc;
    signalled_ = false;
  }
}

std::vector<FlagFailure> Inbox::poll_failures(size_t max) {
  std::lock_guard<std::mutex> g(flag_mu_);
  failures_wanted_ = true;
  std::vector<FlagFailure> out = take_front(failures_, max);
  unsignal_locked();
  return out;
}

std::vector<FlagEvent> Inbox::take_flags_locked(size_t max) {
  std::vector<FlagEvent> out = take_front(flags_, max);
  unsignal_locked();
  return out;
}

std::vector<FlagEvent> Inbox::poll_flags(size_t max) {
  std::lock_guard<std::mutex> g(flag_mu_);
  return take_flags_locked(max);
}

bool Inbox::wait_flags(size_t max, int timeout_ms, std::vector<FlagEvent>* out) {
  std::unique_lock<std::mutex> lk(flag_mu_);
  wait_up_to(flag_cv_, lk, timeout_ms, [&] { return !flags_.empty() || !failures_.empty() || closed_; });
  if (closed_) return false;
  *out = take_flags_locked(max);
  return true;
}

void Inbox::close() {
  {
    std::scoped_lock g(notify_mu_, flag_mu_);
    closed_ = true;
  }
  notify_cv_.notify_all();
  flag_cv_.notify_all();
}

}  // namespace hixl::engine
