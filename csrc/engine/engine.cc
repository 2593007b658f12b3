#include "engine/engine.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <random>

#include "acl/allocator.h"
#include "auth/handshake.h"
#include "transport/shm_path.h"
#include "transport/tcp_path.h"
#include "verbs/error.h"
#include "verbs/log.h"
#include "wire/frame_reader.h"

namespace hixl::engine {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

static_assert(auth::kStatusNoAuth == uint32_t(kUnsupported), "auth/handshake.h names engine::kUnsupported");
static_assert(auth::kStatusRefused == uint32_t(kFailed), "auth/handshake.h names engine::kFailed");

namespace {

constexpr int kRetryWithoutShm = -1;  // connect_once(): the same-host probe failed on our side
// A control frame whose first byte arrived must be complete within this, or its link is closed: the
// bound the progress thread's blocking read of a frame had before it read incrementally, so a peer
// that was fine then is fine now (a frame is written whole; only a hung or hostile peer stops
// inside one). It holds up no other link meanwhile.
constexpr milliseconds kFrameCompleteBound{2000};
constexpr size_t kControlReadBytes = 64 * 1024;  // one read per link and round: a flood holds up no one
thread_local std::string t_last_error;

// Records why a call returns `code` (Engine::last_error) and logs it: refusals of bad input at info
// level (the caller gets the code), everything else at warn.
int fail(int code, const std::string& why) {
  t_last_error = std::string(code_name(code)) + ": " + why;
  if (code == kParamInvalid || code == kNotConnected || code == kAlreadyConnected)
    log::info(t_last_error);
  else
    log::warn(t_last_error);
  return code;
}

int ok() {
  t_last_error.clear();
  return kSuccess;
}

bool known_code(uint32_t c) {
  switch (c) {
    case kSuccess: case kParamInvalid: case kTimeout: case kNotConnected: case kAlreadyConnected:
    case kNotifyFailed: case kUnsupported: case kResourceExhausted: case kFailed: return true;
    default: return false;
  }
}

// "ip:port" / "[v6]:port" / "ip" in canonical form; nullopt when it is not an IP address.
std::optional<std::string> canonical(const std::string& s, int* port_out = nullptr) {
  std::pair<std::string, int> hp;
  try {
    hp = oob::split_host_port(s);
  } catch (const Error&) {
    return std::nullopt;
  }
  auto [host, port] = hp;
  char buf[INET6_ADDRSTRLEN] = {};
  in_addr a4{};
  in6_addr a6{};
  std::string h;
  bool v6 = false;
  if (s[0] != '[' && inet_pton(AF_INET, host.c_str(), &a4) == 1) {
    inet_ntop(AF_INET, &a4, buf, sizeof buf);
    h = buf;
  } else if (inet_pton(AF_INET6, host.c_str(), &a6) == 1 && (s[0] == '[' || port < 0)) {
    inet_ntop(AF_INET6, &a6, buf, sizeof buf);
    h = buf;
    v6 = true;
  } else {
    return std::nullopt;
  }
  if (port_out) *port_out = port;
  if (port < 0) return h;
  return (v6 ? "[" + h + "]" : h) + ":" + std::to_string(port);
}

std::string offers_string(uint32_t offers) {
  std::string out;
  for (auto t : {wire::Transport::kRdma, wire::Transport::kShm, wire::Transport::kTcp})
    if (offers & wire::transport_bit(t)) out += std::string(out.empty() ? "" : ",") + wire::transport_name(t);
  return out.empty() ? "none" : out;
}

std::vector<RegionEntry> to_entries(const std::vector<wire::Region>& regions) {
  std::vector<RegionEntry> out;
  out.reserve(regions.size());
  for (size_t i = 0; i < regions.size(); ++i)
    out.push_back({regions[i].addr, regions[i].len, regions[i].rkey, regions[i].access, i});
  return out;
}

milliseconds left_until(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  return std::max(ms, milliseconds(0));
}

}  // namespace

const char* code_name(int code) {
  switch (code) {
    case kSuccess: return "SUCCESS";
    case kParamInvalid: return "PARAM_INVALID";
    case kTimeout: return "TIMEOUT";
    case kNotConnected: return "NOT_CONNECTED";
    case kAlreadyConnected: return "ALREADY_CONNECTED";
    case kNotifyFailed: return "NOTIFY_FAILED";
    case kUnsupported: return "UNSUPPORTED";
    case kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case kFailed: return "FAILED";
  }
  return "UNKNOWN";
}

// ------------------------------------------------------------------------------------------ Link
struct Engine::Link {
  std::string key;
  bool initiator = false;
  uint64_t id = 0;  // random, chosen by the initiator: TCP data connections name it (wire Attach)
  uint64_t peer_instance = 0;
  wire::Transport transport = wire::Transport::kNone;
  std::shared_ptr<transport::DataPath> path;  // what moves the bytes
  std::shared_ptr<rdma::Endpoint> ep;          // rdma only (for link_info)
  transport::ShmPath* shm = nullptr;           // shm only: region extents go here
  transport::TcpPath* tcp = nullptr;           // tcp only: data connections attach here
  oob::Socket ctrl;

  std::mutex send_mu;  // one frame at a time on ctrl (the progress thread is its only reader)

  std::mutex mu;  // below
  std::condition_variable cv;
  RegionTable remote;
  uint64_t remote_version = 0;
  std::set<uint64_t> pending;                 // seqs someone waits a reply for
  std::map<uint64_t, wire::Control> replies;  // only for pending seqs: nothing unsolicited piles up
  uint64_t next_seq = 1;
  bool down = false;
  std::string down_reason;

  // Heartbeat: when the progress thread last read a frame of the peer's (Clock ticks), and when the
  // watchdog last sent a Ping. aborting: the watchdog started an abort for an expired request.
  std::atomic<Clock::rep> last_rx{0};
  Clock::time_point last_ping{};
  std::atomic<bool> aborting{false};
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
    std::lock_guard<std::mutex> g(mu);
    return down;
  }

  // A frame that could not be sent whole leaves the stream unusable: shut the socket down so the
  // progress thread retires the link, and report the failure.
  void send(const wire::Control& c, Clock::time_point deadline) {
    auto bytes = wire::encode_control(c);
    deadline = std::min(deadline, Clock::now() + milliseconds(5000));  // a peer that stops reading
    std::lock_guard<std::mutex> g(send_mu);
    try {
      oob::send_all(ctrl, bytes, deadline);
    } catch (...) {
      ctrl.shutdown();
      throw;
    }
  }
  // As send(), but false at once (nothing sent) while another frame is being sent: the heartbeat
  // never queues behind a handshake's READY or a slow region push, which count as traffic anyway.
  bool try_send(const wire::Control& c, Clock::time_point deadline) {
    std::unique_lock<std::mutex> g(send_mu, std::try_to_lock);
    if (!g.owns_lock()) return false;
    auto bytes = wire::encode_control(c);
    try {
      oob::send_all(ctrl, bytes, std::min(deadline, Clock::now() + milliseconds(5000)));
    } catch (...) {
      ctrl.shutdown();
      throw;
    }
    return true;
  }
  // A new sequence number whose reply wait_reply() will collect.
  uint64_t expect() {
    std::lock_guard<std::mutex> g(mu);
    uint64_t seq = next_seq++;
    pending.insert(seq);
    return seq;
  }
  void forget(uint64_t seq) {
    std::lock_guard<std::mutex> g(mu);
    pending.erase(seq);
    replies.erase(seq);
  }
  void deliver(const wire::Control& c) {
    std::lock_guard<std::mutex> g(mu);
    if (!pending.count(c.seq)) return;  // late (its waiter gave up) or unsolicited
    replies[c.seq] = c;
    cv.notify_all();
  }
  // The reply to `seq`; nullopt when the deadline passed or the link went down first.
  std::optional<wire::Control> wait_reply(uint64_t seq, Clock::time_point deadline, bool* went_down) {
    std::unique_lock<std::mutex> lk(mu);
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
    std::lock_guard<std::mutex> g(mu);
    if (version < remote_version) return;  // an older list overtaken by a newer one
    remote_version = version;
    remote.assign(to_entries(regions));
  }
};

struct Engine::Request {
  std::shared_ptr<Link> link;
  uint64_t ep_req = 0;
  uint64_t user_data = 0;
  int timeout_ms = 0;                       // 0: no deadline
  Clock::time_point deadline = Clock::time_point::max();
  bool expired = false;                     // past its deadline, its link being aborted
  int final_status = -1;                    // set once that abort ended (TIMEOUT or FAILED)
  std::string final_error;
};

struct Engine::Worker {
  std::thread t;
  std::atomic<bool> done{false};
};

// ------------------------------------------------------------------------------ lifecycle
namespace {
uint64_t random_instance() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(Clock::now().time_since_epoch().count());
}
}  // namespace

Engine::Engine() : probe_cookie_(random_instance() | 1), instance_(random_instance()) {}

Engine::~Engine() {
  try {
    finalize();
  } catch (const std::exception& e) {
    log::warn(std::string("Engine teardown: ") + e.what());
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);  // here, not in finalize(): late wake() calls stay harmless
  if (accept_wake_fd_ >= 0) ::close(accept_wake_fd_);
  if (flag_fd_ >= 0) ::close(flag_fd_);
}

bool Engine::ready() const {
  std::lock_guard<std::mutex> g(mu_);
  return state_ == State::kReady;
}

std::string Engine::last_error() const { return t_last_error; }

