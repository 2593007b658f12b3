// The frames a link sends on its control connection: one queue, written in order, never waited on
// under a lock. Whoever queues a frame writes what the socket takes at once (MSG_DONTWAIT, under
// `mu_`, a leaf that guards the queue only); what it does not take is written by the progress
// thread when the socket has room (POLLOUT), or by a sender waiting for its own frame (it polls the
// socket with no lock held, until its deadline).
//
// Two kinds of frame go in:
//  - post(): replies, pings and region updates: never waited for. A peer that stops reading has its
//    link closed by the progress thread once nothing could be written for kStallBound, or at once
//    past kMaxQueuedBytes (stalled()).
//  - send(): a caller's frame (a notify, a query, a goodbye) that must be written before the caller
//    goes on. Its deadline covers the time behind earlier frames: a frame not yet begun at the
//    deadline is taken out of the queue (the stream stays whole; the caller gets a timeout); one
//    begun cannot be taken back, so the connection is shut down (the link goes).
// hold() / send_first(): the handshake publishing a link holds the queue (frames queued meanwhile
// wait) until its own frame goes first; when that one cannot be sent, the connection is shut down.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "engine/internal.h"
#include "transport/oob.h"

namespace hixl::engine {

using detail::Clock;
using detail::milliseconds;

class ControlOut {
 public:
  static constexpr milliseconds kStallBound{5000};       // queued bytes none of which could be written
  static constexpr size_t kMaxQueuedBytes = 64u << 20;  // queued for one peer, at most

  explicit ControlOut(oob::Socket& sock) : sock_(sock) {}
  ControlOut(const ControlOut&) = delete;
  ControlOut& operator=(const ControlOut&) = delete;

  // Queued, written as far as the socket takes it now, never waited for. False: the connection
  // failed (it is shut down: the link goes).
  bool post(std::vector<uint8_t> bytes);
  // Queued and written before it returns, or an Error naming `what` (a frame's name) and why: the
  // connection failed (its errno), or `deadline` passed (ETIMEDOUT; see the top of this file).
  void send(std::vector<uint8_t> bytes, Clock::time_point deadline, const std::string& what);
  // Frames queued from now on wait until send_first() put its frame ahead of them.
  void hold();
  void send_first(std::vector<uint8_t> bytes, Clock::time_point deadline, const std::string& what);
  // Writes what the socket takes now. False when the connection failed.
  bool flush();

  // The progress thread: whether to poll for room, and whether the peer stopped reading (then
  // *why says how). A held queue is neither.
  bool wants_room();
  Clock::time_point progress();
  bool stalled(Clock::time_point now, std::string* why);

 private:
  struct Frame {
    uint64_t id;
    std::vector<uint8_t> bytes;
  };
  uint64_t push_locked(std::vector<uint8_t> bytes);
  // mu_ held: what the socket takes without waiting. False on a failed connection.
  bool drain_locked();
  // mu_ held: the connection is of no use any more (the first reason is kept); it is shut down.
  void fail_locked(int err, std::string why);
  // Until frame `id` is written (true), the connection fails or `deadline` passes (false: *why, and
  // *err the errno: ETIMEDOUT for the deadline).
  bool wait_written(uint64_t id, Clock::time_point deadline, std::string* why, int* err);
  bool written_locked(uint64_t id) const { return q_.empty() || q_.front().id > id; }

  oob::Socket& sock_;  // the link's control connection (its fd is set once the handshake is done)
  std::mutex mu_;  // a leaf: the fields below
  std::deque<Frame> q_;
  uint64_t next_id_ = 1;     // 0 is send_first()'s
  size_t off_ = 0;           // bytes of q_.front() already written
  size_t bytes_ = 0;         // queued, not yet written
  bool held_ = false;
  bool failed_ = false;
  std::string fail_why_;
  int fail_errno_ = 0;
  Clock::time_point progress_{};  // when the queue last became non-empty or last moved
};

}  // namespace hixl::engine
