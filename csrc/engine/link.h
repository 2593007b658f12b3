// A link: everything this engine holds for one connected peer. It owns its control connection (and
// the progress thread's incremental reader of it), its data path (rdma queue pair, shm or tcp), the
// cache of the peer's regions and the replies someone waits for. Its lock `mu` guards the region
// cache, the replies and `down`. `mu` is a leaf. Frames to the peer go through `out`
// (control_out.h): one queue, never waited on under a lock.
//
// The progress thread never waits on one peer: its replies (acks, pongs, region lists) are queued
// (post()) and written when the socket takes them; a peer that stops reading has its link closed
// once nothing of its queue could be written for ControlOut::kStallBound, or at once past
// ControlOut::kMaxQueuedBytes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/control_out.h"
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
  ControlOut out{ctrl};  // what we send on ctrl (the progress thread is its only reader)

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

  // Frames to the peer: a caller's, written before send() returns (or an Error: the connection
  // failed, or the deadline passed, which covers the time behind earlier frames: control_out.h),
  // and the progress thread's replies and the watchdog's pings, queued and never waited for.
  void send(const wire::Control& c, Clock::time_point deadline) {
    deadline = std::min(deadline, Clock::now() + milliseconds(5000));  // a peer that stops reading
    out.send(wire::encode_control(c), deadline, std::string("a ") + wire::frame_type_name(c.type) + " frame to " + key);
  }
  void post(const wire::Control& c) { post(wire::encode_control(c)); }
  // A frame already encoded (the same one for several links is encoded once).
  void post(std::vector<uint8_t> bytes) { out.post(std::move(bytes)); }
  // Writes what the socket takes now. False when the connection failed (the link goes).
  bool flush() { return out.flush(); }

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

};

}  // namespace hixl::engine