int Engine::initialize(const std::string& local_engine, const Options& opts) {
  try {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ == State::kFinalized) return fail(kFailed, "initialize: the engine was finalized");
    if (state_ == State::kReady) {
      if (local_engine != name_ && canonical(local_engine).value_or("") != host_)
        log::info("initialize(" + local_engine + "): already initialized as " + name_ + "; keeping that");
      return ok();
    }
    int port = -1;
    auto canon = canonical(local_engine, &port);
    if (!canon) return fail(kParamInvalid, "initialize: local_engine \"" + local_engine +
                                               "\" is not ip, ip:port or [ipv6]:port");
    std::string host = oob::split_host_port(local_engine).first;
    if (opts.transport != "auto" && opts.transport != "rdma" && opts.transport != "shm" && opts.transport != "tcp")
      return fail(kParamInvalid, "initialize: unknown transport \"" + opts.transport + "\"");
    if (opts.traffic_class > 255 || opts.service_level > 15 || opts.gid_index > 255)
      return fail(kParamInvalid, "initialize: traffic_class 0..255, service_level 0..15, gid_index 0..255");
    if (opts.async_timeout_ms < 0 || opts.heartbeat_ms < 0 || opts.heartbeat_ms > 3600000 ||
        opts.heartbeat_misses < 1 || opts.heartbeat_misses > 1000)
      return fail(kParamInvalid, "initialize: async_timeout_ms=" + std::to_string(opts.async_timeout_ms) +
                                     " heartbeat_ms=" + std::to_string(opts.heartbeat_ms) + " heartbeat_misses=" +
                                     std::to_string(opts.heartbeat_misses) +
                                     ": need async_timeout_ms >= 0, heartbeat_ms 0..3600000, heartbeat_misses 1..1000");

    std::shared_ptr<verbs::ProtectionDomain> pd;
    std::string why_none = "not asked for (HixlTransport=" + opts.transport + ")";
    const bool want_rdma = opts.transport == "auto" || opts.transport == "rdma";
    if (want_rdma) try {
      pd = verbs::ProtectionDomain::shared_for(opts.device);
      auto pi = pd->context()->query_port(1);
      if (pi.state != IBV_PORT_ACTIVE) {
        why_none = "device " + pd->context()->name() + " port 1 is not ACTIVE";
        pd.reset();
      } else {
        pd->context()->select_gid_index(1, opts.gid_index);  // validates HixlGidIndex / $HIXL_GID_INDEX now
      }
    } catch (const Error& e) {
      why_none = e.what();
      pd.reset();
    }
    if (!pd && (opts.transport == "rdma" || (want_rdma && !opts.device.empty())))
      return fail(kFailed, "initialize: RDMA transport requested but unusable: " + why_none);

    oob::Socket listener;
    std::string name = *canon;
    if (port >= 0) {
      auto [s, bound] = oob::listen_tcp(host, uint16_t(port));
      listener = std::move(s);
      name = *canonical(host.find(':') != std::string::npos ? "[" + host + "]:" + std::to_string(bound)
                                                            : host + ":" + std::to_string(bound));
    }
    int wfd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wfd < 0) throw_errno("eventfd", errno);
    int ffd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (ffd < 0) {
      ::close(wfd);
      throw_errno("eventfd", errno);
    }
    int afd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (afd < 0) {
      ::close(wfd);
      ::close(ffd);
      throw_errno("eventfd", errno);
    }

    opts_ = opts;
    pd_ = std::move(pd);
    auto_transport_ = opts.transport == "auto";
    offers_ = 0;
    if (pd_) offers_ |= wire::transport_bit(wire::Transport::kRdma);
    if (opts.transport == "auto" || opts.transport == "shm") offers_ |= wire::transport_bit(wire::Transport::kShm);
    if (opts.transport == "auto" || opts.transport == "tcp") offers_ |= wire::transport_bit(wire::Transport::kTcp);
    boot_id_ = transport::boot_id();
    listener_ = std::move(listener);
    name_ = name;
    host_ = *canonical(host);
    wake_fd_ = wfd;
    flag_fd_ = ffd;
    accept_wake_fd_ = afd;
    stop_ = false;
    progress_ = std::thread([this] { progress_loop(); });
    watchdog_ = std::thread([this] { watchdog_loop(); });
    if (listener_.valid()) acceptor_ = std::thread([this] { accept_loop(); });
    state_ = State::kReady;
    log::info("engine " + name_ + ": transports " + offers_string(offers_) +
              (pd_ ? " (rdma on " + pd_->context()->name() + ")" : " (no rdma: " + why_none + ")"));
    return ok();
  } catch (const std::exception& e) {
    return fail(kFailed, std::string("initialize(") + local_engine + "): " + e.what());
  }
}

void Engine::finalize() {
  std::map<std::string, std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ != State::kReady) {
      state_ = State::kFinalized;
      return;
    }
    state_ = State::kFinalized;
    links.swap(links_);
    for (oob::Socket* hs : handshakes_) hs->shutdown();  // handshakes in flight fail now, not at their deadline
  }
  stop_ = true;
  { std::lock_guard<std::mutex> n(notify_mu_); }  // a waiter between its check and its wait sees stop_
  notify_cv_.notify_all();
  { std::lock_guard<std::mutex> f(flag_mu_); }
  flag_cv_.notify_all();
  wake();
  {
    std::lock_guard<std::mutex> w(watchdog_mu_);
  }
  watchdog_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();  // before the links go: it may be aborting one
  if (progress_.joinable()) progress_.join();
  if (acceptor_.joinable()) {
    uint64_t one = 1;
    ssize_t n = ::write(accept_wake_fd_, &one, sizeof one);
    (void)n;
    acceptor_.join();
  }
  listener_.close();
  for (auto& [key, link] : links) {
    (void)key;
    try {
      wire::Control bye;
      bye.type = wire::FrameType::kBye;
      bye.text = "engine finalized";
      link->send(bye, Clock::now() + milliseconds(200));
    } catch (const std::exception&) {
    }
    remove_link(link, "engine finalized");
  }
  std::vector<std::shared_ptr<Worker>> workers;
  {
    std::lock_guard<std::mutex> g(workers_mu_);
    workers_closed_ = true;  // spawn() refuses from now on, so every worker is joined below
    workers.swap(workers_);
  }
  for (auto& w : workers)
    if (w->t.joinable()) w->t.join();
  {
    std::lock_guard<std::mutex> g(mu_);
    reqs_.clear();
    deadlines_.clear();
    links_.clear();
  }
  {
    std::lock_guard<std::mutex> g(reg_mu_);  // MRs go after every QP is gone
    reg_closed_ = true;
    regions_.clear();
    region_by_range_.clear();
    local_table_.clear();
  }
  // pd_ stays until the destructor: calls racing finalize() may still hold a reference path to it.
}

std::string Engine::local_engine() const {
  std::lock_guard<std::mutex> g(mu_);
  return name_;
}

std::string Engine::data_transport() const {
  std::lock_guard<std::mutex> g(mu_);
  return offers_string(offers_);
}

void Engine::wake() {
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  ssize_t rc = ::write(wake_fd_, &one, sizeof one);
  (void)rc;
}

