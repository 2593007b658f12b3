// RAII owners for memory regions, completion channels, completion queues and RC queue pairs.
// Each keeps its parent alive with a shared_ptr; an owner that holds several (the RDMA endpoint)
// declares them so that destruction runs QP -> MR -> CQ -> channel -> PD -> context.
#pragma once

#include <infiniband/verbs.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "verbs/device.h"

namespace hixl::verbs {

std::string access_to_string(int access);
std::string wc_to_string(const ibv_wc& wc);  // status string, numeric status, opcode, vendor_err, wr_id, qp

class MemoryRegion {
 public:
  MemoryRegion(std::shared_ptr<ProtectionDomain> pd, void* addr, size_t length, int access);
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  ibv_mr* get() const { return mr_; }
  uint64_t addr() const { return reinterpret_cast<uint64_t>(mr_->addr); }
  size_t length() const { return mr_->length; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }
  int access() const { return access_; }
  bool contains(uint64_t a, uint64_t len) const { return a >= addr() && len <= length() && a - addr() <= length() - len; }

 private:
  std::shared_ptr<ProtectionDomain> pd_;
  ibv_mr* mr_;
  int access_;
};

class CompletionChannel {
 public:
  explicit CompletionChannel(std::shared_ptr<Context> ctx);  // fd set O_NONBLOCK
  ~CompletionChannel();
  CompletionChannel(const CompletionChannel&) = delete;
  CompletionChannel& operator=(const CompletionChannel&) = delete;
  ibv_comp_channel* get() const { return ch_; }
  int fd() const { return ch_->fd; }

 private:
  std::shared_ptr<Context> ctx_;
  ibv_comp_channel* ch_;
};

class CompletionQueue {
 public:
  CompletionQueue(std::shared_ptr<Context> ctx, std::shared_ptr<CompletionChannel> ch, int depth);
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;
  ibv_cq* get() const { return cq_; }
  int depth() const { return cq_->cqe; }

  // Non-blocking: up to n completions into wc; returns the count.
  int poll(ibv_wc* wc, int n);
  // Arms the CQ for the next completion event (ibv_req_notify_cq).
  void arm();
  // Blocks on the channel fd up to timeout (poll(2)); consumes and acks an event if one arrived and
  // re-arms. Returns true when an event was consumed. Safe to call from several threads.
  bool wait_event(std::chrono::milliseconds timeout);

 private:
  std::shared_ptr<Context> ctx_;
  std::shared_ptr<CompletionChannel> ch_;
  ibv_cq* cq_;
  std::mutex event_mu_;  // guards ibv_get_cq_event / ack bookkeeping
  unsigned unacked_ = 0;
};

struct QpCaps {
  uint32_t max_send_wr = 256;
  uint32_t max_recv_wr = 256;
  uint32_t max_send_sge = 1;
  uint32_t max_inline = 0;
};

struct QpRemote {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  Gid gid{};
  ibv_mtu mtu = IBV_MTU_1024;
};

struct QpPathOptions {
  uint8_t port = 1;
  int gid_index = 0;
  bool use_grh = true;      // RoCE needs a GRH; IB may go LID-only
  uint8_t traffic_class = 0;
  uint8_t service_level = 0;
  uint8_t timeout = 14;     // 4.096 us * 2^14 ~ 67 ms per retry
  uint8_t retry_cnt = 7;
  uint8_t rnr_retry = 7;    // 7 = retry forever: receives are replenished automatically
  uint8_t min_rnr_timer = 12;
  uint8_t max_rd_atomic = 16;
};

class QueuePair {
 public:
  QueuePair(std::shared_ptr<ProtectionDomain> pd, std::shared_ptr<CompletionQueue> send_cq,
            std::shared_ptr<CompletionQueue> recv_cq, const QpCaps& caps);
  ~QueuePair();
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;
  ibv_qp* get() const { return qp_; }
  uint32_t qpn() const { return qp_->qp_num; }
  const QpCaps& caps() const { return caps_; }

  void to_init(uint8_t port, int access);
  void to_rtr(const QpRemote& remote, const QpPathOptions& path);
  void to_rts(uint32_t local_psn, const QpPathOptions& path);
  void to_error() noexcept;  // flushes outstanding work; best effort
  ibv_qp_state state() const;

 private:
  std::shared_ptr<ProtectionDomain> pd_;
  std::shared_ptr<CompletionQueue> send_cq_, recv_cq_;
  ibv_qp* qp_;
  QpCaps caps_;
};

}  // namespace hixl::verbs
