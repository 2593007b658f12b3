#include "transport/rdma_endpoint.h"

#include <arpa/inet.h>

#include <algorithm>
#include <random>
#include <thread>

#include "auth/handshake.h"
#include "verbs/error.h"
#include "verbs/log.h"
#include "verbs/reaper.h"
#include "wire/control.h"

namespace hixl::rdma {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

const char* op_name(Op op) {
  switch (op) {
    case Op::kRead: return "RDMA_READ";
    case Op::kWrite: return "RDMA_WRITE";
    case Op::kWriteImm: return "RDMA_WRITE_WITH_IMM";
  }
  return "?";
}

namespace {

uint32_t random_psn() {
  static std::mutex mu;
  static std::mt19937 rng(std::random_device{}());
  std::lock_guard<std::mutex> g(mu);
  return rng() & 0xffffff;
}

uint32_t wire_access(int verbs_access) {
  uint32_t a = 0;
  if (verbs_access & IBV_ACCESS_REMOTE_READ) a |= wire::kRemoteRead;
  if (verbs_access & IBV_ACCESS_REMOTE_WRITE) a |= wire::kRemoteWrite;
  return a;
}

}  // namespace

// A deadline `timeout` after `now`; negative = never. Clamped so huge values cannot overflow the clock.
Clock::time_point deadline_after(Clock::time_point now, milliseconds timeout) {
  constexpr milliseconds kMax(1000LL * 3600 * 24 * 365);  // a year is "forever" here
  if (timeout.count() < 0) return Clock::time_point::max();
  return now + std::min(timeout, kMax);
}

Clock::time_point deadline_after(milliseconds timeout) {
  return timeout.count() < 0 ? Clock::time_point::max() : deadline_after(Clock::now(), timeout);
}

Endpoint::Endpoint(const EndpointOptions& opts) : opts_(opts) {
  if (opts_.sq_depth < 2) throw Error("Endpoint: sq_depth=" + std::to_string(opts_.sq_depth) + " must be >= 2");
  if (opts_.rq_depth < 1) throw Error("Endpoint: rq_depth must be >= 1");
  if (opts_.slice_bytes == 0) throw Error("Endpoint: slice_bytes must be > 0");
  if (opts_.max_chain == 0) opts_.max_chain = 1;
  pd_ = verbs::ProtectionDomain::shared_for(opts_.device);
  const auto& ctx = pd_->context();
  const ibv_device_attr& da = ctx->attr();
  port_info_ = ctx->query_port(opts_.port);
  if (port_info_.state != IBV_PORT_ACTIVE)
    throw Error("Endpoint: device " + ctx->name() + " port " + std::to_string(opts_.port) + " is not ACTIVE (state " +
                ibv_port_state_str(port_info_.state) + ")");
  gid_index_ = ctx->select_gid_index(opts_.port, opts_.gid_index);
  gid_ = ctx->query_gid(opts_.port, gid_index_);
  // A slice must fit ibv_sge.length (32 bits) and the port's max_msg_sz.
  if (port_info_.max_msg_sz) max_slice_ = std::min<uint64_t>(max_slice_, port_info_.max_msg_sz);
  opts_.slice_bytes = std::min(opts_.slice_bytes, max_slice_);

  uint32_t sq = std::min<uint32_t>(opts_.sq_depth, uint32_t(da.max_qp_wr));
  uint32_t rq = std::min<uint32_t>(opts_.rq_depth, uint32_t(da.max_qp_wr));
  send_ch_ = std::make_shared<verbs::CompletionChannel>(ctx);
  recv_ch_ = std::make_shared<verbs::CompletionChannel>(ctx);
  send_cq_ = std::make_shared<verbs::CompletionQueue>(ctx, send_ch_, std::min<int>(int(sq) + 1, da.max_cqe));
  recv_cq_ = std::make_shared<verbs::CompletionQueue>(ctx, recv_ch_, std::min<int>(int(rq) + 1, da.max_cqe));
  verbs::QpCaps caps;
  caps.max_send_wr = sq;
  caps.max_recv_wr = rq;
  caps.max_send_sge = 1;
  caps.max_inline = opts_.max_inline;
  try {
    qp_ = std::make_unique<verbs::QueuePair>(pd_, send_cq_, recv_cq_, caps);
  } catch (const Error& e) {
    if (!caps.max_inline) throw;
    log::info(std::string("inline data refused, retrying without: ") + e.what());
    caps.max_inline = 0;
    qp_ = std::make_unique<verbs::QueuePair>(pd_, send_cq_, recv_cq_, caps);
  }
  opts_.max_inline = qp_->caps().max_inline;
  // Keep one slot of slack: the provider may report more than we asked for, we use what we asked.
  sq_depth_ = std::min(sq, qp_->caps().max_send_wr);
  signal_every_ = std::max<uint32_t>(1, sq_depth_ / 4);
  opts_.max_chain = std::min(opts_.max_chain, sq_depth_);
  if (opts_.window_bytes) posted_at_.resize(sq_depth_);
  wrs_.resize(opts_.max_chain);
  sges_.resize(opts_.max_chain);
  psn_ = random_psn();
  qp_->to_init(opts_.port, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  post_recvs(qp_->caps().max_recv_wr < rq ? qp_->caps().max_recv_wr : rq);
  log::debug("endpoint on " + ctx->name() + " port " + std::to_string(opts_.port) + " gid[" +
             std::to_string(gid_index_) + "]=" + verbs::gid_to_string(gid_) + " qpn " + std::to_string(qp_->qpn()));
}

Endpoint::~Endpoint() {
  try { close(); } catch (const std::exception& e) { log::warn(std::string("Endpoint teardown: ") + e.what()); }
  // ibv_destroy_qp can block for as long as the link is stuck (verbs/reaper.h): not in our caller.
  if (qp_) {
    std::string what = "ibv_destroy_qp(qpn " + std::to_string(qp_->qpn()) + ", device " + pd_->context()->name() + ")";
    verbs::Reaper::instance().release(std::shared_ptr<verbs::QueuePair>(std::move(qp_)), std::move(what));
  }
}

LocalInfo Endpoint::local_info() const {
  LocalInfo li;
  li.hello.qpn = qp_->qpn();
  li.hello.psn = psn_;
  li.hello.lid = port_info_.lid;
  li.hello.mtu = uint16_t(verbs::mtu_to_bytes(port_info_.active_mtu));
  li.hello.port = opts_.port;
  li.hello.gid = gid_;
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    for (const auto& [h, mr] : regions_) {
      (void)h;
      li.hello.regions.push_back({mr->addr(), mr->length(), mr->rkey(), wire_access(mr->access())});
    }
  }
  li.device = pd_->context()->name();
  li.gid_index = gid_index_;
  li.link_layer = port_info_.link_layer;
  return li;
}

std::optional<wire::Hello> Endpoint::remote() const {
  std::lock_guard<util::Mutex> g(mu_);
  return remote_;
}

void Endpoint::connect(const wire::Hello& r) {
  std::lock_guard<util::Mutex> g(mu_);
  if (closed_) throw Error("Endpoint::connect: endpoint is closed");
  if (connected_) throw Error("Endpoint::connect: already connected to qpn " + std::to_string(remote_->qpn));
  if (r.qpn == 0 || r.qpn > 0xffffff) throw Error("Endpoint::connect: remote qpn " + std::to_string(r.qpn) + " out of range");
  verbs::QpRemote qr;
  qr.qpn = r.qpn;
  qr.psn = r.psn & 0xffffff;
  qr.lid = r.lid;
  qr.gid = r.gid;
  ibv_mtu remote_mtu = verbs::mtu_from_bytes(r.mtu);
  qr.mtu = std::min(remote_mtu, port_info_.active_mtu);
  verbs::QpPathOptions p;
  p.port = opts_.port;
  p.gid_index = gid_index_;
  p.use_grh = port_info_.link_layer == IBV_LINK_LAYER_ETHERNET || !std::all_of(r.gid.begin(), r.gid.end(), [](uint8_t b) { return b == 0; });
  p.traffic_class = opts_.traffic_class;
  p.service_level = opts_.service_level;
  p.timeout = opts_.timeout;
  p.retry_cnt = opts_.retry_cnt;
  const ibv_device_attr& da = pd_->context()->attr();
  p.max_rd_atomic = uint8_t(std::max(1, std::min({16, da.max_qp_rd_atom, da.max_qp_init_rd_atom})));
  qp_->to_rtr(qr, p);
  qp_->to_rts(psn_, p);
  remote_ = r;
  path_mtu_ = verbs::mtu_to_bytes(qr.mtu);
  connected_ = true;
  log::info("connected qpn " + std::to_string(qp_->qpn()) + " -> remote qpn " + std::to_string(r.qpn) + " gid " +
            verbs::gid_to_string(r.gid) + " path_mtu " + std::to_string(verbs::mtu_to_bytes(qr.mtu)));
}

uint16_t Endpoint::listen(const std::string& host, uint16_t port) {
  if (closed_) throw Error("Endpoint::listen: endpoint is closed");
  if (listener_.valid()) throw Error("Endpoint::listen: already listening");
  auto [s, bound] = oob::listen_tcp(host, port);
  listener_ = std::move(s);
  return bound;
}

namespace {
// A refusal the peer can read whatever state it is in: a control Refuse frame (what
// auth::client_handshake and the hello reader below understand), then drain so our close does not
// reset the connection before the peer read it.
void refuse_peer(const oob::Socket& s, uint32_t status, const std::string& why, Clock::time_point deadline) {
  wire::Control r;
  r.type = wire::FrameType::kRefuse;
  r.status = status;
  r.text = why;
  try {
    oob::send_all(s, wire::encode_control(r), deadline);
    oob::drain(s, std::min(deadline, Clock::now() + milliseconds(200)));
  } catch (...) {
  }
}
}  // namespace

wire::Hello Endpoint::handshake(oob::Socket& s, bool server, milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  const std::string& token = opts_.auth_token;
  auto parse_hello = [](const wire::Header& h, const std::vector<uint8_t>& payload) {
    if (h.type == wire::FrameType::kReject)
      throw Error("handshake: peer rejected us: " + std::string(payload.begin(), payload.end()));
    if (h.type == wire::FrameType::kRefuse)
      throw Error("handshake: peer refused us: " + wire::parse_control(h.type, payload.data(), payload.size()).text);
    if (h.type != wire::FrameType::kHello) throw Error("handshake: expected hello, got frame type " + std::to_string(int(h.type)));
    return wire::parse_hello(payload.data(), payload.size());
  };
  auto mine = wire::encode_hello(local_info().hello);
  wire::Hello peer;
  if (server) {
    const std::string from = oob::peer_address(s);
    wire::Header h = oob::recv_header(s, deadline);
    if (!token.empty()) {
      // Nothing longer than an auth frame is read, and nothing of ours sent, before the peer proved the token.
      std::string why, reply;  // reply: what the peer is told (never the details of our socket)
      if (h.type != wire::FrameType::kAuthHello) {
        why = reply = "authentication required (this endpoint accepts only peers with its auth token)";
      } else {
        try {
          auto payload = oob::recv_payload(s, h, deadline, auth::kMaxPreAuthPayload);
          why = reply = auth::server_handshake(s, token, wire::parse_control(h.type, payload.data(), payload.size()),
                                               deadline);
        } catch (const Error& e) {
          why = std::string("bad auth exchange: ") + e.what();
          reply = "bad handshake (authentication required)";
        }
      }
      if (!why.empty()) {
        refuse_peer(s, auth::kStatusRefused, reply, deadline);
        log::warn("Endpoint::accept: refused the peer at " + from + ": " + why);
        throw Error("Endpoint::accept: refused the peer at " + from + ": " + why, EACCES);
      }
      h = oob::recv_header(s, deadline);
    } else if (h.type == wire::FrameType::kAuthHello) {
      refuse_peer(s, auth::kStatusNoAuth, "this endpoint has no auth token: it does not authenticate peers", deadline);
      throw Error("Endpoint::accept: refused the peer at " + from +
                  ": it authenticates, this endpoint has no auth token (give both sides the same auth_token / "
                  "HIXL_AUTH_TOKEN)", EACCES);
    }
    try {
      auto payload = oob::recv_payload(s, h, deadline);
      peer = parse_hello(h, payload);
    } catch (const Error& e) {
      try { oob::send_all(s, wire::encode_reject(e.what()), deadline); } catch (...) {}
      throw;
    }
    connect(peer);  // RTR before we answer: the client may write as soon as it has our reply
    oob::send_all(s, mine, deadline);
    auto [rh, payload] = oob::recv_frame(s, deadline);
    if (rh.type != wire::FrameType::kReady) throw Error("handshake: expected READY from the client");
  } else {
    if (!token.empty()) auth::client_handshake(s, token, deadline);  // before anything of ours
    oob::send_all(s, mine, deadline);
    auto [h, payload] = oob::recv_frame(s, deadline);
    peer = parse_hello(h, payload);
    connect(peer);
    oob::send_all(s, wire::encode_ready(), deadline);
  }
  return peer;
}

wire::Hello Endpoint::accept(milliseconds timeout) {
  if (!listener_.valid()) throw Error("Endpoint::accept: call listen() first");
  if (closed_) throw Error("Endpoint::accept: endpoint is closed");
  oob::Socket s = oob::accept_tcp(listener_, timeout);
  if (closed_) throw Error("Endpoint::accept: endpoint closed while waiting for a peer");
  if (!s.valid()) throw Error("Endpoint::accept(timeout_ms=" + std::to_string(timeout.count()) + "): no peer connected", ETIMEDOUT);
  return handshake(s, true, timeout);
}

wire::Hello Endpoint::connect_tcp(const std::string& host, uint16_t port, milliseconds timeout) {
  auto start = Clock::now();
  oob::Socket s = oob::connect_tcp(host, port, timeout);
  auto left = timeout - std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  return handshake(s, false, std::max(left, milliseconds(1)));
}

std::pair<uint64_t, std::shared_ptr<verbs::MemoryRegion>> Endpoint::register_memory(void* addr, size_t len,
                                                                                    int access) {
  if (!addr || len == 0)
    throw Error(CallDesc("register_memory").hex("addr", reinterpret_cast<uint64_t>(addr)).arg("len", len).str() +
                ": address must be non-null and length > 0");
  if (closed_) throw Error("register_memory: endpoint is closed");
  auto mr = std::make_shared<verbs::MemoryRegion>(pd_, addr, len, access);
  std::lock_guard<std::mutex> g(reg_mu_);
  uint64_t h = next_handle_++;
  regions_[h] = mr;
  return {h, mr};
}

void Endpoint::deregister_memory(uint64_t handle) {
  std::shared_ptr<verbs::MemoryRegion> mr;
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    auto it = regions_.find(handle);
    if (it == regions_.end()) throw Error("deregister_memory(handle=" + std::to_string(handle) + "): unknown handle");
    mr = std::move(it->second);
    regions_.erase(it);
  }
  // mr goes out of scope here: ibv_dereg_mr runs outside reg_mu_ (it can take a while for big regions).
}