void Engine::spawn(std::function<void()> fn) {
  auto w = std::make_shared<Worker>();
  std::lock_guard<std::mutex> g(workers_mu_);
  if (workers_closed_) throw Error("engine is finalizing");
  for (auto it = workers_.begin(); it != workers_.end();) {  // reap finished workers
    if ((*it)->done) {
      (*it)->t.join();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  w->t = std::thread([w, fn = std::move(fn)] {
    try {
      fn();
    } catch (const std::exception& e) {
      log::warn(std::string("engine worker: ") + e.what());
    }
    w->done = true;
  });
  workers_.push_back(w);
}

// ---------------------------------------------------------------------------- registration
std::vector<wire::Extent> Engine::local_extents() const {
  std::lock_guard<std::mutex> g(reg_mu_);
  std::vector<wire::Extent> out;
  for (const auto& [h, r] : regions_)
    if (r.fd >= 0) out.push_back({r.addr, r.len, r.fd_offset, uint32_t(r.fd)});
  return out;
}

std::vector<wire::Region> Engine::local_regions(uint64_t* version) const {
  std::lock_guard<std::mutex> g(reg_mu_);
  if (version) *version = reg_version_;
  std::vector<wire::Region> out;
  out.reserve(regions_.size());
  for (const auto& [h, r] : regions_) {
    (void)h;
    out.push_back({r.addr, r.len, r.mr ? r.mr->rkey() : 0, r.access});
  }
  return out;
}

std::pair<int, uint64_t> Engine::register_mem(uint64_t addr, uint64_t len, MemType type, uint32_t access) {
  try {
    if (!ready()) return {fail(kFailed, "register_mem: engine is not initialized"), 0};
    if (addr == 0 || len == 0 || addr + len < addr)
      return {fail(kParamInvalid, CallDesc("register_mem").hex("addr", addr).arg("len", len).str() +
                                      ": need a non-null address, length > 0, no wrap-around"), 0};
    if (type != MemType::kDevice && type != MemType::kHost)
      return {fail(kParamInvalid, "register_mem: unknown mem type " + std::to_string(int(type))), 0};
    if (access & ~uint32_t(wire::kRemoteRead | wire::kRemoteWrite))
      return {fail(kParamInvalid, CallDesc("register_mem").hex("access", access).str() +
                                      ": access must combine REMOTE_READ (1) and REMOTE_WRITE (2) only"), 0};
    // The same range again: the same handle, unless it asks for other access rights.
    auto same = [&](std::map<std::pair<uint64_t, uint64_t>, uint64_t>::const_iterator it) -> std::pair<int, uint64_t> {
      const LocalRegion& r = regions_.at(it->second);
      if (r.access != access)
        return {fail(kParamInvalid, CallDesc("register_mem").hex("addr", addr).arg("len", len).hex("access", access)
                                        .str() + ": already registered with access " + std::to_string(r.access) +
                                        " (deregister it first)"), 0};
      return {ok(), it->second};
    };
    {
      std::lock_guard<std::mutex> g(reg_mu_);
      auto it = region_by_range_.find({addr, len});
      if (it != region_by_range_.end()) return same(it);
    }
    std::shared_ptr<verbs::MemoryRegion> mr;
    if (pd_) {
      try {
        // LOCAL_WRITE always: a region is also the destination of our own READs.
        int flags = IBV_ACCESS_LOCAL_WRITE | (access & wire::kRemoteWrite ? IBV_ACCESS_REMOTE_WRITE : 0) |
                    (access & wire::kRemoteRead ? IBV_ACCESS_REMOTE_READ : 0);
        mr = std::make_shared<verbs::MemoryRegion>(pd_, reinterpret_cast<void*>(addr), size_t(len), flags);
      } catch (const Error& e) {
        int code = (e.err() == EFAULT || e.err() == EINVAL) ? kParamInvalid : kFailed;
        return {fail(code, e.what()), 0};
      }
    }
    uint64_t handle;
    {
      std::lock_guard<std::mutex> g(reg_mu_);
      if (reg_closed_) return {fail(kFailed, "register_mem: the engine was finalized meanwhile"), 0};
      auto it = region_by_range_.find({addr, len});
      if (it != region_by_range_.end()) return same(it);  // another thread won the race
      handle = next_handle_++;
      ++reg_version_;
      LocalRegion lr{addr, len, type, access, mr};
      if (auto info = acl::lookup(reinterpret_cast<const void*>(addr));
          info && info->fd >= 0 && addr + len <= info->base + info->size) {
        lr.fd = info->fd;  // the shim's memfd: same-host peers map it instead of cross-memory attach
        lr.fd_offset = info->offset;
      }
      regions_[handle] = lr;
      region_by_range_[{addr, len}] = handle;
      local_table_.insert({addr, len, mr ? mr->lkey() : 0, access, handle});
    }
    push_regions();
    return {ok(), handle};
  } catch (const std::exception& e) {
    return {fail(kFailed, std::string("register_mem: ") + e.what()), 0};
  }
}

int Engine::deregister_mem(uint64_t handle) {
  try {
    if (!ready()) return fail(kFailed, "deregister_mem: engine is not initialized");
    std::shared_ptr<verbs::MemoryRegion> mr;  // released after reg_mu_ (ibv_dereg_mr can be slow)
    {
      std::unique_lock<std::shared_mutex> data(data_mu_);  // a TCP peer's write into it finishes first
      std::lock_guard<std::mutex> g(reg_mu_);
      if (handle == 0 || handle >= next_handle_)
        return fail(kParamInvalid, "deregister_mem(handle=" + std::to_string(handle) + "): never issued");
      auto it = regions_.find(handle);
      if (it == regions_.end()) return ok();  // already deregistered: idempotent
      mr = std::move(it->second.mr);
      ++reg_version_;
      region_by_range_.erase({it->second.addr, it->second.len});
      local_table_.erase(handle);
      regions_.erase(it);
    }
    push_regions();
    return ok();
  } catch (const std::exception& e) {
    return fail(kFailed, std::string("deregister_mem: ") + e.what());
  }
}

void Engine::push_regions() {
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [k, l] : links_) links.push_back(l);
  }
  if (links.empty()) return;
  std::lock_guard<std::mutex> g(push_mu_);  // the snapshot below is at least as new as any sent before
  wire::Control c;
  c.type = wire::FrameType::kRegions;
  c.regions = local_regions(&c.version);
  c.extents = local_extents();
  for (auto& l : links) {
    try {
      l->send(c, Clock::now() + milliseconds(1000));
    } catch (const std::exception& e) {
      log::warn("region update to " + l->key + " failed: " + e.what());
    }
  }
}

// ------------------------------------------------------------------------------------ links
std::shared_ptr<rdma::Endpoint> Engine::make_endpoint() const {
  if (!pd_) return nullptr;
  rdma::EndpointOptions o;
  o.device = pd_->context()->name();
  o.gid_index = opts_.gid_index;
  if (opts_.traffic_class >= 0) o.traffic_class = uint8_t(opts_.traffic_class);
  if (opts_.service_level >= 0) o.service_level = uint8_t(opts_.service_level);
  return std::make_shared<rdma::Endpoint>(o);
}

wire::Control Engine::hello_frame(wire::FrameType type, const std::shared_ptr<rdma::Endpoint>& ep,
                                  uint32_t offers) const {
  wire::Control c;
  c.type = type;
  c.offers = offers;
  c.instance = instance_;
  c.name = name_;
  c.boot_id = boot_id_;
  c.pid = uint32_t(::getpid());
  c.probe_addr = reinterpret_cast<uint64_t>(&probe_cookie_);
  c.probe_value = probe_cookie_;
  c.extents = local_extents();
  c.regions = local_regions(&c.version);
  if (ep) c.hello = ep->local_info().hello;  // queue pair only: the regions travel in c.regions
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
    case wire::Transport::kRdma:
      link.path = std::make_shared<transport::RdmaPath>(link.ep, [this, key = link.key](uint32_t v) { push_flag(key, v); });
      break;
    case wire::Transport::kShm: {
      auto p = std::make_shared<transport::ShmPath>(pid_t(peer.pid), link.key);
      p->set_extents(peer.extents);
      p->set_flag_sender(flag_sender);
      link.shm = p.get();
      link.path = p;
      link.ep.reset();
      break;
    }
    case wire::Transport::kTcp: {
      auto p = std::make_shared<transport::TcpPath>(
          link.key,
          [this](uint64_t a, uint64_t len, bool write) {
            std::lock_guard<std::mutex> g(reg_mu_);
            return local_table_.find(a, len, write ? wire::kRemoteWrite : wire::kRemoteRead) != nullptr;
          },
          &data_mu_);
      p->set_flag_sender(flag_sender);
      link.tcp = p.get();
      link.path = p;
      link.ep.reset();
      break;
    }
    default: throw Error(std::string("no data path for transport ") + wire::transport_name(link.transport));
  }
}

std::shared_ptr<Engine::Link> Engine::find_link(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = links_.find(key);
  return it == links_.end() ? nullptr : it->second;
}

bool Engine::add_link(const std::shared_ptr<Link>& link, oob::Socket s, const wire::Control& peer,
                      std::shared_ptr<Link>* superseded) {
  link->peer_instance = peer.instance;
  link->ctrl = std::move(s);
  link->heard();  // the heartbeat counts from the publication
  link->set_regions(peer.regions, peer.version);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ != State::kReady) return false;
    auto it = links_.find(link->key);
    if (it != links_.end()) {
      if (!superseded) return false;
      *superseded = it->second;  // the caller retires it (outside mu_)
    }
    links_[link->key] = link;
    if (!link->initiator) incoming_.erase(link->key);  // serve_incoming()'s claim ends with the publication
    closed_.erase(link->key);
    auto a = async_.find(link->key);
    if (a != async_.end() && a->second == ConnState::kConnectFailed) async_.erase(a);
  }
  wake();
  std::string detail = " (" + std::to_string(peer.regions.size()) + " remote regions";
  if (link->ep)
    detail += ", device " + link->ep->local_info().device + ", gid index " +
              std::to_string(link->ep->local_info().gid_index) + ", path mtu " + std::to_string(link->ep->path_mtu());
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

void Engine::remove_link(const std::shared_ptr<Link>& link, const std::string& why, bool by_disconnect) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = links_.find(link->key);
    if (it != links_.end() && it->second == link) {
      links_.erase(it);
      if (!by_disconnect) {
        if (closed_.size() >= kMaxClosedRecords && !closed_.count(link->key)) closed_.erase(closed_.begin());
        closed_[link->key] = {link->id, why};
      }
    }
    if (by_disconnect) {  // also when the peer's goodbye got here first: this link is disconnected now
      auto c = closed_.find(link->key);
      if (c != closed_.end() && c->second.first == link->id) closed_.erase(c);
    }
  }
  {
    std::lock_guard<std::mutex> g(link->mu);
    if (link->down) return;
    link->down = true;
    link->down_reason = why;
    link->cv.notify_all();
  }
  if (link->path) link->path->close();  // rdma: QP -> ERR; shm/tcp: copies stopped, peer's requests refused
  link->ctrl.shutdown();
  wake();
  log::info("engine " + name_ + ": link to " + link->key + " closed: " + why);
}

std::pair<int, LinkInfo> Engine::link_info(const std::string& remote) {
  if (!ready()) return {fail(kFailed, "link_info: engine is not initialized"), {}};
  auto key = canonical(remote);
  if (!key) return {fail(kParamInvalid, "link_info: \"" + remote + "\" is not an engine address"), {}};
  auto link = find_link(*key);
  if (!link) return {fail(kNotConnected, "link_info: not connected to " + *key), {}};
  LinkInfo li;
  li.remote = link->key;
  li.transport = wire::transport_name(link->transport);
  li.initiator = link->initiator;
  if (link->ep) {
    auto info = link->ep->local_info();
    li.device = info.device;
    li.gid_index = info.gid_index;
    li.path_mtu = link->ep->path_mtu();
    li.qpn = info.hello.qpn;
    auto r = link->ep->remote();
    li.remote_qpn = r ? r->qpn : 0;
    li.traffic_class = link->ep->options().traffic_class;
    li.service_level = link->ep->options().service_level;
  }
  {
    std::lock_guard<std::mutex> g(link->mu);
    li.remote_regions = link->remote.size();
  }
  return {ok(), li};
}

