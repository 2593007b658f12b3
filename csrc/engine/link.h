// A link: everything this engine holds for one connected peer. It owns its control connection (and
// the progress thread's incremental reader of it), its data path (rdma queue pair, shm or tcp), the
// cache of the peer's regions and the replies someone waits for. Its lock `mu` guards the region
// cache, the replies and `down`; `send_mu` serialises frames on the control connection. `mu` is a
// leaf; `send_mu` is held while taking another lock only when the link is being published (engine.h
// has the lock order), and `out_mu` (a leaf: the reply queue) may be taken under it.
//
// The progress thread never waits on one peer: its replies (acks, pongs, region lists) go to a
// bounded queue (post()), written when the socket takes them, by whoever holds the connection; a
// peer that stops reading has its link closed once nothing of its queue could be written for
// kReplyStallBound, or at once past kMaxQueuedReplyBytes.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "engine/internal.h"
#include "engine/region_table.h"
#include "transport/data_path.h"
#include "transport/oob.h"
#include "transport/rdma_endpoint.h"
#include "util/mutex.h"
#include "wire/control.h"
#include "wire/frame_reader.h"

namespace hixl::transport {
class ShmPath;
class TcpPath;
}  // namespace hixl::transport

namespace hixl::engine {

using detail::Clock;
using detail::milliseconds;

constexpr milliseconds kReplyStallBound{5000};        // a queued reply not written for this long
constexpr size_t kMaxQueuedReplyBytes = 64u << 20;    // replies queued for one peer, at most

// A peer's region list as a searchable table (the id of each entry is its position in the list).
inline std::vector<RegionEntry> to_entries(const std::vector<wire::Region>& regions) {
  std::vector<RegionEntry> out;
  out.reserve(regions.size());
  for (size_t i = 0; i < regions.size(); ++i)
    out.push_back({regions[i].addr, regions[i].len, regions[i].rkey, regions[i].access, i});
  return out;
}

class Link {
 public:
  std::string key;
  bool initiator = false;
  uint64_t id = 0;  // random, chosen by the initiator: TCP data connections name it (wire Attach)
  uint64_t peer_instance = 0;
  wire::Transport transport = wire::Transport::kNone;
  std::shared_ptr<transport::DataPath> path;  // what moves the bytes
  std::shared_ptr<rdma::Endpoint> ep;          // rdma only (for link_info): the first queue pair
  std::vector<std::shared_ptr<rdma::Endpoint>> more_eps;  // a striped link's other queue pairs
  std::vector<uint32_t> qpns() const {  // rdma: our queue pair numbers, ep's first
    std::vector<uint32_t> out;
    if (ep) out.push_back(ep->local_info().hello.qpn);
    for (const auto& m : more_eps) out.push_back(m->local_info().hello.qpn);
    return out;
  }
  transport::ShmPath* shm = nullptr;           // shm only: region extents go here
  transport::TcpPath* tcp = nullptr;           // tcp only: data connections attach here
  oob::Socket ctrl;

  std::mutex send_mu;  // one frame at a time on ctrl (the progress thread is its only reader)

  util::Mutex mu;  // below
  std::condition_variable_any cv;
  RegionTable remote;
  uint64_t remote_version = 0;
  std::set<uint64_t> pending;                 // seqs someone waits a reply for
  std::map<uint64_t, wire::Control> replies;  // only for pending seqs: nothing unsolicited piles up
  uint64_t next_seq = 1;
  bool down = false;
  std::string down_reason;

