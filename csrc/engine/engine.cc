// The engine's lifecycle (initialize, finalize, its threads and workers), registration, and the
// queries on it. The parts it composes are described in engine.h.
#include "engine/engine.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include "auth/handshake.h"
#include "engine/internal.h"
#include "transport/shm_path.h"
#include "verbs/error.h"
#include "verbs/log.h"
#include "verbs/reaper.h"

namespace hixl::engine {

using namespace detail;

static_assert(auth::kStatusNoAuth == uint32_t(kUnsupported), "auth/handshake.h names engine::kUnsupported");
static_assert(auth::kStatusRefused == uint32_t(kFailed), "auth/handshake.h names engine::kFailed");

struct Engine::Worker {
  std::thread t;
  std::atomic<bool> done{false};
};

Engine::Engine() : probe_cookie_(random_u64() | 1), instance_(random_u64()), requests_(metrics_) {}

Engine::~Engine() {
  try {
    finalize();
  } catch (const std::exception& e) {
    log::warn(std::string("Engine teardown: ") + e.what());
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);  // here, not in finalize(): late wake() calls stay harmless
  if (accept_wake_fd_ >= 0) ::close(accept_wake_fd_);
}

bool Engine::ready() const { return state_.load(std::memory_order_acquire) == State::kReady; }

std::string Engine::last_error() const { return detail::last_error(); }

namespace {

// initialize()'s checks of its options, in order: kSuccess, or the first failed check's kParamInvalid.
int check_options(const Options& opts) {
  if (opts.transport != "auto" && opts.transport != "rdma" && opts.transport != "shm" && opts.transport != "tcp")
    return fail(kParamInvalid, "initialize: unknown transport \"" + opts.transport + "\"");
  if (opts.traffic_class > 255 || opts.service_level > 15 || opts.gid_index > 255)
    return fail(kParamInvalid, "initialize: traffic_class 0..255, service_level 0..15, gid_index 0..255");
  if (opts.rdma_timeout == 0 || opts.rdma_timeout > 31 || opts.rdma_retry_count > 7)
    return fail(kParamInvalid, "initialize: rdma_timeout=" + std::to_string(opts.rdma_timeout) +
                                   " rdma_retry_count=" + std::to_string(opts.rdma_retry_count) +
                                   ": need rdma_timeout 1..31 (0 would never retransmit), rdma_retry_count 0..7");
  if (opts.rdma_qps_per_link == 0 || opts.rdma_qps_per_link > int(transport::RdmaPath::kMaxQps))
    return fail(kParamInvalid, "initialize: rdma_qps_per_link=" + std::to_string(opts.rdma_qps_per_link) +
                                   ": need 1.." + std::to_string(transport::RdmaPath::kMaxQps));
  if (opts.rdma_max_wr_bytes != -1 &&
      (opts.rdma_max_wr_bytes < Options::kMinMaxWrBytes || opts.rdma_max_wr_bytes > Options::kMaxMaxWrBytes))
    return fail(kParamInvalid, "initialize: rdma_max_wr_bytes=" + std::to_string(opts.rdma_max_wr_bytes) +
                                   ": need " + std::to_string(Options::kMinMaxWrBytes) + ".." +
                                   std::to_string(Options::kMaxMaxWrBytes));
  if (opts.rdma_send_window_bytes < -1 || opts.rdma_send_window_bytes > Options::kMaxSendWindowBytes)
    return fail(kParamInvalid, "initialize: rdma_send_window_bytes=" + std::to_string(opts.rdma_send_window_bytes) +
                                   ": need 0.." + std::to_string(Options::kMaxSendWindowBytes) + " (0: none)");
  if (opts.async_timeout_ms < 0 || opts.heartbeat_ms < 0 || opts.heartbeat_ms > 3600000 ||
      opts.heartbeat_misses < 1 || opts.heartbeat_misses > 1000)
    return fail(kParamInvalid, "initialize: async_timeout_ms=" + std::to_string(opts.async_timeout_ms) +
                                   " heartbeat_ms=" + std::to_string(opts.heartbeat_ms) + " heartbeat_misses=" +
                                   std::to_string(opts.heartbeat_misses) +
                                   ": need async_timeout_ms >= 0, heartbeat_ms 0..3600000, heartbeat_misses 1..1000");
  return kSuccess;
}

// The RDMA device, when the options ask for one and its port 1 is ACTIVE (into *pd; else *why_none
// says why there is none). kFailed when RDMA was required (HixlTransport=rdma, or a device named
// under auto) but is unusable.
int open_rdma(const Options& opts, std::shared_ptr<verbs::ProtectionDomain>* pd_out, std::string* why_none) {
  std::shared_ptr<verbs::ProtectionDomain> pd;
  *why_none = "not asked for (HixlTransport=" + opts.transport + ")";
  const bool want_rdma = opts.transport == "auto" || opts.transport == "rdma";
  if (want_rdma) try {
    pd = verbs::ProtectionDomain::shared_for(opts.device);
    auto pi = pd->context()->query_port(1);
    if (pi.state != IBV_PORT_ACTIVE) {
      *why_none = "device " + pd->context()->name() + " port 1 is not ACTIVE";
      pd.reset();
    } else {
      pd->context()->select_gid_index(1, opts.gid_index);  // validates HixlGidIndex / $HIXL_GID_INDEX now
    }
  } catch (const Error& e) {
    *why_none = e.what();
    pd.reset();
  }
  if (!pd && (opts.transport == "rdma" || (want_rdma && !opts.device.empty())))
    return fail(kFailed, "initialize: RDMA transport requested but unusable: " + *why_none);
  *pd_out = std::move(pd);
  return kSuccess;
}

// Soft-RoCE's defaults, unless told otherwise: 8 queue pairs per link, each with a 64 KiB send window
// where the link is striped, 16 KiB work requests that grow for big requests where it has no window
// (Options::kSoftRoce*, types.h). Elsewhere -1 keeps the endpoint's own defaults.
void apply_device_defaults(Options* o, bool soft_roce) {
  o->rdma_max_slices = 0;
  if (soft_roce) {
    if (o->rdma_qps_per_link < 0) o->rdma_qps_per_link = Options::kSoftRoceQpsPerLink;
    if (o->rdma_send_window_bytes < 0 && o->rdma_qps_per_link > 1)
      o->rdma_send_window_bytes = Options::kSoftRoceSendWindowBytes;
    if (o->rdma_max_wr_bytes < 0) {
      o->rdma_max_wr_bytes = Options::kSoftRoceMaxWrBytes;
      o->rdma_max_slices = Options::kSoftRoceMaxSlices;
    }
  }
}

}  // namespace

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
    if (int rc = check_options(opts); rc != kSuccess) return rc;
    std::shared_ptr<verbs::ProtectionDomain> pd;
    std::string why_none;
    if (int rc = open_rdma(opts, &pd, &why_none); rc != kSuccess) return rc;