std::vector<std::string> Engine::peers() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  for (auto& [k, l] : links_) out.push_back(k);
  return out;
}

// ------------------------------------------------------------------------------- connecting
// Registers a socket that is in a handshake so finalize() can shut it down instead of waiting.
class Engine::HandshakeGuard {
 public:
  HandshakeGuard(Engine& e, oob::Socket* s) : e_(e), s_(s) {
    std::lock_guard<std::mutex> g(e_.mu_);
    if (e_.state_ != State::kReady) s_->shutdown();
    e_.handshakes_.insert(s_);
  }
  ~HandshakeGuard() {
    std::lock_guard<std::mutex> g(e_.mu_);
    e_.handshakes_.erase(s_);
  }
  HandshakeGuard(const HandshakeGuard&) = delete;
  HandshakeGuard& operator=(const HandshakeGuard&) = delete;

 private:
  Engine& e_;
  oob::Socket* s_;
};

int Engine::connect(const std::string& remote, int timeout_ms) {
  try {
    auto key = canonical(remote);
    int port = -1;
    if (key) canonical(remote, &port);
    {
      std::lock_guard<std::mutex> g(mu_);
      if (state_ != State::kReady) return fail(kFailed, "connect: engine is not initialized");
      if (!key || port < 0) return fail(kParamInvalid, "connect: \"" + remote + "\" is not ip:port or [ipv6]:port");
      if (timeout_ms <= 0) return fail(kParamInvalid, "connect: timeout_in_millis must be > 0");
      if (*key == name_) return fail(kParamInvalid, "connect: " + *key + " is this engine itself");
      if (links_.count(*key)) return fail(kAlreadyConnected, "connect: already connected to " + *key);
      if (connecting_.count(*key) || incoming_.count(*key))
        return fail(kAlreadyConnected, "connect: a handshake with " + *key + " is in progress");
      connecting_.insert(*key);
    }
    int rc;
    try {
      rc = connect_impl(*key, timeout_ms);
    } catch (...) {
      std::lock_guard<std::mutex> g(mu_);
      connecting_.erase(*key);
      throw;
    }
    std::lock_guard<std::mutex> g(mu_);
    connecting_.erase(*key);
    return rc;
  } catch (const std::exception& e) {
    return fail(kFailed, "connect(" + remote + "): " + e.what());
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
    s = oob::connect_tcp(host, uint16_t(port), milliseconds(timeout_ms));
  } catch (const Error& e) {
    return fail(e.err() == ETIMEDOUT ? kTimeout : kFailed, "connect to " + key + ": " + e.what());
  }
  auto link = std::make_shared<Link>();
  link->key = key;
  link->initiator = true;
  link->id = random_instance() | 1;
  auto ep = (offers & wire::transport_bit(wire::Transport::kRdma)) ? make_endpoint() : nullptr;
  wire::Control peer;
  {
    HandshakeGuard guard(*this, &s);
    try {
      if (!opts_.auth_token.empty()) auth::client_handshake(s, opts_.auth_token, deadline);  // before anything of ours
      wire::Control hello = hello_frame(wire::FrameType::kConnect, ep, offers);
      hello.link = link->id;
      oob::send_all(s, wire::encode_control(hello), deadline);
      auto [h, payload] = oob::recv_frame(s, deadline);
      peer = wire::parse_control(h.type, payload.data(), payload.size());
      if (peer.type == wire::FrameType::kRefuse) {
        // The peer's reason is passed on; its code only where connect() documents it.
        int code = peer.status == kAlreadyConnected || peer.status == kUnsupported ? int(peer.status) : kFailed;
        return fail(code, "connect to " + key + ": refused by the peer: " + peer.text);
      }
      if (peer.type != wire::FrameType::kAccept)
        throw Error("expected an Accept frame, got type " + std::to_string(int(peer.type)));
      if (peer.link != link->id)
        throw Error("the Accept names link " + std::to_string(peer.link) + ", we asked for " + std::to_string(link->id));
      if (!(offers & wire::transport_bit(peer.transport)))
        throw Error(std::string("peer chose transport ") + wire::transport_name(peer.transport) + ", we offered " +
                    offers_string(offers));
      link->transport = peer.transport;
      if (peer.transport == wire::Transport::kRdma) {
        if (!ep || !peer.hello) throw Error("peer chose rdma without queue pair information");
        ep->connect(*peer.hello);
        link->ep = ep;
      } else if (peer.transport == wire::Transport::kShm) {
        std::string why = peer.boot_id != boot_id_ ? "the peer runs on another host (boot ids differ)"
                                                   : transport::shm_probe(pid_t(peer.pid), peer.probe_addr, peer.probe_value);
        if (!why.empty()) {
          if (shm_refusal && (offers & wire::transport_bit(wire::Transport::kTcp))) {
            *shm_refusal = why;
            wire::Control no;  // tell the server why this attempt ends, so that it does not log a failure
            no.type = wire::FrameType::kRefuse;
            no.status = uint32_t(kUnsupported);
            no.text = "shm not usable from the client (" + why + "); it reconnects without it";
            oob::send_all(s, wire::encode_control(no), deadline);
            // Until the server closed this connection: it has then read the Refuse and let go of
            // our name, so that the retry is not refused as "a handshake from us is in progress".
            oob::drain(s, deadline);
            return kRetryWithoutShm;
          }
          throw Error("the same-host transport was chosen but is not usable from here: " + why);
        }
      }
      make_path(*link, peer);
      oob::send_all(s, wire::encode_ready(), deadline);
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
  // TCP: two data connections, now that the server has published the link. Direction 0: we request,
  // the peer serves; 1: the other way round.
  if (link->tcp) {
    try {
      for (uint32_t dir = 0; dir < 2; ++dir) {
        oob::Socket d = oob::connect_tcp(host, uint16_t(port), std::max(left_until(deadline), milliseconds(1)));
        if (!opts_.auth_token.empty()) auth::client_handshake(d, opts_.auth_token, deadline);
        wire::Control a;
        a.type = wire::FrameType::kAttach;
        a.instance = instance_;
        a.name = name_;
        a.direction = dir;
        a.link = link->id;
        oob::send_all(d, wire::encode_control(a), deadline);
        link->tcp->attach(dir == 1, std::move(d));
      }
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

// The peer attaches only after our READY, and we publish the link before we send that: a data
// connection that matches no published link belongs to one already replaced or closed (a client
// that disconnected and reconnected before we served this connection). It must never be attached to
// the link that replaced it: that link's own connections would then be dropped as second ones.
void Engine::serve_attach(oob::Socket s, const wire::Control& c) {
  auto key = canonical(c.name);
  auto link = key ? find_link(*key) : nullptr;
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
  bool over = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = serving_by_host_.find(host);
    const int mine = it == serving_by_host_.end() ? 0 : it->second;
    over = serving_ >= kMaxHandshakes || mine >= kMaxHandshakesPerHost;
    if (over) {
      ++limit_refusals_;
      if (Clock::now() - last_limit_log_ >= std::chrono::seconds(1)) {
        last_limit_log_ = Clock::now();
        log::warn("engine " + name_ + ": refusing the peer at " + from + ": too many handshakes in progress (" +
                  std::to_string(serving_) + " in all, at most " + std::to_string(kMaxHandshakes) + "; " +
                  std::to_string(mine) + " from " + host + ", at most " + std::to_string(kMaxHandshakesPerHost) +
                  "); " + std::to_string(limit_refusals_) + " such refusals so far");
      }
    } else {
      ++serving_;
      ++serving_by_host_[host];
    }
  }
  if (over) {  // the refusal is small: it fits the socket buffer, so this never waits
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
  auto release = std::shared_ptr<void>(nullptr, [this, host](void*) {
    std::lock_guard<std::mutex> g(mu_);
    --serving_;
    auto it = serving_by_host_.find(host);
    if (it != serving_by_host_.end() && --it->second <= 0) serving_by_host_.erase(it);
  });
  auto sp = std::make_shared<oob::Socket>(std::move(s));
  try {
    spawn([this, sp, release] { serve_incoming(std::move(*sp)); });  // throws once finalizing: sp closes
  } catch (const std::exception& e) {
    log::info("engine " + name_ + ": not serving the peer at " + from + ": " + e.what());
  }
}

void Engine::serve_incoming(oob::Socket s) {
  HandshakeGuard guard(*this, &s);
  auto deadline = Clock::now() + milliseconds(opts_.handshake_timeout_ms);
  const std::string from = oob::peer_address(s);
  const std::string& token = opts_.auth_token;
  // A refusal carries its status and reason, nothing else of ours. Refusals of peers that did not
  // authenticate are warnings (with the peer's address; never the token).
  auto refuse = [&](int code, const std::string& why, bool warn = false, const std::string& detail = "") {
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
  };
  wire::Control c;
  bool authenticated = token.empty();
  try {
    if (!token.empty()) {
      // The first frame must be an AuthHello: anything else is refused by its header alone, and
      // nothing longer than an auth frame is read before the peer proved the token.
      wire::Header h = oob::recv_header(s, deadline);
      if (h.type != wire::FrameType::kAuthHello)
        return refuse(kFailed, "authentication required (this engine accepts only peers with its HixlAuthToken)",
                      true);
      auto payload = oob::recv_payload(s, h, deadline, auth::kMaxPreAuthPayload);
      std::string why = auth::server_handshake(s, token, wire::parse_control(h.type, payload.data(), payload.size()),
                                               deadline);
      if (!why.empty()) return refuse(kFailed, why, true);
      authenticated = true;
    }
    auto [h, payload] = oob::recv_frame(s, deadline);
    c = wire::parse_control(h.type, payload.data(), payload.size());
    if (c.type == wire::FrameType::kAuthHello && token.empty())
      return refuse(int(auth::kStatusNoAuth), "this engine has no HixlAuthToken: it does not authenticate peers", true);
    if (c.type == wire::FrameType::kAuthHello) return refuse(kFailed, "authentication already done", true);
    if (c.type == wire::FrameType::kAttach) return serve_attach(std::move(s), c);
    if (c.type != wire::FrameType::kConnect) throw Error("expected a Connect frame, got type " + std::to_string(int(h.type)));
  } catch (const std::exception& e) {
    // Before authentication the reason stays generic: the details (which may name our socket) go to the log only.
    if (!authenticated) return refuse(kFailed, "bad handshake (authentication required)", true, e.what());
    return refuse(kFailed, std::string("bad handshake: ") + e.what());
  }
  int peer_port = -1;
  auto key = canonical(c.name, &peer_port);
  if (!key) return refuse(kParamInvalid, "peer name \"" + c.name + "\" is not an engine address");

  // Transport: rdma when both ends have a device, else same-host when both are on this host and
  // cross-memory attach works, else TCP (a warning when that is the auto choice).
  const uint32_t common = c.offers & offers_;
  auto has = [&](wire::Transport t) { return (common & wire::transport_bit(t)) != 0; };
  wire::Transport chosen = wire::Transport::kNone;
  std::string shm_why;
  if (has(wire::Transport::kRdma) && c.hello && pd_) {
    chosen = wire::Transport::kRdma;
  } else {
    if (has(wire::Transport::kShm)) {
      shm_why = c.boot_id != boot_id_ ? "the peer runs on another host (boot ids differ)"
                                      : transport::shm_probe(pid_t(c.pid), c.probe_addr, c.probe_value);
      if (shm_why.empty()) chosen = wire::Transport::kShm;
    }
    if (chosen == wire::Transport::kNone && has(wire::Transport::kTcp)) chosen = wire::Transport::kTcp;
  }
  if (chosen == wire::Transport::kNone)
    return refuse(kUnsupported, "no common transport: peer offers " + offers_string(c.offers) + ", " + name_ +
                                    " offers " + offers_string(offers_) + (shm_why.empty() ? "" : "; shm: " + shm_why));
  if (chosen == wire::Transport::kTcp && !shm_why.empty())
    log::warn("engine " + name_ + ": same-host transport to " + *key + " not usable (" + shm_why + "); using tcp");
  {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ != State::kReady) return refuse(kFailed, name_ + " is finalizing");
    if (*key == name_) return refuse(kParamInvalid, "peer claims this engine's own name " + name_);
    auto it = links_.find(*key);
    // A Connect from a peer we have a link to means that peer dropped its end (a disconnect whose
    // goodbye is still in flight, or a restart): the new connection supersedes the old one. Only a
    // second client-only engine from the same IP (same name, another instance) is refused.
    if (it != links_.end() && peer_port < 0 && it->second->peer_instance != c.instance)
      return refuse(kAlreadyConnected, "another client-only engine from " + *key + " is connected to " + name_ +
                                           "; give each client a port to tell them apart");
    if (incoming_.count(*key)) return refuse(kAlreadyConnected, "a handshake from " + *key + " is in progress");
    // Both ends connecting to each other at once: the smaller name's outgoing connect wins.
    if (connecting_.count(*key) && name_ < *key)
      return refuse(kAlreadyConnected, name_ + " is connecting to " + *key + " itself");
    incoming_.insert(*key);
  }
  bool claimed = true;  // incoming_ holds *key for us; add_link() gives it back once the link is published
  std::shared_ptr<Link> old;
  try {
    auto link = std::make_shared<Link>();
    link->key = *key;
    link->id = c.link;
    link->transport = chosen;
    if (chosen == wire::Transport::kRdma) {
      link->ep = make_endpoint();
      link->ep->connect(*c.hello);  // RTR/RTS before we answer: the client may write as soon as it has our reply
    }
    make_path(*link, c);
    wire::Control a = hello_frame(wire::FrameType::kAccept, link->ep, offers_);
    a.transport = chosen;
    a.link = link->id;
    oob::send_all(s, wire::encode_control(a), deadline);
    auto [h, payload] = oob::recv_frame(s, deadline);
    if (h.type == wire::FrameType::kRefuse) {  // the client's probe of us failed: it retries without shm
      log::info("engine " + name_ + ": " + *key + " ended its handshake: " + wire::parse_control(h.type, payload.data(), payload.size()).text);
      link->path->close();
    } else if (h.type != wire::FrameType::kReady) {
      throw Error("expected READY, got frame type " + std::to_string(int(h.type)));
    } else {
    // Published, then confirmed with a READY of ours, so that the client's connect() returns only
    // once both ends hold the link. send_mu keeps any other frame for this link behind it.
    // Everything this handshake has to do is done before that READY: add_link() ends our claim on
    // the peer's name, and the link it replaced is retired here, so that a client that disconnects
    // and connects again the moment its connect() returned is neither refused ("a handshake is in
    // progress") nor raced by the old link's teardown.
    std::unique_lock<std::mutex> first(link->send_mu);
    if (!add_link(link, std::move(s), c, &old)) {
      first.unlock();
      link->path->close();
      log::info("engine " + name_ + ": dropping the link from " + *key + " (finalizing)");
    } else {
      claimed = false;
      if (old) remove_link(old, "superseded by a new connection from the same peer");
      old.reset();
      oob::send_all(link->ctrl, wire::encode_ready(), deadline);
    }
    }
  } catch (const std::exception& e) {
    log::warn("engine " + name_ + ": handshake with " + *key + " failed: " + e.what());
  }
  if (old) remove_link(old, "superseded by a new connection from the same peer");
  if (claimed) {
    std::lock_guard<std::mutex> g(mu_);
    incoming_.erase(*key);
  }
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
  {
    std::lock_guard<std::mutex> g(mu_);
    auto c = closed_.find(key);
    if (c == closed_.end()) return false;
    why = std::move(c->second.second);
    closed_.erase(c);
  }
  log::info("engine " + name_ + ": disconnect " + key + ": the link was already closed (" + why + ")");
  return true;
}

int Engine::disconnect_impl(const std::string& key, int timeout_ms, const std::string& why) {
  auto link = find_link(key);
  if (!link && take_closed(key)) return ok();
  if (!link) return fail(kNotConnected, "disconnect: not connected to " + key);
  try {
    wire::Control bye;
    bye.type = wire::FrameType::kBye;
    bye.text = why;
    link->send(bye, Clock::now() + milliseconds(std::max(1, timeout_ms)));
  } catch (const std::exception& e) {
    log::info("disconnect " + key + ": goodbye not delivered: " + e.what());
  }
  remove_link(link, why, true);
  return ok();
}

int Engine::connect_async(const std::string& remote, int timeout_ms) {
  try {
    if (!ready()) return fail(kFailed, "connect_async: engine is not initialized");
    auto key = canonical(remote);
    int port = -1;
    if (key) canonical(remote, &port);
    if (!key || port < 0) return fail(kParamInvalid, "connect_async: \"" + remote + "\" is not ip:port");
    if (timeout_ms <= 0) return fail(kParamInvalid, "connect_async: timeout_in_millis must be > 0");
    {
      std::lock_guard<std::mutex> g(mu_);
      if (*key == name_) return fail(kParamInvalid, "connect_async: " + *key + " is this engine itself");
      if (links_.count(*key)) return fail(kAlreadyConnected, "connect_async: already connected to " + *key);
      auto a = async_.find(*key);
      if (a != async_.end() && a->second != ConnState::kConnectFailed)
        return fail(kAlreadyConnected, "connect_async: an operation on " + *key + " is in progress");
      async_[*key] = ConnState::kConnectPending;
    }
    std::string k = *key;
    try {
      spawn([this, k, timeout_ms] {
        {
          std::lock_guard<std::mutex> g(mu_);
          async_[k] = ConnState::kConnecting;
        }
        int rc = connect(k, timeout_ms);
        std::lock_guard<std::mutex> g(mu_);
        if (rc == kSuccess || (rc == kAlreadyConnected && links_.count(k)))
          async_.erase(k);  // CONNECTED from now on comes from the link itself
        else
          async_[k] = ConnState::kConnectFailed;
      });
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> g(mu_);
      async_.erase(k);
      return fail(kFailed, "connect_async(" + k + "): " + e.what());
    }
    return ok();
  } catch (const std::exception& e) {
    return fail(kFailed, "connect_async(" + remote + "): " + e.what());
  }
}

int Engine::disconnect_async(const std::string& remote, int timeout_ms) {
  try {
    if (!ready()) return fail(kFailed, "disconnect_async: engine is not initialized");
    auto key = canonical(remote);
    if (!key) return fail(kParamInvalid, "disconnect_async: \"" + remote + "\" is not an engine address");
    if (!find_link(*key) && take_closed(*key)) return ok();  // nothing left to do: stays NOT_CONNECT
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!links_.count(*key)) return fail(kNotConnected, "disconnect_async: not connected to " + *key);
      auto a = async_.find(*key);
      if (a != async_.end() && a->second != ConnState::kConnectFailed)
        return fail(kAlreadyConnected, "disconnect_async: an operation on " + *key + " is in progress");
      async_[*key] = ConnState::kDisconnectPending;
    }
    std::string k = *key;
    try {
      spawn([this, k, timeout_ms] {
        {
          std::lock_guard<std::mutex> g(mu_);
          async_[k] = ConnState::kDisconnecting;
        }
        disconnect_impl(k, timeout_ms, "disconnected by " + name_);
        std::lock_guard<std::mutex> g(mu_);
        async_.erase(k);
      });
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> g(mu_);
      async_.erase(k);
      return fail(kFailed, "disconnect_async(" + k + "): " + e.what());
    }
    return ok();
  } catch (const std::exception& e) {
    return fail(kFailed, "disconnect_async(" + remote + "): " + e.what());
  }
}

std::pair<int, int> Engine::async_connect_status(const std::string& remote) {
  std::lock_guard<std::mutex> g(mu_);
  if (state_ != State::kReady) return {fail(kFailed, "get_async_connect_status: engine is not initialized"), 0};
  auto key = canonical(remote);
  if (!key) return {fail(kParamInvalid, "get_async_connect_status: \"" + remote + "\" is not an engine address"), 0};
  auto a = async_.find(*key);
  if (a != async_.end()) return {ok(), int(a->second)};
  return {ok(), int(links_.count(*key) ? ConnState::kConnected : ConnState::kNotConnect)};
}

std::pair<int, std::vector<std::pair<std::string, int>>> Engine::all_async_connect_status() {
  std::lock_guard<std::mutex> g(mu_);
  if (state_ != State::kReady) return {fail(kFailed, "get_all_async_connect_status: engine is not initialized"), {}};
  std::map<std::string, int> all;
  for (auto& [k, l] : links_) all[k] = int(ConnState::kConnected);
  for (auto& [k, s] : async_) all[k] = int(s);
  return {ok(), {all.begin(), all.end()}};
}

// -------------------------------------------------------------------------------- transfers
int Engine::ensure_link(const std::string& key, int timeout_ms, std::shared_ptr<Link>* out) {
  *out = find_link(key);
  if (*out) return kSuccess;
  if (!opts_.auto_connect) return fail(kNotConnected, "not connected to " + key + " (AutoConnect is off)");
  int rc = connect(key, std::max(1, timeout_ms));
  if (rc != kSuccess && rc != kAlreadyConnected) return rc;
  *out = find_link(key);
  return *out ? kSuccess : fail(kNotConnected, "auto-connect to " + key + " did not leave a link");
}

int Engine::prepare(const std::shared_ptr<Link>& link, TransferOp op, const std::vector<OpDesc>& descs,
                    Clock::time_point deadline, std::vector<rdma::Desc>* out) {
  if (descs.empty()) return fail(kParamInvalid, "transfer: empty descriptor list");
  if (op != TransferOp::kRead && op != TransferOp::kWrite)
    return fail(kParamInvalid, "transfer: unknown op " + std::to_string(int(op)));
  if (!link->path) return fail(kFailed, "transfer: link to " + link->key + " has no data transport");
  out->resize(descs.size());
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    const RegionEntry* last = nullptr;
    for (size_t i = 0; i < descs.size(); ++i) {
      const OpDesc& d = descs[i];
      if (d.len == 0 || d.local_addr + d.len < d.local_addr || d.remote_addr + d.len < d.remote_addr)
        return fail(kParamInvalid, CallDesc("transfer").arg("desc", i).hex("local_addr", d.local_addr)
                                       .hex("remote_addr", d.remote_addr).arg("len", d.len).str() +
                                       ": empty or wrapping range");
      if (!(last && last->contains(d.local_addr, d.len))) last = local_table_.find(d.local_addr, d.len, 0);
      if (!last)
        return fail(kParamInvalid, CallDesc("transfer").arg("desc", i).hex("local_addr", d.local_addr)
                                       .arg("len", d.len).str() + ": local range is not inside a registered region");
      rdma::Desc& r = (*out)[i];
      r.local_addr = d.local_addr;
      r.remote_addr = d.remote_addr;
      r.length = d.len;
      r.lkey = last->key;
      r.has_lkey = true;
    }
  }
  const uint32_t need = op == TransferOp::kWrite ? wire::kRemoteWrite : wire::kRemoteRead;
  auto resolve = [&](size_t* bad) {
    std::lock_guard<std::mutex> g(link->mu);
    const RegionEntry* last = nullptr;
    for (size_t i = 0; i < descs.size(); ++i) {
      const OpDesc& d = descs[i];
      if (!(last && last->contains(d.remote_addr, d.len))) last = link->remote.find(d.remote_addr, d.len, need);
      if (!last) {
        *bad = i;
        return false;
      }
      (*out)[i].rkey = last->key;
    }
    return true;
  };
  size_t bad = 0;
  if (resolve(&bad)) return kSuccess;
  // Not in our copy of the peer's regions: it may have registered since. Ask once, then decide.
  uint64_t seq = link->expect();
  wire::Control q;
  q.type = wire::FrameType::kRegionsReq;
  q.seq = seq;
  auto until = std::min(deadline, Clock::now() + milliseconds(1000));
  try {
    link->send(q, until);
    link->wait_reply(seq, until, nullptr);  // the progress thread applied the list before delivering
  } catch (const std::exception& e) {
    link->forget(seq);
    log::info("region refresh from " + link->key + " failed: " + e.what());
  }
  if (resolve(&bad)) return kSuccess;
  const OpDesc& d = descs[bad];
  return fail(kParamInvalid, CallDesc("transfer").arg("desc", bad).hex("remote_addr", d.remote_addr).arg("len", d.len)
                                 .str() + ": remote range is not inside a region " + link->key + " registered for " +
                                 (op == TransferOp::kWrite ? "remote write" : "remote read"));
}

bool Engine::abort_link(const std::shared_ptr<Link>& link, const std::string& why) {
  // 1. Our QP to ERR: nothing more leaves this side. 2. The peer moves its QP to ERR too, so packets
  // still in the network are dropped on arrival, and confirms. Only then may the caller say "no
  // write of this call lands later".
  if (link->path) link->path->close();
  bool confirmed = false;
  uint64_t seq = link->expect();
  try {
    wire::Control a;
    a.type = wire::FrameType::kAbort;
    a.seq = seq;
    a.text = why;
    auto until = Clock::now() + milliseconds(5000);
    link->send(a, until);
    confirmed = link->wait_reply(seq, until, nullptr).has_value();
  } catch (const std::exception& e) {
    link->forget(seq);
    log::warn("abort of link " + link->key + ": " + e.what());
  }
  remove_link(link, why);
  return confirmed;
}

int Engine::submit_checks(TransferOp op, int64_t flag, const char* call) {
  if (flag < 0) return kSuccess;
  if (flag > int64_t(UINT32_MAX)) return fail(kParamInvalid, std::string(call) + ": flag must be < 2^32");
  if (op != TransferOp::kWrite) return fail(kParamInvalid, std::string(call) + ": a completion flag needs a WRITE");
  return kSuccess;
}

int Engine::transfer_sync(const std::string& remote, TransferOp op, const std::vector<OpDesc>& descs,
                          int timeout_ms, int64_t flag) {
  try {
    if (!ready()) return fail(kFailed, "transfer_sync: engine is not initialized");
    if (timeout_ms <= 0) return fail(kParamInvalid, "transfer_sync: timeout_in_millis must be > 0");
    if (int rc = submit_checks(op, flag, "transfer_sync"); rc != kSuccess) return rc;
    auto key = canonical(remote);
    if (!key) return fail(kParamInvalid, "transfer_sync: \"" + remote + "\" is not an engine address");
    auto deadline = Clock::now() + milliseconds(timeout_ms);
    std::shared_ptr<Link> link;
    int rc = ensure_link(*key, timeout_ms, &link);
    if (rc != kSuccess) return rc;
    std::vector<rdma::Desc> rd;
    rc = prepare(link, op, descs, deadline, &rd);
    if (rc != kSuccess) return rc;
    transport::Op top = op == TransferOp::kWrite ? transport::Op::kWrite : transport::Op::kRead;
    rdma::RequestResult r;
    try {
      uint64_t id = link->path->submit(top, rd, std::max(left_until(deadline), milliseconds(1)),
                                       flag < 0 ? transport::Flag() : transport::Flag(uint32_t(flag)));
      r = link->path->wait(id, left_until(deadline));
    } catch (const Error& e) {
      remove_link(link, std::string("transfer failed: ") + e.what());
      return fail(kFailed, "transfer_sync to " + *key + ": " + e.what());
    }
    if (r.status == TransferStatus::kCompleted) return ok();
    if (r.status == TransferStatus::kFailed) {
      remove_link(link, "transfer failed: " + r.error);
      return fail(kFailed, "transfer_sync to " + *key + ": " + r.error);
    }
    if (!abort_link(link, "transfer_sync timed out after " + std::to_string(timeout_ms) + " ms"))
      return fail(kFailed, "transfer_sync to " + *key + ": not complete within " + std::to_string(timeout_ms) +
                               " ms, and the peer did not confirm its queue pair is in the error state: writes "
                               "already on the wire may still land. The link is closed");
    return fail(kTimeout, "transfer_sync to " + *key + ": not complete within " + std::to_string(timeout_ms) +
                              " ms; both queue pairs are in the error state, so none of its writes can land later. "
                              "The link is closed");
  } catch (const std::exception& e) {
    return fail(kFailed, "transfer_sync(" + remote + "): " + e.what());
  }
}

std::pair<int, uint64_t> Engine::transfer_async(const std::string& remote, TransferOp op,
                                                const std::vector<OpDesc>& descs, uint64_t user_data, int64_t flag,
                                                int timeout_ms) {
  try {
    const auto start = Clock::now();
    if (!ready()) return {fail(kFailed, "transfer_async: engine is not initialized"), 0};
    if (timeout_ms < 0) timeout_ms = opts_.async_timeout_ms;
    if (int rc = submit_checks(op, flag, "transfer_async"); rc != kSuccess) return {rc, 0};
    auto key = canonical(remote);
    if (!key) return {fail(kParamInvalid, "transfer_async: \"" + remote + "\" is not an engine address"), 0};
    std::shared_ptr<Link> link;
    int rc = ensure_link(*key, 1000, &link);
    if (rc != kSuccess) return {rc, 0};
    std::vector<rdma::Desc> rd;
    rc = prepare(link, op, descs, Clock::now() + milliseconds(1000), &rd);
    if (rc != kSuccess) return {rc, 0};
    uint64_t ep_req;
    try {
      ep_req = link->path->submit(op == TransferOp::kWrite ? transport::Op::kWrite : transport::Op::kRead, rd,
                                  milliseconds(-1), flag < 0 ? transport::Flag() : transport::Flag(uint32_t(flag)));
    } catch (const Error& e) {
      remove_link(link, std::string("transfer failed: ") + e.what());
      return {fail(kFailed, "transfer_async to " + *key + ": " + e.what()), 0};
    }
    std::lock_guard<std::mutex> g(mu_);
    uint64_t id = next_req_++;
    Request& r = reqs_[id];
    r.link = link;
    r.ep_req = ep_req;
    r.user_data = user_data;
    r.timeout_ms = timeout_ms;
    if (timeout_ms > 0) {
      r.deadline = start + milliseconds(timeout_ms);
      deadlines_.insert({r.deadline, id});
    }
    return {ok(), id};
  } catch (const std::exception& e) {
    return {fail(kFailed, "transfer_async(" + remote + "): " + e.what()), 0};
  }
}

rdma::RequestResult Engine::poll_locked(Request& r) {
  if (r.final_status >= 0) return {TransferStatus(r.final_status), r.final_error};
  // Past its deadline: its link is being aborted (the path may already say FAILED because of that
  // abort). finish_expired() decides between TIMEOUT and FAILED within seconds.
  if (r.expired) return {TransferStatus::kWaiting, ""};
  rdma::RequestResult res = r.link->path->status(r.ep_req);
  if (res.status == TransferStatus::kFailed) {  // say why, when it is the link that went (heartbeat, peer, abort)
    std::lock_guard<std::mutex> g(r.link->mu);
    if (r.link->down) res.error += " (the link to " + r.link->key + " was closed: " + r.link->down_reason + ")";
  }
  return res;
}

void Engine::erase_request_locked(std::map<uint64_t, Request>::iterator it) {
  if (it->second.deadline != Clock::time_point::max()) deadlines_.erase({it->second.deadline, it->first});
  reqs_.erase(it);
}

// Both status calls hold mu_ across the endpoint query: a terminal status is consumed exactly once,
// so two threads polling one request cannot turn a COMPLETED into "unknown request".
std::pair<int, int> Engine::transfer_status(uint64_t req) {
  try {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ != State::kReady) return {fail(kFailed, "get_transfer_status: engine is not initialized"), 0};
    auto it = reqs_.find(req);
    if (it == reqs_.end())
      return {fail(kParamInvalid, "get_transfer_status(req=" + std::to_string(req) +
                                      "): unknown request (never issued, or already reported complete/failed)"),
              int(TransferStatus::kFailed)};
    rdma::RequestResult res = poll_locked(it->second);
    if (res.status != TransferStatus::kWaiting) {
      erase_request_locked(it);
      if (res.status == TransferStatus::kFailed || res.status == TransferStatus::kTimeout)
        log::warn("transfer request " + std::to_string(req) + (res.status == TransferStatus::kFailed ? " failed: " : " timed out: ") + res.error);
    }
    return {ok(), int(res.status)};
  } catch (const std::exception& e) {
    return {fail(kFailed, "get_transfer_status: " + std::string(e.what())), int(TransferStatus::kFailed)};
  }
}

