// The connector: connect(), accepting peers and serving their handshakes, disconnect(); a link's
// data path is built here and the link published to (or retired from) the link table.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <thread>
#include <tuple>

#include "auth/handshake.h"
#include "engine/engine.h"
#include "engine/internal.h"
#include "engine/liveness.h"
#include "transport/shm_path.h"
#include "transport/tcp_path.h"
#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::engine {

using namespace detail;

namespace {
constexpr int kRetryWithoutShm = -1;  // connect_once(): the same-host probe failed on our side

// An incoming handshake's socket, known to its slot while the slot may be dropped (handshakes.h).
class SlotSocket {
 public:
  SlotSocket(Handshakes& h, uint64_t slot, oob::Socket* s) : h_(h), slot_(slot) { h_.attach(slot_, s); }
  ~SlotSocket() { h_.detach(slot_); }
  SlotSocket(const SlotSocket&) = delete;
  SlotSocket& operator=(const SlotSocket&) = delete;

 private:
  Handshakes& h_;
  uint64_t slot_;
};
}  // namespace

std::shared_ptr<rdma::Endpoint> Engine::make_endpoint() const {
  if (!pd_) return nullptr;
  rdma::EndpointOptions o;
  o.device = pd_->context()->name();
  o.gid_index = opts_.gid_index;
  if (opts_.traffic_class >= 0) o.traffic_class = uint8_t(opts_.traffic_class);
  if (opts_.service_level >= 0) o.service_level = uint8_t(opts_.service_level);
  if (opts_.rdma_timeout > 0) o.timeout = uint8_t(opts_.rdma_timeout);
  if (opts_.rdma_retry_count >= 0) o.retry_cnt = uint8_t(opts_.rdma_retry_count);
  if (opts_.rdma_max_wr_bytes > 0) o.slice_bytes = uint64_t(opts_.rdma_max_wr_bytes);
  o.max_slices = opts_.rdma_max_slices;
  if (opts_.rdma_send_window_bytes > 0) o.window_bytes = uint64_t(opts_.rdma_send_window_bytes);
  return std::make_shared<rdma::Endpoint>(o);
}

std::vector<std::shared_ptr<rdma::Endpoint>> Engine::make_more_endpoints(size_t n) const {
  std::vector<std::shared_ptr<rdma::Endpoint>> out;
  for (size_t i = 0; i < n; ++i) out.push_back(make_endpoint());
  return out;
}

size_t Engine::more_qps_wanted() const {
  return opts_.rdma_qps_per_link > 1 ? size_t(opts_.rdma_qps_per_link - 1) : 0;
}

// The peer's queue pair `i` (0: hello's own) as a Hello to connect ours to: same port, GID and MTU.
static wire::Hello peer_qp(const wire::Control& peer, size_t i) {
  wire::Hello h = *peer.hello;
  h.regions.clear();
  if (i > 0) std::tie(h.qpn, h.psn) = peer.more_qps[i - 1];
  return h;
}

wire::Control Engine::hello_frame(wire::FrameType type, const std::shared_ptr<rdma::Endpoint>& ep,
                                  uint32_t offers, const std::vector<std::shared_ptr<rdma::Endpoint>>& more) const {
  wire::Control c;
  c.type = type;
  c.offers = offers;
  c.instance = instance_;
  c.name = name_;
  c.boot_id = boot_id_;
  c.pid = uint32_t(::getpid());
  c.probe_addr = reinterpret_cast<uint64_t>(&probe_cookie_);
  c.probe_value = probe_cookie_;
  c.extents = registry_.extents();
  c.regions = registry_.regions(&c.version);
  c.fence_fd = uint32_t(registry_.fence_fd());
  if (ep) c.hello = ep->local_info().hello;  // queue pair only: the regions travel in c.regions
  for (const auto& m : more) {
    const auto h = m->local_info().hello;
    c.more_qps.emplace_back(h.qpn, h.psn);
  }
  return c;
}

void Engine::make_path(Link& link, const wire::Control& peer) {
  // shm/tcp: a request's flag follows its bytes on the control connection. The path (and so this
  // function) never outlives its link: remove_link() closes it, which joins its worker.
  auto flag_sender = [l = &link](uint32_t v) {
    wire::Control f;
    f.type = wire::FrameType::kFlag;
    f.status = v;
    l->send(f, Clock::now() + milliseconds(5000));
  };
  switch (link.transport) {
    case wire::Transport::kRdma: {
      std::vector<std::shared_ptr<rdma::Endpoint>> eps{link.ep};
      eps.insert(eps.end(), link.more_eps.begin(), link.more_eps.end());
      link.path = std::make_shared<transport::RdmaPath>(std::move(eps), [this, key = link.key](uint32_t v) { inbox_.push_flag(key, v); });
      break;
    }
    case wire::Transport::kShm: {
      auto p = std::make_shared<transport::ShmPath>(pid_t(peer.pid), link.key);
      p->set_fence(peer.fence_fd);
      p->set_extents(peer.extents);
      p->set_regions(peer.regions, peer.version);
      p->set_flag_sender(flag_sender);
      link.shm = p.get();
      link.path = p;
      link.ep.reset();
      link.more_eps.clear();
      break;
    }
    case wire::Transport::kTcp: {
      auto p = std::make_shared<transport::TcpPath>(link.key, &registry_);
      p->set_flag_sender(flag_sender);
      link.tcp = p.get();
      link.path = p;
      link.ep.reset();
      link.more_eps.clear();
      break;
    }
    default: throw Error(std::string("no data path for transport ") + wire::transport_name(link.transport));
  }
}