    oob::Socket listener;
    std::string name = *canon;
    if (port >= 0) {
      auto [s, bound] = oob::listen_tcp(host, uint16_t(port));
      listener = std::move(s);
      name = *canonical(host.find(':') != std::string::npos ? "[" + host + "]:" + std::to_string(bound)
                                                            : host + ":" + std::to_string(bound));
    }
    int wfd = -1, afd = -1;
    open_event_fds(name, &wfd, &afd);

    opts_ = opts;
    apply_device_defaults(&opts_, pd && pd->context()->soft_roce());
    pd_ = std::move(pd);
    registry_.open_fence();
    registry_.set_pd(pd_);
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
    accept_wake_fd_ = afd;
    start_threads();
    state_ = State::kReady;
    log::info("engine " + name_ + ": transports " + offers_string(offers_) +
              (pd_ ? " (rdma on " + pd_->context()->name() + ")" : " (no rdma: " + why_none + ")"));
    return ok();
  } catch (const std::exception& e) {
    return fail(kFailed, std::string("initialize(") + local_engine + "): " + e.what());
  }
}

void Engine::open_event_fds(const std::string& name, int* wfd_out, int* afd_out) {
  int wfd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wfd < 0) throw_errno("eventfd", errno);
  int afd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (afd < 0) {
    ::close(wfd);
    throw_errno("eventfd", errno);
  }
  try {
    inbox_.open(name);
  } catch (...) {
    ::close(wfd);
    ::close(afd);
    throw;
  }
  *wfd_out = wfd;
  *afd_out = afd;
}

void Engine::start_threads() {
  stop_ = false;
  progress_ = std::thread([this] { progress_loop(); });
  watchdog_ = std::thread([this] { watchdog_loop(); });
  if (listener_.valid()) acceptor_ = std::thread([this] { accept_loop(); });
  // The device's async events (a QP in error, the port down) end the affected links at once.
  if (pd_) async_sub_ = pd_->context()->async_events().subscribe([this](const verbs::AsyncEvent& ev) {
    on_async_event(ev);
  });
}