std::pair<int, int> Engine::transfer_wait(uint64_t req, int timeout_ms) {
  try {
    std::shared_ptr<transport::DataPath> path;
    uint64_t path_req = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (state_ != State::kReady) return {fail(kFailed, "transfer_wait: engine is not initialized"), 0};
      auto it = reqs_.find(req);
      if (it != reqs_.end()) {
        path = it->second.link->path;
        path_req = it->second.ep_req;
      }
    }
    // Wait without the engine lock and without consuming the status: transfer_status() below takes
    // it exactly once, as for any poller.
    const auto until = timeout_ms < 0 ? Clock::time_point::max() : Clock::now() + milliseconds(timeout_ms);
    if (path) path->wait_done(path_req, milliseconds(timeout_ms));
    for (;;) {
      auto r = transfer_status(req);
      if (r.first != kSuccess) t_last_error = "transfer_wait: " + t_last_error;
      if (r.first != kSuccess || r.second != int(TransferStatus::kWaiting) || Clock::now() >= until) return r;
      // The path is done or closed, but the request is past its deadline and its link's abort is
      // still deciding between TIMEOUT and FAILED (finish_expired() notifies); or wait_done() was
      // woken early. Either way: wait again, bounded by our own timeout.
      std::unique_lock<std::mutex> lk(mu_);
      req_cv_.wait_until(lk, std::min(until, Clock::now() + milliseconds(50)));
    }
  } catch (const std::exception& e) {
    return {fail(kFailed, "transfer_wait: " + std::string(e.what())), int(TransferStatus::kFailed)};
  }
}