  // Heartbeat: when the progress thread last read a frame of the peer's (Clock ticks), and when the
  // watchdog last sent a Ping. aborting: the watchdog started an abort for an expired request.
  // abort_begun: abort_link() began (an expired async request, a sync timeout), or the peer's Abort is
  // being handled; a transfer failing meanwhile leaves the link to that abort.
  std::atomic<Clock::rep> last_rx{0};
  Clock::time_point last_ping{};
  // For the heartbeat's verdict on a silent peer (engine/liveness.h): its process id and whether it
  // runs on this host (same boot id), from its handshake; slow: it was found silent but alive.
  uint32_t peer_pid = 0;
  bool peer_same_host = false;
  bool slow = false;  // the watchdog's only
  std::atomic<bool> aborting{false};
  std::atomic<bool> abort_begun{false};
  std::atomic<bool> disconnecting{false};  // our disconnect() is ending it (a goodbye was sent)
  void heard() { last_rx = Clock::now().time_since_epoch().count(); }
  milliseconds silent_for(Clock::time_point now) const {
    return std::chrono::duration_cast<milliseconds>(now - Clock::time_point(Clock::duration(last_rx.load())));
  }

  // The progress thread's reading of ctrl (only it touches rx and rx_since): the frame in progress,
  // and when its first byte arrived. rx_pending_* mirror rx for the heartbeat's message (0: none;
  // type 0: its header is incomplete).
  wire::FrameReader rx;
  Clock::time_point rx_since{};
  std::atomic<size_t> rx_pending_bytes{0};
  std::atomic<uint16_t> rx_pending_type{0};
  void publish_rx() {
    rx_pending_bytes = rx.pending_bytes();
    rx_pending_type = rx.pending_header() ? uint16_t(rx.pending_header()->type) : 0;
  }
  // For messages: "" or "; 21 bytes of a Notify frame (type 7) pending, incomplete".
  std::string pending_note() const {
    const size_t n = rx_pending_bytes;
    if (!n) return "";
    const uint16_t t = rx_pending_type;
    return "; " + std::to_string(n) + " bytes of " +
           (t ? std::string("a ") + wire::frame_type_name(wire::FrameType(t)) + " frame (type " + std::to_string(t) + ")"
              : std::string("a frame header")) +
           " pending, incomplete";
  }
  bool is_down() {
    std::lock_guard<util::Mutex> g(mu);
    return down;
  }