void Engine::finalize() {
  std::map<std::string, std::shared_ptr<Link>> links;
  {
    // One step, as seen by everyone: not ready, no link published or claimed from now on, and every
    // handshake in flight fails now instead of at its deadline.
    std::lock_guard<std::mutex> g(mu_);
    const bool was_ready = state_ == State::kReady;
    state_ = State::kFinalized;
    if (!was_ready) return;
    links = links_.close();
    handshakes_.close();
  }
  if (async_sub_) pd_->context()->async_events().unsubscribe(async_sub_);  // no handler runs after this
  async_sub_ = 0;
  stop_ = true;
  inbox_.close();       // waiters for notifies and flags return
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
  // One bound for all the goodbyes: a peer that does not read costs the others nothing (theirs are
  // written at once when their sockets take them).
  const auto bye_until = Clock::now() + milliseconds(200);
  for (auto& [key, link] : links) {
    (void)key;
    try {
      wire::Control bye;
      bye.type = wire::FrameType::kBye;
      bye.text = "engine finalized";
      link->send(bye, bye_until);
    } catch (const std::exception&) {
    }
    remove_link(link, "engine finalized", Metrics::Cause::kFinalize);
  }
  std::vector<std::shared_ptr<Worker>> workers;
  {
    std::lock_guard<std::mutex> g(workers_mu_);
    workers_closed_ = true;  // spawn() refuses from now on, so every worker is joined below
    workers.swap(workers_);
  }
  for (auto& w : workers)
    if (w->t.joinable()) w->t.join();
  requests_.clear();
  lists_.clear();
  links.clear();
  // Queue pairs are destroyed in the background (verbs/reaper.h). Give them a bounded moment: then
  // normally they are gone before the MRs and before finalize() returns, and a stuck link costs 2 s.
  if (pd_) verbs::Reaper::instance().drain(milliseconds(2000));
  registry_.close();  // MRs go after every QP is gone (but a QP stuck in the reaper)
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
std::pair<int, uint64_t> Engine::register_mem(uint64_t addr, uint64_t len, MemType type, uint32_t access) {
  try {
    if (!ready()) return {fail(kFailed, "register_mem: engine is not initialized"), 0};
    bool added = false;
    auto r = registry_.add(addr, len, type, access, &added);
    if (added) push_regions();  // peers learn the new region
    return r;
  } catch (const std::exception& e) {
    return {fail(kFailed, std::string("register_mem: ") + e.what()), 0};
  }
}

int Engine::deregister_mem(uint64_t handle) {
  try {
    if (!ready()) return fail(kFailed, "deregister_mem: engine is not initialized");
    bool removed = false;
    int rc = registry_.remove(handle, &removed);
    if (removed) push_regions();
    return rc;
  } catch (const std::exception& e) {
    return fail(kFailed, std::string("deregister_mem: ") + e.what());
  }
}

// ----------------------------------------------------------------------------------- queries
std::pair<int, LinkInfo> Engine::link_info(const std::string& remote) {
  if (!ready()) return {fail(kFailed, "link_info: engine is not initialized"), {}};
  auto key = canonical(remote);
  if (!key) return {fail(kParamInvalid, "link_info: \"" + remote + "\" is not an engine address"), {}};
  auto link = links_.find(*key);
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
    li.rdma_timeout = link->ep->options().timeout;
    li.rdma_retry_count = link->ep->options().retry_cnt;
    li.rdma_max_wr_bytes = link->ep->options().slice_bytes;
    li.posted_wrs = link->ep->stats().posted_wrs;
    li.rdma_send_window_bytes = link->ep->options().window_bytes;
    for (const auto& m : link->more_eps) li.posted_wrs += m->stats().posted_wrs;
    li.qpns = link->qpns();
    li.qps = int(li.qpns.size());
  }
  {
    std::lock_guard<util::Mutex> g(link->mu);
    li.remote_regions = link->remote.size();
  }
  return {ok(), li};
}

std::vector<std::string> Engine::peers() { return links_.keys(); }

void Engine::on_async_event(const verbs::AsyncEvent& ev) {
  if (!ev.is_qp_error() && !(ev.is_port_error() && (ev.port == 0 || ev.port == 1))) return;  // we use port 1
  const std::string why = "the RDMA device " + pd_->context()->name() + " reported " + ev.describe();
  for (auto& link : links_.all()) {
    if (!link->ep) continue;
    if (ev.is_qp_error()) {
      const auto qpns = link->qpns();
      if (std::find(qpns.begin(), qpns.end(), ev.qp_num) == qpns.end()) continue;
    }
    log::warn("engine " + name_ + ": link to " + link->key + ": " + why + "; closing it");
    remove_link(link, why, Metrics::Cause::kAsyncEvent);
  }
}

int Engine::inject_async_event(int type, uint32_t qp_num, int port) {
  if (!ready()) return fail(kFailed, "inject_async_event: engine is not initialized");
  if (!pd_) return fail(kUnsupported, "inject_async_event: this engine has no RDMA device");
  verbs::AsyncEvent ev;
  ev.type = ibv_event_type(type);
  ev.qp_num = qp_num;
  ev.port = port;
  pd_->context()->async_events().dispatch(ev);
  return ok();
}

Metrics::Snapshot Engine::metrics(std::array<uint64_t, Metrics::kTransports>* links) const {
  links->fill(0);
  for (const auto& l : links_.all()) {
    const int t = int(l->transport) - 1;
    if (t >= 0 && t < Metrics::kTransports) ++(*links)[size_t(t)];
  }
  Metrics::Snapshot s = metrics_.snapshot();
  requests_.add_counts_to(&s);
  return s;
}

}  // namespace hixl::engine