std::pair<int, std::vector<TransferResult>> Engine::all_transfer_status(uint64_t max_count, bool skip_waiting) {
  try {
    std::lock_guard<std::mutex> g(mu_);
    if (state_ != State::kReady) return {fail(kFailed, "get_all_transfer_status: engine is not initialized"), {}};
    std::vector<TransferResult> out;
    for (auto it = reqs_.begin(); it != reqs_.end() && out.size() < max_count;) {
      rdma::RequestResult res = poll_locked(it->second);
      uint64_t id = it->first, user_data = it->second.user_data;
      if (res.status != TransferStatus::kWaiting) {
        if (res.status == TransferStatus::kFailed || res.status == TransferStatus::kTimeout)
          log::warn("transfer request " + std::to_string(id) + (res.status == TransferStatus::kFailed ? " failed: " : " timed out: ") + res.error);
        auto next = std::next(it);
        erase_request_locked(it);
        it = next;
      } else {
        ++it;
        if (skip_waiting) continue;
      }
      out.push_back({id, user_data, int(res.status)});
    }
    return {ok(), out};
  } catch (const std::exception& e) {
    return {fail(kFailed, "get_all_transfer_status: " + std::string(e.what())), {}};
  }
}

// ---------------------------------------------------------------------------------- notifies
int Engine::send_notify(const std::string& remote, const std::string& name, const std::string& msg, int timeout_ms) {
  try {
    if (!ready()) return fail(kFailed, "send_notify: engine is not initialized");
    if (timeout_ms <= 0) return fail(kParamInvalid, "send_notify: timeout_in_millis must be > 0");
    if (name.size() > kMaxNotifyBytes || msg.size() > kMaxNotifyBytes)
      return fail(kParamInvalid, "send_notify: name/message longer than 1024 characters (4096 bytes of UTF-8)");
    auto key = canonical(remote);
    if (!key) return fail(kParamInvalid, "send_notify: \"" + remote + "\" is not an engine address");
    auto deadline = Clock::now() + milliseconds(timeout_ms);
    std::shared_ptr<Link> link;
    int rc = ensure_link(*key, timeout_ms, &link);
    if (rc != kSuccess) return rc;
    uint64_t seq = link->expect();
    wire::Control n;
    n.type = wire::FrameType::kNotify;
    n.seq = seq;
    n.name = name;
    n.text = msg;
    bool went_down = false;
    std::optional<wire::Control> ack;
    try {
      link->send(n, deadline);
      ack = link->wait_reply(seq, deadline, &went_down);
    } catch (const Error& e) {
      link->forget(seq);
      return fail(e.err() == ETIMEDOUT ? kTimeout : kNotifyFailed, "send_notify to " + *key + ": " + e.what());
    }
    if (!ack) {
      if (went_down) return fail(kNotifyFailed, "send_notify to " + *key + ": the link closed before the peer acknowledged");
      return fail(kTimeout, "send_notify to " + *key + ": no acknowledgement within " + std::to_string(timeout_ms) + " ms");
    }
    if (ack->status == kSuccess) return ok();
    return fail(known_code(ack->status) ? int(ack->status) : kNotifyFailed,
                "send_notify to " + *key + ": the peer refused the notify" +
                    (ack->status == kResourceExhausted ? " (4096 unread notifies pending there)" : ""));
  } catch (const std::exception& e) {
    return fail(kFailed, "send_notify(" + remote + "): " + e.what());
  }
}