bool Engine::add_link(const std::shared_ptr<Link>& link, oob::Socket s, const wire::Control& peer,
                      std::shared_ptr<Link>* superseded) {
  link->peer_instance = peer.instance;
  link->peer_pid = peer.pid;
  link->peer_same_host = !peer.boot_id.empty() && peer.boot_id == boot_id_;
  link->ctrl = std::move(s);
  link->heard();  // the heartbeat counts from the publication
  link->set_regions(peer.regions, peer.version);
  if (!links_.publish(link, superseded)) return false;
  wake();
  std::string detail = " (" + std::to_string(peer.regions.size()) + " remote regions";
  if (link->ep)
    detail += ", device " + link->ep->local_info().device + ", gid index " +
              std::to_string(link->ep->local_info().gid_index) + ", path mtu " + std::to_string(link->ep->path_mtu()) +
              (link->more_eps.empty() ? "" : ", " + std::to_string(1 + link->more_eps.size()) + " queue pairs");
  if (link->shm) detail += ", peer pid " + std::to_string(peer.pid) + ", " + std::to_string(peer.extents.size()) + " memfd regions";
  detail += ")";
  std::string msg = "engine " + name_ + ": link to " + link->key + " uses transport " +
                    wire::transport_name(link->transport) + detail + (link->initiator ? ", we connected" : ", peer connected");
  if (link->transport == wire::Transport::kTcp && auto_transport_)
    log::warn(msg + (peer.boot_id == boot_id_
                         ? ": the TCP fallback; the peer is on this host but the same-host transport is not usable "
                           "between us (cross-memory attach refused on one side; that side's log says why)"
                         : ": the TCP fallback (no RDMA device on both ends, and not the same host)"));
  else
    log::info(msg);
  return true;
}

void Engine::remove_link(const std::shared_ptr<Link>& link, const std::string& why, Metrics::Cause cause) {
  // Our disconnect() sent a goodbye: the peer closing the connection in answer ends it as ours.
  if (link->disconnecting) cause = Metrics::Cause::kDisconnect;
  links_.unpublish(link, why, cause == Metrics::Cause::kDisconnect);
  {
    std::lock_guard<util::Mutex> g(link->mu);
    if (link->down) return;
    link->down = true;
    link->down_reason = why;
    link->cv.notify_all();
  }
  metrics_.link_closed(cause);
  // Flags from this peer not seen yet will not come over this link: flag waiters learn it now. Not
  // when finalizing (nobody waits), nor for a link a new one from the same peer replaced (the
  // peer's later flags come over the new link; a transfer the old one lost fails there, and its
  // sender says so with fail_flag).
  if (cause != Metrics::Cause::kFinalize && cause != Metrics::Cause::kSuperseded)
    inbox_.push_failure({link->key, -1, "the link to " + link->key + " closed: " + why});
  if (link->path) close_path(link->path, cause);
  // Queued frames (an AbortAck), as far as the socket takes them now: nothing waits for the peer here.
  link->flush();
  link->ctrl.shutdown();
  wake();
  log::info("engine " + name_ + ": link to " + link->key + " closed: " + why);
}

// ------------------------------------------------------------------------------- connecting
int Engine::connect(const std::string& remote, int timeout_ms) {
  try {
    auto key = canonical(remote);
    int port = -1;
    if (key) canonical(remote, &port);
    if (!ready()) return fail(kFailed, "connect: engine is not initialized");
    if (!key || port < 0) return fail(kParamInvalid, "connect: \"" + remote + "\" is not ip:port or [ipv6]:port");
    if (timeout_ms <= 0) return fail(kParamInvalid, "connect: timeout_in_millis must be > 0");
    if (*key == name_) return fail(kParamInvalid, "connect: " + *key + " is this engine itself");
    return connect_settled(*key, timeout_ms);
  } catch (const std::exception& e) {
    return fail(kFailed, "connect(" + remote + "): " + e.what());
  }
}