uint32_t Endpoint::lkey_for(uint64_t addr, uint64_t len, bool local_write) const {
  std::lock_guard<std::mutex> g(reg_mu_);
  bool covered = false;
  for (const auto& [h, mr] : regions_) {
    (void)h;
    if (!mr->contains(addr, len)) continue;
    covered = true;
    if (!local_write || (mr->access() & IBV_ACCESS_LOCAL_WRITE)) return mr->lkey();
  }
  if (covered)
    throw Error(CallDesc("lkey lookup").hex("local_addr", addr).arg("len", len).str() +
                ": RDMA READ lands in a local region registered without LOCAL_WRITE");
  throw Error(CallDesc("lkey lookup").hex("local_addr", addr).arg("len", len).str() +
              ": local range is not inside a region registered on this endpoint");
}

void Endpoint::check_usable_locked() const {
  if (closed_) throw Error("endpoint is closed");
  if (!connected_) throw Error("endpoint is not connected");
  if (dead_) throw Error("endpoint is in error state: " + dead_reason_);
}

void Endpoint::post_recvs(uint32_t n) {
  // WRITE_WITH_IMM consumes a receive but no buffer: zero-SGE receives.
  std::vector<ibv_recv_wr> wrs(n);
  for (uint32_t i = 0; i < n; ++i) {
    wrs[i] = ibv_recv_wr{};
    wrs[i].wr_id = i;
    wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
  }
  if (!n) return;
  ibv_recv_wr* bad = nullptr;
  HIXL_CHECK_RET(ibv_post_recv(qp_->get(), &wrs[0], &bad),
                 CallDesc("ibv_post_recv").arg("qpn", qp_->qpn()).arg("count", n).str());
}