std::pair<int, std::vector<Notify>> Engine::wait_notifies(int timeout_ms) {
  if (!ready()) return {fail(kFailed, "wait_notifies: engine is not initialized"), {}};
  {
    std::unique_lock<std::mutex> lk(notify_mu_);
    auto pred = [&] { return !inbox_.empty() || stop_; };
    if (timeout_ms < 0)
      notify_cv_.wait(lk, pred);
    else
      notify_cv_.wait_for(lk, milliseconds(timeout_ms), pred);
  }
  return get_notifies();
}

void Engine::push_flag(const std::string& peer, uint32_t value) {
  std::lock_guard<std::mutex> g(flag_mu_);
  if (flags_.size() >= kMaxPendingFlags) {
    log::error("engine " + name_ + ": " + std::to_string(flags_.size()) + " completion flags pending, nobody reads "
               "them: dropping flag " + std::to_string(value) + " from " + peer);
    return;
  }
  if (flags_.empty()) {
    uint64_t one = 1;
    ssize_t rc = ::write(flag_fd_, &one, sizeof one);
    (void)rc;
  }
  flags_.push_back({peer, value});
  flag_cv_.notify_all();
}

std::vector<FlagEvent> Engine::take_flags_locked(size_t max) {
  std::vector<FlagEvent> out;
  while (!flags_.empty() && out.size() < max) {
    out.push_back(std::move(flags_.front()));
    flags_.pop_front();
  }
  if (flags_.empty() && !out.empty()) {
    uint64_t v;
    ssize_t rc = ::read(flag_fd_, &v, sizeof v);  // back to "not readable"
    (void)rc;
  }
  return out;
}