// Threads of ours connecting to one peer at once, or the peer connecting to us meanwhile: one
// handshake makes the link, and every connect() waiting on it returns SUCCESS once it is published
// (ALREADY_CONNECTED stays the answer for a link that existed before the call). A peer that refuses
// us because its own connect to us won waits for that link here, within the same timeout.
int Engine::connect_settled(const std::string& key, int timeout_ms) {
  const auto deadline = Clock::now() + milliseconds(timeout_ms);
  const bool listening = name_.find(':') != std::string::npos;
  for (;;) {
    bool busy = false;
    int rc = links_.claim_outgoing(key, &busy);
    if (rc == kSuccess) {
      try {
        rc = connect_impl(key, std::max(1, int(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count())));
      } catch (...) {
        links_.release_outgoing(key);
        throw;
      }
      links_.release_outgoing(key);
      if (rc != kAlreadyConnected || !listening) return rc;
    } else if (!busy) {
      return rc;
    }
    // busy: another handshake with the peer is in progress here: its outcome. Else the peer refused
    // ours because of its own connect or link: that link, for a while, then a new try (a peer
    // holding on to a link we dropped lets go of it meanwhile).
    const auto until = busy ? deadline : std::min(deadline, Clock::now() + milliseconds(200));
    if (links_.wait_link(key, until, /*settle_only=*/busy)) return ok();
    if (Clock::now() >= deadline)
      return fail(kTimeout, "connect to " + key + ": no link within " + std::to_string(timeout_ms) +
                                " ms while a handshake with it was in progress (" + detail::last_error() + ")");
    if (busy) std::this_thread::sleep_for(milliseconds(1));
  }
}

int Engine::connect_impl(const std::string& key, int timeout_ms) {
  auto start = Clock::now();
  std::string shm_refusal;
  int rc = connect_once(key, timeout_ms, offers_, &shm_refusal);
  if (rc != kRetryWithoutShm) return rc;
  // The peer could reach us on this host, but we cannot reach it: say so and use what remains.
  log::warn("engine " + name_ + ": same-host transport to " + key + " is not usable from this side (" + shm_refusal +
            "); reconnecting without it");
  int left = int(std::chrono::duration_cast<milliseconds>(Clock::now() - start).count());
  return connect_once(key, std::max(1, timeout_ms - left), offers_ & ~wire::transport_bit(wire::Transport::kShm),
                      nullptr);
}

int Engine::connect_once(const std::string& key, int timeout_ms, uint32_t offers, std::string* shm_refusal) {
  auto [host, port] = oob::split_host_port(key);
  auto deadline = Clock::now() + milliseconds(timeout_ms);
  oob::Socket s;
  try {
    s = oob::connect_tcp(host, uint16_t(port), milliseconds(timeout_ms), host_);
  } catch (const Error& e) {
    return fail(e.err() == ETIMEDOUT ? kTimeout : kFailed, "connect to " + key + ": " + e.what());
  }
  auto link = std::make_shared<Link>();
  link->key = key;
  link->initiator = true;
  link->id = random_u64() | 1;
  auto ep = (offers & wire::transport_bit(wire::Transport::kRdma)) ? make_endpoint() : nullptr;
  auto more = ep ? make_more_endpoints(more_qps_wanted()) : std::vector<std::shared_ptr<rdma::Endpoint>>{};
  wire::Control peer;
  {
    Handshakes::Guard guard(handshakes_, &s);
    try {
      if (int rc = connect_handshake(s, *link, ep, more, offers, shm_refusal, deadline, &peer);
          rc != kSuccess)
        return rc;
    } catch (const auth::Refused& e) {  // before authentication: its status where connect() documents it
      return fail(e.status() == uint32_t(kResourceExhausted) ? kResourceExhausted : kFailed,
                  "connect to " + key + ": handshake: " + e.what());
    } catch (const Error& e) {
      if (!ready()) return fail(kFailed, "connect to " + key + ": engine finalized during the handshake");
      return fail(e.err() == ETIMEDOUT ? kTimeout : kFailed, "connect to " + key + ": handshake: " + e.what());
    }
  }
  try {
    auto [h, payload] = oob::recv_frame(s, deadline);  // the server holds the link now
    if (h.type != wire::FrameType::kReady) throw Error("expected the server's READY, got frame type " + std::to_string(int(h.type)));
  } catch (const Error& e) {
    link->path->close();
    return fail(e.err() == ETIMEDOUT ? kTimeout : kFailed, "connect to " + key + ": final handshake step: " + e.what());
  }
  if (link->tcp) {
    try {
      attach_tcp_data(*link, host, uint16_t(port), deadline);
    } catch (const Error& e) {
      link->path->close();
      return fail(e.err() == ETIMEDOUT ? kTimeout : kFailed, "connect to " + key + ": tcp data connection: " + e.what());
    }
  }
  if (!add_link(link, std::move(s), peer, nullptr)) {
    link->path->close();
    return fail(ready() ? kAlreadyConnected : kFailed,
                "connect to " + key + ": a link appeared meanwhile, or the engine is finalizing");
  }
  return ok();
}