void Endpoint::handle_recv_wc(const ibv_wc& wc, std::vector<uint32_t>& out) {
  if (wc.status != IBV_WC_SUCCESS) {
    std::lock_guard<util::Mutex> g(mu_);
    if (closed_) return;
    // A flushed receive only says the queue pair went to error. When a send failed, its completion
    // names why (retries exhausted, the peer refused the request, ...): reap the send CQ first so that
    // the link's reason is that one.
    if (connected_ && wc.status == IBV_WC_WR_FLUSH_ERR) progress_locked(int(sq_depth_));
    mark_dead_locked(std::string("receive completion failed: ") + verbs::wc_to_string(wc) +
                     (wc.status == IBV_WC_WR_FLUSH_ERR
                          ? " (the queue pair went to error; no failed send completion on it names why: on the"
                            " responder side, the peer's request was invalid or not permitted)"
                          : ""));
    return;
  }
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM || (wc.wc_flags & IBV_WC_WITH_IMM)) {
    out.push_back(ntohl(wc.imm_data));
  }
}

std::vector<uint32_t> Endpoint::poll_imm(size_t max) {
  std::vector<uint32_t> out;
  std::lock_guard<std::mutex> g(recv_mu_);
  while (!imm_backlog_.empty() && out.size() < max) {
    out.push_back(imm_backlog_.front());
    imm_backlog_.pop_front();
  }
  if (closed_) return out;
  ibv_wc wc[32];
  while (out.size() < max) {
    int n = recv_cq_->poll(wc, 32);
    if (n == 0) break;
    std::vector<uint32_t> got;
    for (int i = 0; i < n; ++i) handle_recv_wc(wc[i], got);
    if (!dead_) post_recvs(uint32_t(n));  // replenish what was consumed
    imm_received_ += got.size();
    for (uint32_t v : got) {
      if (out.size() < max) out.push_back(v);
      else imm_backlog_.push_back(v);
    }
  }
  return out;
}