std::pair<int, std::vector<FlagEvent>> Engine::poll_flags(size_t max) {
  if (!ready()) return {fail(kFailed, "poll_flags: engine is not initialized"), {}};
  std::lock_guard<std::mutex> g(flag_mu_);
  return {ok(), take_flags_locked(max)};
}

std::pair<int, std::vector<FlagEvent>> Engine::wait_flags(size_t max, int timeout_ms) {
  if (!ready()) return {fail(kFailed, "wait_flags: engine is not initialized"), {}};
  std::unique_lock<std::mutex> lk(flag_mu_);
  auto pred = [&] { return !flags_.empty() || stop_; };
  if (timeout_ms < 0)
    flag_cv_.wait(lk, pred);
  else
    flag_cv_.wait_for(lk, milliseconds(timeout_ms), pred);
  if (stop_) return {fail(kFailed, "wait_flags: engine finalized"), {}};
  return {ok(), take_flags_locked(max)};
}

std::pair<int, std::vector<Notify>> Engine::get_notifies() {
  if (!ready()) return {fail(kFailed, "get_notifies: engine is not initialized"), {}};
  std::lock_guard<std::mutex> g(notify_mu_);
  std::vector<Notify> out(std::make_move_iterator(inbox_.begin()), std::make_move_iterator(inbox_.end()));
  inbox_.clear();
  unread_.clear();
  return {ok(), std::move(out)};
}

// ------------------------------------------------------------------------------ progress thread
void Engine::handle_frame(const std::shared_ptr<Link>& link, const wire::Control& c) {
  auto until = Clock::now() + milliseconds(1000);
  switch (c.type) {
    case wire::FrameType::kNotify: {
      wire::Control ack;
      ack.type = wire::FrameType::kNotifyAck;
      ack.seq = c.seq;
      if (c.name.size() > kMaxNotifyBytes || c.text.size() > kMaxNotifyBytes) {
        ack.status = kParamInvalid;  // our senders never do this: a hostile or broken peer
      } else {
        std::lock_guard<std::mutex> g(notify_mu_);
        size_t& unread = unread_[link->key];  // per peer, so reconnecting does not reset it
        if (unread >= kMaxUnreadNotifies) {
          ack.status = kResourceExhausted;
        } else {
          ++unread;
          inbox_.push_back({c.name, c.text});
          ack.status = kSuccess;
          notify_cv_.notify_all();
        }
      }
      link->send(ack, until);
      break;
    }
    case wire::FrameType::kNotifyAck:
    case wire::FrameType::kAbortAck: link->deliver(c); break;
    case wire::FrameType::kRegions:
      link->set_regions(c.regions, c.version);
      if (link->shm) link->shm->set_extents(c.extents);
      if (c.seq) link->deliver(c);
      break;
    case wire::FrameType::kRegionsReq: {
      wire::Control r;
      r.type = wire::FrameType::kRegions;
      r.seq = c.seq;
      r.regions = local_regions(&r.version);
      r.extents = local_extents();
      link->send(r, until);
      break;
    }
    case wire::FrameType::kAbort: {
      if (link->path) link->path->close();  // our side stopped before we confirm: nothing more lands here
      wire::Control ack;
      ack.type = wire::FrameType::kAbortAck;
      ack.seq = c.seq;
      try {
        link->send(ack, until);
      } catch (const std::exception&) {
      }
      remove_link(link, "peer aborted the link: " + c.text);
      break;
    }
    case wire::FrameType::kBye: remove_link(link, "peer disconnected: " + c.text); break;
    case wire::FrameType::kFlag: push_flag(link->key, c.status); break;
    case wire::FrameType::kPing: {
      wire::Control pong;
      pong.type = wire::FrameType::kPong;
      link->send(pong, until);
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
  remove_link(link, why);
}

void Engine::progress_loop() {
  std::vector<pollfd> pfds;
  std::vector<std::shared_ptr<Link>> polled;
  while (!stop_) {
    pfds.clear();
    polled.clear();
    pfds.push_back({wake_fd_, POLLIN, 0});
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& [k, l] : links_) {
        polled.push_back(l);
        pfds.push_back({l->ctrl.fd(), POLLIN, 0});
      }
    }
    // Asleep no longer than until the first incomplete frame's bound.
    auto wait = milliseconds(1000);
    for (auto& l : polled)
      if (l->rx.pending_bytes())
        wait = std::min(wait, std::chrono::ceil<milliseconds>(std::max(l->rx_since + kFrameCompleteBound - Clock::now(),
                                                                       Clock::duration::zero())));
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
      if (!pfds[base + i].revents) continue;
      auto& link = polled[i];
      try {
        read_control(link);
      } catch (const std::exception& e) {
        if (!link->is_down()) remove_link(link, std::string("control connection lost: ") + e.what());
      }
    }
    const auto now = Clock::now();
    for (auto& link : polled) close_if_frame_stuck(link, now);
  }
}

// ------------------------------------------------------------------------------ watchdog thread
// Its own thread: a ping to a peer that stopped reading may block for up to one interval, and an
// abort waits seconds for the peer's confirmation (that runs on a worker), neither of which may hold
// up the progress thread's frames or anyone's handshake.
void Engine::watchdog_loop() {
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
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [k, l] : links_) links.push_back(l);
  }
  for (auto& link : links) {
    if (stop_) return;
    auto now = Clock::now();
    const auto silent = link->silent_for(now);
    if (silent > limit) {
      const std::string why = "no frame from the peer for " + std::to_string(silent.count()) + " ms (a ping every " +
                              std::to_string(hb) + " ms, " + std::to_string(opts_.heartbeat_misses) +
                              " intervals without an answer): the peer is hung, stopped or unreachable" +
                              link->pending_note();
      log::warn("engine " + name_ + ": link to " + link->key + ": " + why + "; closing it");
      remove_link(link, why);
      continue;
    }
    if (now - link->last_ping < milliseconds(hb)) continue;
    wire::Control ping;
    ping.type = wire::FrameType::kPing;
    try {
      // A peer that stopped reading: the send gives up after one interval and the link goes.
      if (link->try_send(ping, now + milliseconds(hb))) link->last_ping = now;
    } catch (const std::exception& e) {
      log::info("engine " + name_ + ": heartbeat ping to " + link->key + ": " + e.what());
    }
  }
}

void Engine::expire_requests() {
  std::vector<std::shared_ptr<Link>> to_abort;
  {
    std::lock_guard<std::mutex> g(mu_);
    const auto now = Clock::now();
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const uint64_t id = deadlines_.begin()->second;
      deadlines_.erase(deadlines_.begin());
      auto it = reqs_.find(id);
      if (it == reqs_.end()) continue;
      Request& r = it->second;
      if (r.expired || r.final_status >= 0) continue;
      r.deadline = Clock::time_point::max();  // out of deadlines_ now
      if (r.link->path->wait_done(r.ep_req, milliseconds(0))) continue;  // ended in time; its status waits for the user
      r.expired = true;
      r.final_error = "transfer_async(req=" + std::to_string(id) + ") to " + r.link->key + ": not complete within " +
                      std::to_string(r.timeout_ms) + " ms";
      if (!r.link->aborting.exchange(true)) to_abort.push_back(r.link);
    }
  }
  for (auto& link : to_abort) {
    log::warn("engine " + name_ + ": an async request to " + link->key + " passed its deadline; aborting the link");
    try {
      spawn([this, link] { finish_expired(link, abort_link(link, "an async request passed its deadline")); });
    } catch (const std::exception& e) {  // finalizing: no abort, the link goes with the engine
      finish_expired(link, false);
    }
  }
}

void Engine::finish_expired(const std::shared_ptr<Link>& link, bool confirmed) {
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [id, r] : reqs_) {
      (void)id;
      if (r.link != link || !r.expired || r.final_status >= 0) continue;
      (void)r.link->path->status(r.ep_req);  // the path's record of it (FAILED: closed) is not needed
      if (confirmed) {
        r.final_status = int(TransferStatus::kTimeout);
        r.final_error += "; the link was aborted and the peer confirmed it stopped too: none of its writes can land "
                         "later";
      } else {
        r.final_status = int(TransferStatus::kFailed);
        r.final_error += "; the link was aborted, but the peer did not confirm it stopped: writes already on the "
                         "wire may still land";
      }
    }
  }
  req_cv_.notify_all();
}

}  // namespace hixl::engine