int Engine::connect_handshake(oob::Socket& s, Link& link, const std::shared_ptr<rdma::Endpoint>& ep,
                              std::vector<std::shared_ptr<rdma::Endpoint>>& more, uint32_t offers,
                              std::string* shm_refusal, Clock::time_point deadline, wire::Control* peer_out) {
  wire::Control& peer = *peer_out;
  if (!opts_.auth_token.empty()) auth::client_handshake(s, opts_.auth_token, deadline);  // before anything of ours
  wire::Control hello = hello_frame(wire::FrameType::kConnect, ep, offers, more);
  hello.link = link.id;
  oob::send_all(s, wire::encode_control(hello), deadline);
  auto [h, payload] = oob::recv_frame(s, deadline);
  peer = wire::parse_control(h.type, payload.data(), payload.size());
  if (peer.type == wire::FrameType::kRefuse) {
    // The peer's reason is passed on; its code only where connect() documents it.
    int code = peer.status == kAlreadyConnected || peer.status == kUnsupported || peer.status == kResourceExhausted
                   ? int(peer.status)
                   : kFailed;
    return fail(code, "connect to " + link.key + ": refused by the peer: " + peer.text);
  }
  if (peer.type != wire::FrameType::kAccept)
    throw Error("expected an Accept frame, got type " + std::to_string(int(peer.type)));
  if (peer.link != link.id)
    throw Error("the Accept names link " + std::to_string(peer.link) + ", we asked for " + std::to_string(link.id));
  if (!(offers & wire::transport_bit(peer.transport)))
    throw Error(std::string("peer chose transport ") + wire::transport_name(peer.transport) + ", we offered " +
                offers_string(offers));
  link.transport = peer.transport;
  if (peer.transport == wire::Transport::kRdma) {
    if (!ep || !peer.hello) throw Error("peer chose rdma without queue pair information");
    if (peer.more_qps.size() > more.size())
      throw Error("the peer answered with " + std::to_string(1 + peer.more_qps.size()) + " queue pairs, we offered " +
                  std::to_string(1 + more.size()));
    ep->connect(*peer.hello);
    more.resize(peer.more_qps.size());  // the link has the smaller count of the two ends
    for (size_t i = 0; i < more.size(); ++i) more[i]->connect(peer_qp(peer, i + 1));
    link.ep = ep;
    link.more_eps = std::move(more);
  } else if (peer.transport == wire::Transport::kShm) {
    std::string why = shm_unusable(peer);
    if (!why.empty()) {
      if (shm_refusal && (offers & wire::transport_bit(wire::Transport::kTcp))) {
        *shm_refusal = why;
        end_for_retry_without_shm(s, why, deadline);
        return kRetryWithoutShm;
      }
      throw Error("the same-host transport was chosen but is not usable from here: " + why);
    }
  }
  make_path(link, peer);
  oob::send_all(s, wire::encode_ready(), deadline);
  return kSuccess;
}

std::string Engine::shm_unusable(const wire::Control& peer) const {
  return peer.boot_id != boot_id_ ? "the peer runs on another host (boot ids differ)"
                                  : transport::shm_probe(pid_t(peer.pid), peer.probe_addr, peer.probe_value);
}

void Engine::end_for_retry_without_shm(oob::Socket& s, const std::string& why, Clock::time_point deadline) {
  wire::Control no;  // tell the server why this attempt ends, so that it does not log a failure
  no.type = wire::FrameType::kRefuse;
  no.status = uint32_t(kUnsupported);
  no.text = "shm not usable from the client (" + why + "); it reconnects without it";
  oob::send_all(s, wire::encode_control(no), deadline);
  // Until the server closed this connection: it has then read the Refuse and let go of
  // our name, so that the retry is not refused as "a handshake from us is in progress".
  oob::drain(s, deadline);
}

// TCP: two data connections, now that the server has published the link. Direction 0: we request,
// the peer serves; 1: the other way round.
void Engine::attach_tcp_data(Link& link, const std::string& host, uint16_t port, Clock::time_point deadline) {
  for (uint32_t dir = 0; dir < 2; ++dir) {
    oob::Socket d = oob::connect_tcp(host, port, std::max(left_until(deadline), milliseconds(1)), host_);
    if (!opts_.auth_token.empty()) auth::client_handshake(d, opts_.auth_token, deadline);
    wire::Control a;
    a.type = wire::FrameType::kAttach;
    a.instance = instance_;
    a.name = name_;
    a.direction = dir;
    a.link = link.id;
    oob::send_all(d, wire::encode_control(a), deadline);
    link.tcp->attach(dir == 1, std::move(d));
  }
}