std::optional<uint32_t> Endpoint::wait_imm(milliseconds timeout) {
  auto deadline = deadline_after(timeout);
  for (;;) {
    auto v = poll_imm(1);
    if (!v.empty()) return v[0];
    auto now = Clock::now();
    if (now >= deadline || closed_) return std::nullopt;
    auto left = std::chrono::duration_cast<milliseconds>(deadline - now);
    recv_cq_->wait_event(std::clamp(left, milliseconds(1), milliseconds(100)));
  }
}

int Endpoint::imm_fd() const { return recv_ch_->fd(); }

void Endpoint::imm_event() { recv_cq_->wait_event(milliseconds(0)); }

std::string Endpoint::dead_reason() const {
  std::lock_guard<util::Mutex> g(mu_);
  return dead_reason_;
}

Stats Endpoint::stats() const {
  std::lock_guard<util::Mutex> g(mu_);
  Stats s = stats_;
  s.imm_received = imm_received_;
  return s;
}

void Endpoint::close() {
  if (closed_.exchange(true)) return;
  listener_.shutdown();  // wakes a concurrent accept(); the fd itself is closed by the destructor
  if (!qp_) return;
  std::lock_guard<util::Mutex> g(mu_);
  qp_->to_error();  // hardware flushes in-flight work
  // Reap what finished before the flush; the first flushed (or failed) completion ends the drain.
  auto deadline = Clock::now() + milliseconds(500);
  ibv_wc wc[32];
  bool flushed = false;
  while (!inflight_.empty() && !flushed && Clock::now() < deadline) {
    int n = send_cq_->poll(wc, 32);
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) flushed = true;
      else if (wc[i].wr_id > completed_seq_) completed_seq_ = wc[i].wr_id;
    }
    retire_completed_locked();
    if (n == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  fail_all_locked("endpoint closed before the request completed");
}

}  // namespace hixl::rdma