  // A frame that could not be sent whole leaves the stream unusable: shut the socket down so the
  // progress thread retires the link, and report the failure. Queued replies go first (in order).
  void send(const wire::Control& c, Clock::time_point deadline) {
    auto bytes = wire::encode_control(c);
    deadline = std::min(deadline, Clock::now() + milliseconds(5000));  // a peer that stops reading
    std::lock_guard<std::mutex> g(send_mu);
    write_locked(bytes, deadline);
  }
  // The progress thread's replies and the watchdog's pings: queued, never waited for (see the top
  // of this file).
  void post(const wire::Control& c) { post(wire::encode_control(c)); }
  // A frame already encoded (the same one for several links is encoded once).
  void post(std::vector<uint8_t> bytes) {
    {
      std::lock_guard<std::mutex> g(out_mu);
      if (outq.empty()) out_progress = Clock::now();
      out_bytes += bytes.size();
      outq.push_back(std::move(bytes));
    }
    flush();
  }
  // Writes what the socket takes now, unless a sender holds the connection (it writes the queue
  // first). False when the connection failed (the socket is shut down: the link goes).
  // `wait_until`: a sender holding the connection (the watchdog posting a ping, a user's notify) is
  // waited for until then, for a closing link's last reply (an AbortAck): the shutdown right after
  // would drop what that sender has not written (the peer's abort went unconfirmed: its transfers
  // ended FAILED instead of TIMEOUT). By default it is left to that sender.
  bool flush(Clock::time_point wait_until = Clock::time_point::min()) {
    for (;;) {
      {
        std::unique_lock<std::mutex> g(send_mu, std::try_to_lock);
        if (g.owns_lock()) {
          std::lock_guard<std::mutex> q(out_mu);
          return drain_nonblocking_locked();
        }
      }
      if (Clock::now() >= wait_until) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // Bytes of replies queued and not written, and since when none could be written (the progress
  // thread closes a link stalled past kReplyStallBound); `writing`: a sender holds the connection.
  size_t queued_reply_bytes() {
    std::lock_guard<std::mutex> q(out_mu);
    return out_bytes;
  }
  Clock::time_point reply_progress() {
    std::lock_guard<std::mutex> q(out_mu);
    return out_progress;
  }
  std::atomic<bool> writing{false};

  // A new sequence number whose reply wait_reply() will collect.
  uint64_t expect() {
    std::lock_guard<util::Mutex> g(mu);
    uint64_t seq = next_seq++;
    pending.insert(seq);
    return seq;
  }
  void forget(uint64_t seq) {
    std::lock_guard<util::Mutex> g(mu);
    pending.erase(seq);
    replies.erase(seq);
  }
  void deliver(const wire::Control& c) {
    std::lock_guard<util::Mutex> g(mu);
    if (!pending.count(c.seq)) return;  // late (its waiter gave up) or unsolicited
    replies[c.seq] = c;
    cv.notify_all();
  }
  // The reply to `seq`; nullopt when the deadline passed or the link went down first.
  std::optional<wire::Control> wait_reply(uint64_t seq, Clock::time_point deadline, bool* went_down) {
    std::unique_lock<util::Mutex> lk(mu);
    cv.wait_until(lk, deadline, [&] { return down || replies.count(seq); });
    pending.erase(seq);
    auto it = replies.find(seq);
    if (it == replies.end()) {
      if (went_down) *went_down = down;
      return std::nullopt;
    }
    wire::Control c = std::move(it->second);
    replies.erase(it);
    return c;
  }
  void set_regions(const std::vector<wire::Region>& regions, uint64_t version) {
    std::lock_guard<util::Mutex> g(mu);
    if (version < remote_version) return;  // an older list overtaken by a newer one
    remote_version = version;
    remote.assign(to_entries(regions));
  }

 private:
  // send_mu held: the queued replies (blocking, each frame whole), `bytes`, then what was queued
  // meanwhile (non-blocking). Throws (after shutting the socket down) when a frame cannot be sent.
  void write_locked(const std::vector<uint8_t>& bytes, Clock::time_point deadline) {
    writing = true;
    try {
      for (;;) {
        std::vector<uint8_t> rest;
        {
          std::lock_guard<std::mutex> q(out_mu);
          if (outq.empty()) break;
          rest.assign(outq.front().begin() + std::ptrdiff_t(out_off), outq.front().end());
          out_bytes -= rest.size();
          out_off = 0;
          outq.pop_front();
          out_progress = Clock::now();
        }
        oob::send_all(ctrl, rest, deadline);
      }
      oob::send_all(ctrl, bytes, deadline);
    } catch (...) {
      writing = false;
      ctrl.shutdown();
      throw;
    }
    writing = false;
    std::lock_guard<std::mutex> q(out_mu);
    drain_nonblocking_locked();
  }
  // send_mu and out_mu held: what the socket takes without waiting. False on a failed connection.
  bool drain_nonblocking_locked() {
    while (!outq.empty()) {
      const std::vector<uint8_t>& f = outq.front();
      ssize_t n = ::send(ctrl.fd(), f.data() + out_off, f.size() - out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n <= 0) {
        ctrl.shutdown();
        return false;
      }
      out_progress = Clock::now();
      out_off += size_t(n);
      out_bytes -= size_t(n);
      if (out_off == f.size()) {
        outq.pop_front();
        out_off = 0;
      }
    }
    return true;
  }

  std::mutex out_mu;  // below (a leaf; taken under send_mu by writers)
  std::deque<std::vector<uint8_t>> outq;
  size_t out_off = 0;    // bytes of outq.front() already written
  size_t out_bytes = 0;  // queued, not yet written
  Clock::time_point out_progress{};  // when the queue last became non-empty or last moved
};

}  // namespace hixl::engine