// The peer attaches only after our READY, and we publish the link before we send that: a data
// connection that matches no published link belongs to one already replaced or closed (a client
// that disconnected and reconnected before we served this connection). It must never be attached to
// the link that replaced it: that link's own connections would then be dropped as second ones.
void Engine::serve_attach(oob::Socket s, const wire::Control& c) {
  auto key = canonical(c.name);
  auto link = key ? links_.find(*key) : nullptr;
  if (link && link->tcp && link->peer_instance == c.instance && link->id == c.link) {
    link->tcp->attach(c.direction == 0, std::move(s));  // its request socket is the one we serve
    return;
  }
  log::info("engine " + name_ + ": a tcp data connection (direction " + std::to_string(c.direction) + ") for link " +
            std::to_string(c.link) + " of \"" + c.name + "\" matches no current link (" +
            (link ? "that peer's link is " + std::to_string(link->id) + ", transport " +
                        wire::transport_name(link->transport)
                  : std::string("no link to that peer")) +
            "): a replaced or closed link's; dropped");
}

// On its own thread, so that nothing a linked peer does to the progress thread (a reply it does not
// read) delays anyone's handshake.
void Engine::accept_loop() {
  while (!stop_) {
    pollfd p[2] = {{accept_wake_fd_, POLLIN, 0}, {listener_.fd(), POLLIN, 0}};
    int rc = ::poll(p, 2, 1000);
    if (stop_) break;
    if (rc < 0) {
      if (errno != EINTR) log::warn("engine " + name_ + ": accept poll: " + errno_str(errno));
      continue;
    }
    if (p[1].revents & POLLIN) accept_incoming();
  }
}

void Engine::accept_incoming() {
  oob::Socket s;
  try {
    s = oob::accept_tcp(listener_, milliseconds(0));
  } catch (const std::exception& e) {
    log::warn("engine " + name_ + ": accept: " + e.what());
    std::this_thread::sleep_for(milliseconds(50));  // e.g. EMFILE: the connection stays queued, poll says so again
    return;
  }
  if (!s.valid()) return;
  const std::string from = oob::peer_address(s);
  const std::string host = from.substr(0, from.rfind(':'));
  std::string note;
  const uint64_t slot = handshakes_.admit(host, from, name_, &note);
  if (!note.empty()) log::warn(note);
  if (!slot) {  // the refusal is small: it fits the socket buffer, so this never waits
    wire::Control r;
    r.type = wire::FrameType::kRefuse;
    r.status = uint32_t(kResourceExhausted);
    r.text = "too many handshakes in progress; try again later";
    try {
      oob::send_all(s, wire::encode_control(r), Clock::now());
    } catch (const std::exception&) {
    }
    return;
  }
  // Gives the slot back however the handshake ends (also when spawn() refuses: finalizing).
  auto release = std::shared_ptr<void>(nullptr, [this, slot](void*) { handshakes_.release(slot); });
  auto sp = std::make_shared<oob::Socket>(std::move(s));
  try {
    spawn([this, sp, release, slot] { serve_incoming(std::move(*sp), slot); });  // throws once finalizing: sp closes
  } catch (const std::exception& e) {
    log::info("engine " + name_ + ": not serving the peer at " + from + ": " + e.what());
  }
}

void Engine::serve_incoming(oob::Socket s, uint64_t slot) {
  Handshakes::Guard guard(handshakes_, &s);
  SlotSocket in_slot(handshakes_, slot, &s);  // destroyed before s closes
  auto deadline = Clock::now() + milliseconds(opts_.handshake_timeout_ms);
  const std::string from = oob::peer_address(s);
  wire::Control c;
  if (!await_first_bytes(s, slot, from, deadline) || !read_connect(s, from, slot, deadline, &c)) return;
  int peer_port = -1;
  auto key = canonical(c.name, &peer_port);
  if (!key)
    return refuse_peer(s, from, deadline, kParamInvalid, "peer name \"" + c.name + "\" is not an engine address");
  if (!name_on_source(s, from, *key, deadline)) return;
  std::string shm_why;
  const wire::Transport chosen = choose_transport(c, &shm_why);
  if (chosen == wire::Transport::kNone)
    return refuse_peer(s, from, deadline, kUnsupported,
                       "no common transport: peer offers " + offers_string(c.offers) + ", " + name_ + " offers " +
                           offers_string(offers_) + (shm_why.empty() ? "" : "; shm: " + shm_why));
  if (chosen == wire::Transport::kTcp && !shm_why.empty())
    log::warn("engine " + name_ + ": same-host transport to " + *key + " not usable (" + shm_why + "); using tcp");
  if (!claim_name(s, from, c, *key, peer_port >= 0, deadline)) return;
  bool claimed = true;  // the link table holds *key for us; add_link() gives it back once the link is published
  std::shared_ptr<Link> old;
  try {
    auto link = incoming_link(c, *key, chosen);
    accept_and_publish(link, s, c, deadline, &claimed, &old);
  } catch (const std::exception& e) {
    log::warn("engine " + name_ + ": handshake with " + *key + " failed: " + e.what());
  }
  if (old) remove_link(old, "superseded by a new connection from the same peer", Metrics::Cause::kSuperseded);
  if (claimed) links_.release_incoming(*key);
}

