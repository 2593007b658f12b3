#include "verbs/resources.h"

#include <fcntl.h>
#include <poll.h>

#include <cstring>
#include <sstream>

#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::verbs {

std::string access_to_string(int access) {
  std::string s;
  auto add = [&](int bit, const char* name) {
    if (access & bit) s += (s.empty() ? "" : "|") + std::string(name);
  };
  add(IBV_ACCESS_LOCAL_WRITE, "LOCAL_WRITE");
  add(IBV_ACCESS_REMOTE_WRITE, "REMOTE_WRITE");
  add(IBV_ACCESS_REMOTE_READ, "REMOTE_READ");
  add(IBV_ACCESS_REMOTE_ATOMIC, "REMOTE_ATOMIC");
  return s.empty() ? "0" : s;
}

std::string wc_to_string(const ibv_wc& wc) {
  std::ostringstream os;
  os << ibv_wc_status_str(wc.status) << " (status " << int(wc.status) << ", opcode " << int(wc.opcode)
     << ", vendor_err 0x" << std::hex << wc.vendor_err << std::dec << ", wr_id " << wc.wr_id << ", qp_num "
     << wc.qp_num << ")";
  return os.str();
}

MemoryRegion::MemoryRegion(std::shared_ptr<ProtectionDomain> pd, void* addr, size_t length, int access)
    : pd_(std::move(pd)), mr_(nullptr), access_(access) {
  errno = 0;
  mr_ = ibv_reg_mr(pd_->get(), addr, length, access);
  if (!mr_) {
    int err = errno ? errno : EIO;
    std::ostringstream os;
    os << CallDesc("ibv_reg_mr").hex("address", reinterpret_cast<uint64_t>(addr)).arg("length", length)
              .arg("access", access_to_string(access)).arg("device", pd_->context()->name()).str()
       << " failed: " << errno_str(err);
    if (err == ENOMEM || err == EPERM) os << " (hint: check `ulimit -l` (memlock); pinning needs it unlimited)";
    if (err == EFAULT) os << " (hint: the range is not mapped in this process)";
    throw Error(os.str(), err);
  }
}

MemoryRegion::~MemoryRegion() {
  if (int rc = ibv_dereg_mr(mr_))
    log::warn(CallDesc("ibv_dereg_mr").hex("address", addr()).arg("length", length()).str() +
              " failed: " + errno_str(rc));
}

