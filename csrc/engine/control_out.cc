#include "engine/control_out.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "verbs/error.h"

namespace hixl::engine {

uint64_t ControlOut::push_locked(std::vector<uint8_t> bytes) {
  if (q_.empty()) progress_ = Clock::now();
  bytes_ += bytes.size();
  const uint64_t id = next_id_++;
  q_.push_back({id, std::move(bytes)});
  return id;
}

bool ControlOut::post(std::vector<uint8_t> bytes) {
  std::lock_guard<std::mutex> g(mu_);
  push_locked(std::move(bytes));
  return drain_locked();
}

void ControlOut::send(std::vector<uint8_t> bytes, Clock::time_point deadline, const std::string& what) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> g(mu_);
    id = push_locked(std::move(bytes));
  }
  std::string why;
  int err = 0;
  if (!wait_written(id, deadline, &why, &err)) throw Error("sending " + what + " on the control connection: " + why, err);
}

void ControlOut::hold() {
  std::lock_guard<std::mutex> g(mu_);
  held_ = true;
}

void ControlOut::send_first(std::vector<uint8_t> bytes, Clock::time_point deadline, const std::string& what) {
  {
    std::lock_guard<std::mutex> g(mu_);
    progress_ = Clock::now();
    bytes_ += bytes.size();
    off_ = 0;  // nothing was written while held
    q_.push_front({0, std::move(bytes)});
    held_ = false;
  }
  std::string why;
  int err = 0;
  if (wait_written(0, deadline, &why, &err)) return;
  {  // a connection whose first frame did not go out is of no use: the link goes
    std::lock_guard<std::mutex> g(mu_);
    fail_locked(err, "the first frame was not sent");
  }
  throw Error("sending " + what + " on the control connection: " + why, err);
}

void ControlOut::fail_locked(int err, std::string why) {
  if (!failed_) fail_errno_ = err, fail_why_ = std::move(why);
  failed_ = true;
  sock_.shutdown();
}

bool ControlOut::flush() {
  std::lock_guard<std::mutex> g(mu_);
  return drain_locked();
}

bool ControlOut::drain_locked() {
  if (failed_) return false;
  if (held_) return true;
  while (!q_.empty()) {
    const std::vector<uint8_t>& f = q_.front().bytes;
    ssize_t n = ::send(sock_.fd(), f.data() + off_, f.size() - off_, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) {
      const int e = n < 0 ? errno : EPIPE;
      fail_locked(e, n < 0 ? "send: " + errno_str(e) : std::string("send wrote nothing"));
      return false;
    }
    progress_ = Clock::now();
    off_ += size_t(n);
    bytes_ -= size_t(n);
    if (off_ == f.size()) {
      q_.pop_front();
      off_ = 0;
    }
  }
  return true;
}

bool ControlOut::wait_written(uint64_t id, Clock::time_point deadline, std::string* why, int* err) {
  for (;;) {
    bool held;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!drain_locked()) {
        *why = "the connection failed (" + fail_why_ + ")";
        *err = fail_errno_;
        return false;
      }
      if (written_locked(id)) return true;
      if (Clock::now() >= deadline) {
        *err = ETIMEDOUT;
        auto it = std::find_if(q_.begin(), q_.end(), [&](const Frame& f) { return f.id == id; });
        if (it == q_.end()) return true;
        if (it == q_.begin() && off_ > 0) {  // begun: the rest cannot be taken back, nor left half sent
          *why = "timed out with " + std::to_string(off_) + " of its " + std::to_string(it->bytes.size()) +
                 " bytes written: the peer is not reading; the connection is shut down";
          fail_locked(ETIMEDOUT, "a frame was left half written");
          return false;
        }
        const size_t ahead = bytes_ - it->bytes.size();
        bytes_ -= it->bytes.size();
        q_.erase(it);
        *why = held_ ? std::string("timed out while the link was being set up")
                     : "timed out behind " + std::to_string(ahead) + " bytes the peer has not read (nothing of it was sent)";
        return false;
      }
      held = held_;
    }
    // No lock held: wait for room in the socket (or, while held, for the handshake to go first).
    const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now());
    const int ms = int(std::clamp<milliseconds::rep>(left.count(), 0, 10));
    if (held) {
      std::this_thread::sleep_for(milliseconds(std::min(ms, 1)));
      continue;
    }
    pollfd p{sock_.fd(), POLLOUT, 0};
    ::poll(&p, 1, ms);
  }
}

bool ControlOut::wants_room() {
  std::lock_guard<std::mutex> g(mu_);
  return !held_ && !failed_ && !q_.empty();
}

Clock::time_point ControlOut::progress() {
  std::lock_guard<std::mutex> g(mu_);
  return progress_;
}

bool ControlOut::stalled(Clock::time_point now, std::string* why) {
  std::lock_guard<std::mutex> g(mu_);
  if (held_ || q_.empty()) return false;
  const auto idle = std::chrono::duration_cast<milliseconds>(now - progress_);
  if (bytes_ <= kMaxQueuedBytes && idle < kStallBound) return false;
  *why = "the peer stopped reading its control connection: " + std::to_string(bytes_) +
         " bytes of our frames queued, none written for " + std::to_string(idle.count()) +
         " ms (the bounds: " + std::to_string(kStallBound.count()) + " ms, " + std::to_string(kMaxQueuedBytes) +
         " bytes)";
  return true;
}

}  // namespace hixl::engine