// A refusal carries its status and reason, nothing else of ours. Refusals of peers that did not
// authenticate are warnings (with the peer's address; never the token).
void Engine::refuse_peer(oob::Socket& s, const std::string& from, Clock::time_point deadline, int code,
                         const std::string& why, bool warn, const std::string& detail) {
  const std::string msg = "engine " + name_ + ": refusing the peer at " + from + ": " + why +
                          (detail.empty() ? "" : " (" + detail + ")");
  if (warn)
    log::warn(msg);
  else
    log::info(msg);
  wire::Control r;
  r.type = wire::FrameType::kRefuse;
  r.status = uint32_t(code);
  r.text = why;
  try {
    oob::send_all(s, wire::encode_control(r), deadline);
  } catch (const std::exception&) {
  }
  oob::drain(s, std::min(deadline, Clock::now() + milliseconds(200)));  // so the peer gets to read it
}

bool Engine::refuse_dropped(oob::Socket& s, const std::string& from, Clock::time_point deadline) {
  refuse_peer(s, from, deadline, kResourceExhausted,
              "too many handshakes in progress; this unauthenticated one was the oldest and gave way to a new "
              "one; try again later");
  return false;
}

bool Engine::await_first_bytes(oob::Socket& s, uint64_t slot, const std::string& from, Clock::time_point deadline) {
  const int bound_ms = std::min(kFirstBytesTimeoutMs, opts_.handshake_timeout_ms);
  const auto until = std::min(deadline, Clock::now() + milliseconds(bound_ms));
  pollfd p{s.fd(), POLLIN, 0};
  int rc;
  do rc = ::poll(&p, 1, int(left_until(until).count()));
  while (rc < 0 && errno == EINTR);
  if (handshakes_.dropped(slot)) return refuse_dropped(s, from, deadline);
  if (rc == 0) {
    refuse_peer(s, from, deadline, kFailed,
                "nothing received within " + std::to_string(bound_ms) + " ms of connecting", true);
    return false;
  }
  // Readable, closed or failed: the handshake reads it (and refuses what is not a handshake).
  if (!handshakes_.advance(slot, Handshakes::Stage::kStarted)) return refuse_dropped(s, from, deadline);
  return true;
}

bool Engine::name_on_source(oob::Socket& s, const std::string& from, const std::string& key,
                            Clock::time_point deadline) {
  const std::string source = host_of(from);
  if (!opts_.auth_token.empty() || opts_.trust_claimed_address || host_of(key) == source) return true;
  refuse_peer(s, from, deadline, kFailed,
              "the name " + key + " is not on the address the connection comes from (" + source +
                  "): without HixlAuthToken a peer may claim only a name on its own address (behind NAT, "
                  "HixlTrustClaimedAddress=1 on " + name_ + " lifts this check)",
              true);
  return false;
}

bool Engine::claim_name(oob::Socket& s, const std::string& from, const wire::Control& c, const std::string& key,
                        bool listens, Clock::time_point deadline) {
  int code = kSuccess;
  std::shared_ptr<Link> current;
  std::string why = links_.claim_incoming(key, name_, listens, c.instance, &code, host_of(from), &current);
  if (!why.empty()) {
    refuse_peer(s, from, deadline, code, why, code == kResourceExhausted);
    return false;
  }
  if (!current) return true;
  // No lock is held here: the probe waits on the network, our claim on the name keeps others out.
  std::string how;
  if (proven_dead(current, deadline, &how)) {
    log::info("engine " + name_ + ": " + key + " (at " + from + ") connects again and its link is dead (" + how +
              "): the new connection replaces it");
    return true;
  }
  links_.release_incoming(key);
  refuse_peer(s, from, deadline, kAlreadyConnected,
              name_ + " has a live link to " + key + " (" + how + "); a new connection does not replace it", true);
  return false;
}