CompletionChannel::CompletionChannel(std::shared_ptr<Context> ctx)
    : ctx_(std::move(ctx)),
      ch_(HIXL_CHECK_PTR(ibv_create_comp_channel(ctx_->get()),
                         CallDesc("ibv_create_comp_channel").arg("device", ctx_->name()).str())) {
  int flags = fcntl(ch_->fd, F_GETFL);
  if (flags < 0 || fcntl(ch_->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    int err = errno;
    ibv_destroy_comp_channel(ch_);
    throw_errno(CallDesc("fcntl").arg("fd", ch_->fd).arg("flag", "O_NONBLOCK").str(), err);
  }
}

CompletionChannel::~CompletionChannel() {
  if (int rc = ibv_destroy_comp_channel(ch_))
    log::warn("ibv_destroy_comp_channel failed: " + errno_str(rc));
}

CompletionQueue::CompletionQueue(std::shared_ptr<Context> ctx, std::shared_ptr<CompletionChannel> ch, int depth)
    : ctx_(std::move(ctx)), ch_(std::move(ch)), cq_(nullptr) {
  cq_ = HIXL_CHECK_PTR(ibv_create_cq(ctx_->get(), depth, nullptr, ch_ ? ch_->get() : nullptr, 0),
                       CallDesc("ibv_create_cq").arg("device", ctx_->name()).arg("cqe", depth).str());
  if (ch_) {
    try { arm(); } catch (...) { ibv_destroy_cq(cq_); throw; }
  }
}

CompletionQueue::~CompletionQueue() {
  if (unacked_) ibv_ack_cq_events(cq_, unacked_);
  if (int rc = ibv_destroy_cq(cq_)) log::warn("ibv_destroy_cq failed: " + errno_str(rc));
}

int CompletionQueue::poll(ibv_wc* wc, int n) {
  int got = ibv_poll_cq(cq_, n, wc);
  if (got < 0) throw Error(CallDesc("ibv_poll_cq").arg("n", n).str() + " failed (CQ overrun or device error)");
  return got;
}

void CompletionQueue::arm() {
  HIXL_CHECK_RET(ibv_req_notify_cq(cq_, 0), CallDesc("ibv_req_notify_cq").arg("solicited_only", 0).str());
}

bool CompletionQueue::wait_event(std::chrono::milliseconds timeout) {
  if (!ch_) throw Error("CompletionQueue::wait_event: CQ was created without a completion channel");
  pollfd pfd{ch_->fd(), POLLIN, 0};
  int rc = ::poll(&pfd, 1, int(timeout.count() < 0 ? 0 : timeout.count()));
  if (rc < 0) {
    if (errno == EINTR) return false;
    throw_errno(CallDesc("poll").arg("fd", ch_->fd()).arg("timeout_ms", timeout.count()).str(), errno);
  }
  if (rc == 0) return false;
  std::lock_guard<std::mutex> g(event_mu_);
  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  if (ibv_get_cq_event(ch_->get(), &ev_cq, &ev_ctx) != 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return false;  // another waiter took it
    throw_errno("ibv_get_cq_event", errno);
  }
  // Acks are batched (ibv_ack_cq_events takes a mutex); the destructor acks the rest.
  if (++unacked_ >= 64) {
    ibv_ack_cq_events(ev_cq, unacked_);
    unacked_ = 0;
  }
  arm();
  return true;
}

QueuePair::QueuePair(std::shared_ptr<ProtectionDomain> pd, std::shared_ptr<CompletionQueue> send_cq,
                     std::shared_ptr<CompletionQueue> recv_cq, const QpCaps& caps)
    : pd_(std::move(pd)), send_cq_(std::move(send_cq)), recv_cq_(std::move(recv_cq)), qp_(nullptr), caps_(caps) {
  ibv_qp_init_attr init{};
  init.send_cq = send_cq_->get();
  init.recv_cq = recv_cq_->get();
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signaling
  init.cap.max_send_wr = caps.max_send_wr;
  init.cap.max_recv_wr = caps.max_recv_wr;
  init.cap.max_send_sge = caps.max_send_sge;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = caps.max_inline;
  qp_ = HIXL_CHECK_PTR(ibv_create_qp(pd_->get(), &init),
                       CallDesc("ibv_create_qp").arg("type", "RC").arg("max_send_wr", caps.max_send_wr)
                           .arg("max_recv_wr", caps.max_recv_wr).arg("max_inline", caps.max_inline)
                           .arg("device", pd_->context()->name()).str());
  // The provider may round up; record what we really got.
  caps_.max_send_wr = init.cap.max_send_wr;
  caps_.max_recv_wr = init.cap.max_recv_wr;
  caps_.max_inline = init.cap.max_inline_data;
}

QueuePair::~QueuePair() {
  if (int rc = ibv_destroy_qp(qp_))
    log::warn(CallDesc("ibv_destroy_qp").arg("qpn", qp_->qp_num).str() + " failed: " + errno_str(rc));
}

void QueuePair::to_init(uint8_t port, int access) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = port;
  a.qp_access_flags = access;
  HIXL_CHECK_RET(ibv_modify_qp(qp_, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
                 CallDesc("ibv_modify_qp").arg("qpn", qpn()).arg("state", "INIT").arg("port", int(port))
                     .arg("access", access_to_string(access)).str());
}

void QueuePair::to_rtr(const QpRemote& r, const QpPathOptions& p) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = r.mtu;
  a.dest_qp_num = r.qpn;
  a.rq_psn = r.psn;
  a.max_dest_rd_atomic = p.max_rd_atomic;
  a.min_rnr_timer = p.min_rnr_timer;
  a.ah_attr.dlid = r.lid;
  a.ah_attr.sl = p.service_level;
  a.ah_attr.port_num = p.port;
  if (p.use_grh) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, r.gid.data(), 16);
    a.ah_attr.grh.sgid_index = uint8_t(p.gid_index);
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.grh.traffic_class = p.traffic_class;
  }
  int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  HIXL_CHECK_RET(ibv_modify_qp(qp_, &a, mask),
                 CallDesc("ibv_modify_qp").arg("qpn", qpn()).arg("state", "RTR").arg("dest_qpn", r.qpn)
                     .arg("dgid", gid_to_string(r.gid)).arg("dlid", r.lid).arg("path_mtu", mtu_to_bytes(r.mtu))
                     .arg("sgid_index", p.gid_index).arg("port", int(p.port)).str());
}

void QueuePair::to_rts(uint32_t local_psn, const QpPathOptions& p) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = p.timeout;
  a.retry_cnt = p.retry_cnt;
  a.rnr_retry = p.rnr_retry;
  a.sq_psn = local_psn;
  a.max_rd_atomic = p.max_rd_atomic;
  int mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
             IBV_QP_MAX_QP_RD_ATOMIC;
  HIXL_CHECK_RET(ibv_modify_qp(qp_, &a, mask),
                 CallDesc("ibv_modify_qp").arg("qpn", qpn()).arg("state", "RTS").arg("timeout", int(p.timeout))
                     .arg("retry_cnt", int(p.retry_cnt)).arg("rnr_retry", int(p.rnr_retry)).str());
}

void QueuePair::to_error() noexcept {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  if (int rc = ibv_modify_qp(qp_, &a, IBV_QP_STATE))
    log::warn(CallDesc("ibv_modify_qp").arg("qpn", qpn()).arg("state", "ERR").str() + " failed: " + errno_str(rc));
}

ibv_qp_state QueuePair::state() const {
  ibv_qp_attr a{};
  ibv_qp_init_attr i{};
  HIXL_CHECK_RET(ibv_query_qp(qp_, &a, IBV_QP_STATE, &i), CallDesc("ibv_query_qp").arg("qpn", qpn()).str());
  return a.qp_state;
}

}  // namespace hixl::verbs
