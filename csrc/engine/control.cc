// The control loop: the progress thread reading every link's control connection (incrementally)
// and handling its frames, the watchdog (heartbeat, request expiry), and region pushes to peers.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "engine/engine.h"
#include "engine/internal.h"
#include "engine/liveness.h"
#include "transport/shm_path.h"
#include "verbs/error.h"
#include "verbs/log.h"
#include "wire/frame_reader.h"

namespace hixl::engine {

using namespace detail;

namespace {
// A control frame whose first byte arrived must be complete within this, or its link is closed: the
// bound the progress thread's blocking read of a frame had before it read incrementally, so a peer
// that was fine then is fine now (a frame is written whole; only a hung or hostile peer stops
// inside one). It holds up no other link meanwhile.
constexpr milliseconds kFrameCompleteBound{2000};
constexpr size_t kControlReadBytes = 64 * 1024;  // one read per link and round: a flood holds up no one
}  // namespace

// Queued on each link, never waited for: a peer that stopped reading costs (de)registration nothing;
// the progress thread closes its link once its queue stalls (close_if_not_reading). A frame sent on
// the link later (a notify) goes after the queued update, so a peer told of a region knows it.
void Engine::push_regions() {
  std::vector<std::shared_ptr<Link>> links = links_.all();
  if (links.empty()) return;
  std::lock_guard<std::mutex> g(push_mu_);  // the snapshot below is queued after any queued before
  wire::Control c;
  c.type = wire::FrameType::kRegions;
  c.regions = registry_.regions(&c.version);
  c.extents = registry_.extents();
  std::vector<uint8_t> bytes;
  try {
    bytes = wire::encode_control(c);
  } catch (const std::exception& e) {  // a frame over the wire's limit (tens of thousands of regions)
    log::warn(std::string("region update not sent: ") + e.what());
    return;
  }
  for (auto& l : links) l->post(bytes);
}

void Engine::handle_frame(const std::shared_ptr<Link>& link, const wire::Control& c) {
  switch (c.type) {
    case wire::FrameType::kNotify: {
      wire::Control ack;
      ack.type = wire::FrameType::kNotifyAck;
      ack.seq = c.seq;
      ack.status = uint32_t(inbox_.offer_notify(link->key, c.name, c.text));  // too long: a hostile or broken peer
      if (ack.status == kSuccess) metrics_.notify_received();
      link->post(ack);
      break;
    }
    case wire::FrameType::kNotifyAck:
    case wire::FrameType::kAbortAck: link->deliver(c); break;
    case wire::FrameType::kRegions:
      if (link->shm) {  // the path first: a region the link then offers is one the path can reach
        link->shm->set_extents(c.extents);
        link->shm->set_regions(c.regions, c.version);
      }
      link->set_regions(c.regions, c.version);
      if (c.seq) link->deliver(c);
      break;
    case wire::FrameType::kRegionsReq: {
      wire::Control r;
      r.type = wire::FrameType::kRegions;
      r.seq = c.seq;
      r.regions = registry_.regions(&r.version);
      r.extents = registry_.extents();
      link->post(r);
      break;
    }
    case wire::FrameType::kAbort: {
      // Our own transfers on it fail once the path closes: they leave the link to this handler, which
      // must post the confirmation before the link goes (see Engine::transfer_failed()).
      link->abort_begun = true;
      if (link->path) link->path->close();  // our side stopped before we confirm: nothing more lands here
      wire::Control ack;
      ack.type = wire::FrameType::kAbortAck;
      ack.seq = c.seq;
      link->post(ack);  // written before the link goes (remove_link flushes what the socket takes)
      remove_link(link, "peer aborted the link: " + c.text, Metrics::Cause::kAbort);
      break;
    }
    case wire::FrameType::kBye: remove_link(link, "peer disconnected: " + c.text, Metrics::Cause::kPeerClosed); break;
    case wire::FrameType::kFlag: inbox_.push_flag(link->key, c.status); break;
    case wire::FrameType::kFlagFailed: inbox_.push_failure({link->key, int64_t(c.status), c.text}); break;
    case wire::FrameType::kPing: {
      wire::Control pong;
      pong.type = wire::FrameType::kPong;
      link->post(pong);
      break;
    }
    case wire::FrameType::kPong: break;  // progress_loop() noted that the peer is alive
    default: throw Error("unexpected control frame type " + std::to_string(int(c.type)));
  }
}

void Engine::read_control(const std::shared_ptr<Link>& link) {
  uint8_t buf[kControlReadBytes];
  ssize_t n;
  do n = ::recv(link->ctrl.fd(), buf, sizeof buf, MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    throw_errno(CallDesc("recv").arg("fd", link->ctrl.fd()).str(), errno);
  }
  wire::FrameReader& rx = link->rx;
  if (n == 0)
    throw Error("peer closed the connection" +
                    (rx.pending_bytes() ? " in the middle of a frame (" + rx.describe_pending() + " had arrived)"
                                        : std::string()),
                ECONNRESET);
  const bool continued = rx.pending_bytes() > 0;
  bool completed = false;
  for (size_t used = 0; used < size_t(n);) {
    used += rx.feed(buf + used, size_t(n) - used);  // throws on a header the blocking reads refuse too
    if (!rx.has_frame()) continue;
    wire::Frame f = rx.take();
    completed = true;
    link->heard();
    handle_frame(link, wire::parse_control(f.header.type, f.payload.data(), f.payload.size()));
    if (link->is_down()) return;  // a goodbye or an abort: what follows is not for us
  }
  if (rx.pending_bytes() && (completed || !continued)) link->rx_since = Clock::now();  // a new frame began
  link->publish_rx();
}

void Engine::close_if_frame_stuck(const std::shared_ptr<Link>& link, Clock::time_point now) {
  if (!link->rx.pending_bytes() || now - link->rx_since < kFrameCompleteBound || link->is_down()) return;
  const auto ms = std::chrono::duration_cast<milliseconds>(now - link->rx_since).count();
  const std::string why = "a control frame incomplete for " + std::to_string(ms) + " ms (the bound is " +
                          std::to_string(kFrameCompleteBound.count()) + " ms): " + link->rx.describe_pending() +
                          " arrived, then nothing: the peer is hung or broken";
  log::warn("engine " + name_ + ": link to " + link->key + ": " + why + "; closing it");
  remove_link(link, why, Metrics::Cause::kStuckFrame);
}

void Engine::close_if_not_reading(const std::shared_ptr<Link>& link, Clock::time_point now) {
  std::string why;
  if (link->is_down() || !link->out.stalled(now, &why)) return;
  log::warn("engine " + name_ + ": link to " + link->key + ": " + why + "; closing it");
  remove_link(link, why, Metrics::Cause::kStalled);
}

// rdma: QP -> ERR; shm/tcp: copies stopped, the peer's requests refused. The progress and watchdog
// threads carry every link's frames and pings, so they hand the wait for a running request to a
// worker: a request in flight must not silence the engine towards its other peers.
void Engine::close_path(const std::shared_ptr<transport::DataPath>& path, Metrics::Cause cause) {
  const auto self = std::this_thread::get_id();
  if (cause != Metrics::Cause::kFinalize && (self == progress_id_.load() || self == watchdog_id_.load())) {
    try {
      spawn([path] { path->close(); });
      return;
    } catch (const std::exception&) {  // finalizing: close it here, finalize() waits for it anyway
    }
  }
  path->close();
}

void Engine::progress_loop() {
  progress_id_ = std::this_thread::get_id();
  std::vector<pollfd> pfds;
  std::vector<std::shared_ptr<Link>> polled;
  while (!stop_) {
    pfds.clear();
    polled.clear();
    pfds.push_back({wake_fd_, POLLIN, 0});
    // Asleep no longer than until the first incomplete frame's bound, or a frame queue's stall bound.
    auto wait = milliseconds(1000);
    auto wait_until = [&](Clock::time_point t) {
      wait = std::min(wait, std::chrono::ceil<milliseconds>(std::max(t - Clock::now(), Clock::duration::zero())));
    };
    for (auto& l : links_.all()) {
      // Frames queued: wake when the socket takes more.
      const bool queued = l->out.wants_room();
      pfds.push_back({l->ctrl.fd(), short(POLLIN | (queued ? POLLOUT : 0)), 0});
      if (l->rx.pending_bytes()) wait_until(l->rx_since + kFrameCompleteBound);
      if (queued) wait_until(l->out.progress() + ControlOut::kStallBound);
      polled.push_back(std::move(l));
    }
    int rc = ::poll(pfds.data(), pfds.size(), int(wait.count()));
    if (stop_) break;
    if (rc < 0) {
      if (errno != EINTR) log::warn("engine progress: " + errno_str(errno));
      continue;
    }
    if (pfds[0].revents) {
      uint64_t v;
      ssize_t n = ::read(wake_fd_, &v, sizeof v);
      (void)n;
    }
    const size_t base = 1;
    for (size_t i = 0; i < polled.size(); ++i) {
      const short rev = pfds[base + i].revents;
      if (!rev) continue;
      auto& link = polled[i];
      if ((rev & POLLOUT) && !link->flush() && !link->is_down())
        remove_link(link, "control connection lost: the peer's socket refused our replies", Metrics::Cause::kPeerClosed);
      if (!(rev & (POLLIN | POLLERR | POLLHUP))) continue;
      try {
        read_control(link);
      } catch (const std::exception& e) {
        if (!link->is_down())
          remove_link(link, std::string("control connection lost: ") + e.what(), Metrics::Cause::kPeerClosed);
      }
    }
    const auto now = Clock::now();
    for (auto& link : polled) {
      close_if_frame_stuck(link, now);
      close_if_not_reading(link, now);
    }
  }
}

// ------------------------------------------------------------------------------ watchdog thread
// Its own thread: an abort waits seconds for the peer's confirmation (that runs on a worker), which
// must not hold up the progress thread's frames or anyone's handshake. Pings are queued (link.h).
void Engine::watchdog_loop() {
  watchdog_id_ = std::this_thread::get_id();
  const int hb = opts_.heartbeat_ms;
  const auto tick = milliseconds(hb > 0 ? std::clamp(hb / 4, 10, 100) : 100);
  std::unique_lock<std::mutex> lk(watchdog_mu_);
  while (!stop_) {
    watchdog_cv_.wait_for(lk, tick, [&] { return stop_.load(); });
    if (stop_) break;
    lk.unlock();
    try {
      heartbeat();
      expire_requests();
    } catch (const std::exception& e) {
      log::warn("engine " + name_ + ": watchdog: " + e.what());
    }
    lk.lock();
  }
}

void Engine::heartbeat() {
  const int hb = opts_.heartbeat_ms;
  if (hb <= 0) return;
  const auto limit = milliseconds(int64_t(hb) * opts_.heartbeat_misses);
  for (auto& link : links_.all()) {
    if (stop_) return;
    auto now = Clock::now();
    const auto silent = link->silent_for(now);
    if (silent > limit && !keep_silent_link(*link, silent, limit)) {
      const std::string why = "no frame from the peer for " + std::to_string(silent.count()) + " ms (a ping every " +
                              std::to_string(hb) + " ms, " + std::to_string(opts_.heartbeat_misses) +
                              " intervals without an answer" +
                              (link->slow ? ", then up to " + std::to_string(kSlowPeerFactor) +
                                                " times that while it looked alive but slow"
                                          : std::string()) +
                              "): the peer is hung, stopped or unreachable" + link->pending_note();
      log::warn("engine " + name_ + ": link to " + link->key + ": " + why + "; closing it");
      remove_link(link, why, Metrics::Cause::kHeartbeat);
      continue;
    }
    if (link->slow && silent <= limit) {
      link->slow = false;
      log::info("engine " + name_ + ": link to " + link->key + ": the slow peer answers again");
    }
    if (now - link->last_ping < milliseconds(hb)) continue;
    wire::Control ping;
    ping.type = wire::FrameType::kPing;
    // Queued like a reply (never waited for): a peer that stopped reading is closed by the
    // progress thread once nothing queued for it could be written for ControlOut::kStallBound.
    link->post(ping);
    link->last_ping = now;
  }
}

bool Engine::keep_silent_link(Link& link, milliseconds silent, milliseconds limit) {
  if (silent > limit * kSlowPeerFactor) return false;
  const std::string alive = peer_alive_evidence(link.peer_same_host, link.peer_pid, link.ctrl.fd(), opts_.heartbeat_ms);
  if (alive.empty()) return false;
  if (!link.slow) {
    link.slow = true;
    log::warn("engine " + name_ + ": link to " + link.key + ": no frame from the peer for " +
              std::to_string(silent.count()) + " ms, but " + alive + ": keeping the link while it stays so, up to " +
              std::to_string((limit * kSlowPeerFactor).count()) + " ms of silence");
  }
  return true;
}

void Engine::expire_requests() {
  std::vector<std::shared_ptr<Link>> to_abort = requests_.expire(Clock::now());
  for (auto& link : to_abort) {
    log::warn("engine " + name_ + ": an async request to " + link->key + " passed its deadline; aborting the link");
    try {
      spawn([this, link] { requests_.finish_expired(link, abort_link(link, "an async request passed its deadline")); });
    } catch (const std::exception& e) {  // finalizing: no abort, the link goes with the engine
      requests_.finish_expired(link, false);
    }
  }
}

}  // namespace hixl::engine