bool Engine::proven_dead(const std::shared_ptr<Link>& link, Clock::time_point deadline, std::string* how) {
  const auto start = Clock::now();
  const auto rx_before = link->last_rx.load();
  wire::Control ping;
  ping.type = wire::FrameType::kPing;
  link->post(ping);  // queued: never waited for (link.h)
  const auto end = std::min(start + milliseconds(kLivenessProbeMs), deadline - milliseconds(250));
  for (;;) {
    if (link->is_down()) {
      *how = "it closed";
      return true;
    }
    pollfd p{link->ctrl.fd(), POLLRDHUP, 0};  // reads nothing: the progress thread stays its only reader
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
      *how = "the peer closed its control connection";
      return true;
    }
    const bool heard = link->last_rx.load() != rx_before;
    // Heard, and its connection still open a moment later (a goodbye is followed by the close at once).
    if (heard && Clock::now() - start >= milliseconds(200)) {
      *how = "the peer answered a ping";
      return false;
    }
    if (Clock::now() >= end) break;
    std::this_thread::sleep_for(milliseconds(5));
  }
  if (link->last_rx.load() != rx_before) {
    *how = "the peer answered a ping";
    return false;
  }
  const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  // Silent, but alive and slow (a starved process: liveness.h) is not dead: the heartbeat keeps such
  // a link, and so does a claim. An acknowledgement counts only when it came after our ping went out.
  const std::string alive = peer_alive_evidence(link->peer_same_host, link->peer_pid, link->ctrl.fd(),
                                                std::max(1, int(waited.count() / 2)));
  if (!alive.empty()) {
    *how = "no answer to a ping for " + std::to_string(waited.count()) + " ms, but " + alive;
    return false;
  }
  *how = "nothing from the peer for " + std::to_string(waited.count()) + " ms after a ping";
  return true;
}

bool Engine::read_connect(oob::Socket& s, const std::string& from, uint64_t slot, Clock::time_point deadline,
                          wire::Control* c) {
  const std::string& token = opts_.auth_token;
  bool authenticated = token.empty();
  try {
    if (!token.empty()) {
      if (!authenticate_peer(s, from, slot, deadline)) return false;
      authenticated = true;
      if (!handshakes_.advance(slot, Handshakes::Stage::kSettled)) return refuse_dropped(s, from, deadline);
    }
    auto [h, payload] = oob::recv_frame(s, deadline);
    *c = wire::parse_control(h.type, payload.data(), payload.size());
    if (!handshakes_.advance(slot, Handshakes::Stage::kSettled)) return refuse_dropped(s, from, deadline);
    if (c->type == wire::FrameType::kAuthHello && token.empty()) {
      refuse_peer(s, from, deadline, int(auth::kStatusNoAuth),
                  "this engine has no HixlAuthToken: it does not authenticate peers", true);
      return false;
    }
    if (c->type == wire::FrameType::kAuthHello) {
      refuse_peer(s, from, deadline, kFailed, "authentication already done", true);
      return false;
    }
    if (c->type == wire::FrameType::kAttach) {
      serve_attach(std::move(s), *c);
      return false;
    }
    if (c->type != wire::FrameType::kConnect) throw Error("expected a Connect frame, got type " + std::to_string(int(h.type)));
  } catch (const std::exception& e) {
    if (handshakes_.dropped(slot)) return refuse_dropped(s, from, deadline);  // its socket was shut down for it
    // Before authentication the reason stays generic: the details (which may name our socket) go to the log only.
    if (!authenticated) {
      metrics_.link_closed(Metrics::Cause::kAuth);
      refuse_peer(s, from, deadline, kFailed, "bad handshake (authentication required)", true, e.what());
      return false;
    }
    refuse_peer(s, from, deadline, kFailed, std::string("bad handshake: ") + e.what());
    return false;
  }
  return true;
}

bool Engine::authenticate_peer(oob::Socket& s, const std::string& from, uint64_t slot, Clock::time_point deadline) {
  // The first frame must be an AuthHello: anything else is refused by its header alone, and
  // nothing longer than an auth frame is read before the peer proved the token.
  wire::Header h = oob::recv_header(s, deadline);
  if (h.type != wire::FrameType::kAuthHello) {
    metrics_.link_closed(Metrics::Cause::kAuth);
    refuse_peer(s, from, deadline, kFailed,
                "authentication required (this engine accepts only peers with its HixlAuthToken)", true);
    return false;
  }
  auto payload = oob::recv_payload(s, h, deadline, auth::kMaxPreAuthPayload);
  // The slot is settled before our proof leaves: a peer that read it holds a slot nobody drops.
  std::string why = auth::server_handshake(
      s, opts_.auth_token, wire::parse_control(h.type, payload.data(), payload.size()), deadline,
      [&] { handshakes_.advance(slot, Handshakes::Stage::kSettled); });
  if (!why.empty()) {
    metrics_.link_closed(Metrics::Cause::kAuth);
    refuse_peer(s, from, deadline, kFailed, why, true);
    return false;
  }
  return true;
}

// Transport: rdma when both ends have a device, else same-host when both are on this host and
// cross-memory attach works, else TCP (a warning when that is the auto choice).
wire::Transport Engine::choose_transport(const wire::Control& c, std::string* shm_why) const {
  const uint32_t common = c.offers & offers_;
  auto has = [&](wire::Transport t) { return (common & wire::transport_bit(t)) != 0; };
  wire::Transport chosen = wire::Transport::kNone;
  if (has(wire::Transport::kRdma) && c.hello && pd_) {
    chosen = wire::Transport::kRdma;
  } else {
    if (has(wire::Transport::kShm)) {
      *shm_why = shm_unusable(c);
      if (shm_why->empty()) chosen = wire::Transport::kShm;
    }
    if (chosen == wire::Transport::kNone && has(wire::Transport::kTcp)) chosen = wire::Transport::kTcp;
  }
  return chosen;
}

std::shared_ptr<Link> Engine::incoming_link(const wire::Control& c, const std::string& key, wire::Transport chosen) {
  auto link = std::make_shared<Link>();
  link->key = key;
  link->id = c.link;
  link->transport = chosen;
  if (chosen == wire::Transport::kRdma) {
    link->ep = make_endpoint();
    link->ep->connect(*c.hello);  // RTR/RTS before we answer: the client may write as soon as it has our reply
    link->more_eps = make_more_endpoints(std::min(c.more_qps.size(), more_qps_wanted()));
    for (size_t i = 0; i < link->more_eps.size(); ++i) link->more_eps[i]->connect(peer_qp(c, i + 1));
  }
  make_path(*link, c);
  return link;
}

void Engine::accept_and_publish(const std::shared_ptr<Link>& link, oob::Socket& s, const wire::Control& c,
                                Clock::time_point deadline, bool* claimed, std::shared_ptr<Link>* old) {
  const std::string& key = link->key;
  wire::Control a = hello_frame(wire::FrameType::kAccept, link->ep, offers_, link->more_eps);
  a.transport = link->transport;
  a.link = link->id;
  oob::send_all(s, wire::encode_control(a), deadline);
  auto [h, payload] = oob::recv_frame(s, deadline);
  if (h.type == wire::FrameType::kRefuse) {  // the client's probe of us failed: it retries without shm
    log::info("engine " + name_ + ": " + key + " ended its handshake: " + wire::parse_control(h.type, payload.data(), payload.size()).text);
    link->path->close();
    return;
  }
  if (h.type != wire::FrameType::kReady) throw Error("expected READY, got frame type " + std::to_string(int(h.type)));
  // Published, then confirmed with a READY of ours, so that the client's connect() returns only
  // once both ends hold the link. The held queue keeps any other frame for this link behind it.
  // Everything this handshake has to do is done before that READY: add_link() ends our claim on
  // the peer's name, and the link it replaced is retired here, so that a client that disconnects
  // and connects again the moment its connect() returned is neither refused ("a handshake is in
  // progress") nor raced by the old link's teardown.
  link->out.hold();
  if (!add_link(link, std::move(s), c, old)) {
    link->path->close();
    log::info("engine " + name_ + ": dropping the link from " + key + " (finalizing)");
    return;
  }
  *claimed = false;
  if (*old) remove_link(*old, "superseded by a new connection from the same peer", Metrics::Cause::kSuperseded);
  old->reset();
  link->out.send_first(wire::encode_ready(), deadline, "the Ready frame to " + key);
}

int Engine::disconnect(const std::string& remote, int timeout_ms) {
  try {
    if (!ready()) return fail(kFailed, "disconnect: engine is not initialized");
    auto key = canonical(remote);
    if (!key) return fail(kParamInvalid, "disconnect: \"" + remote + "\" is not an engine address");
    return disconnect_impl(*key, timeout_ms, "disconnected by " + name_);
  } catch (const std::exception& e) {
    return fail(kFailed, "disconnect(" + remote + "): " + e.what());
  }
}

bool Engine::take_closed(const std::string& key) {
  std::string why;
  if (!links_.take_closed(key, &why)) return false;
  log::info("engine " + name_ + ": disconnect " + key + ": the link was already closed (" + why + ")");
  return true;
}

int Engine::disconnect_impl(const std::string& key, int timeout_ms, const std::string& why) {
  auto link = links_.find(key);
  if (!link && take_closed(key)) return ok();
  if (!link) return fail(kNotConnected, "disconnect: not connected to " + key);
  link->disconnecting = true;
  try {
    wire::Control bye;
    bye.type = wire::FrameType::kBye;
    bye.text = why;
    link->send(bye, Clock::now() + milliseconds(std::max(1, timeout_ms)));
  } catch (const std::exception& e) {
    log::info("disconnect " + key + ": goodbye not delivered: " + e.what());
  }
  remove_link(link, why, Metrics::Cause::kDisconnect);
  return ok();
}

}  // namespace hixl::engine
