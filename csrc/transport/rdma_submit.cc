// rdma::Endpoint's send side (rdma_endpoint.h): posting requests as work requests (slicing, doorbell
// batching, selective signaling, send-queue backpressure), reaping their completions, and waiting for
// them (busy poll, then the send completion channel). Set-up, handshake, registration, receives and
// close() are in rdma_endpoint.cc.
#include <arpa/inet.h>

#include <algorithm>

#include "transport/rdma_endpoint.h"
#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::rdma {

using std::chrono::milliseconds;

void Endpoint::mark_dead_locked(const std::string& why) {
  if (!dead_) {
    dead_reason_ = why;
    dead_ = true;
    log::error(why);
  }
  fail_all_locked(dead_reason_);
}

void Endpoint::fail_all_locked(const std::string& why) {
  for (auto& [seq, id] : inflight_) {
    (void)seq;
    Req* r = reqs_.find(id);
    if (r && r->status == Status::kWaiting) {
      r->status = Status::kFailed;
      r->error = why;
    }
  }
  inflight_.clear();
  completed_seq_ = next_seq_;
  cv_.notify_all();
}

int Endpoint::progress_locked(int budget) {
  ibv_wc wc[32];
  int total = 0;
  while (total < budget) {
    const int want = std::min(32, budget - total);
    int n = send_cq_->poll(wc, want);
    if (n == 0) break;
    total += n;
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        if (dead_) {  // flush after the first failure (its cause is kept), or during teardown
          fail_all_locked(dead_reason_.empty() ? "endpoint closed" : dead_reason_);
          continue;
        }
        std::string why = std::string("work completion failed: ") + verbs::wc_to_string(wc[i]) + " on qpn " +
                          std::to_string(qp_->qpn());
        if (wc[i].status == IBV_WC_RETRY_EXC_ERR)
          why += " (peer unreachable or its QP is gone: did the peer process exit?)";
        else if (wc[i].status == IBV_WC_REM_ACCESS_ERR)
          why += " (remote address/rkey/access not permitted by the peer's memory region)";
        else if (wc[i].status == IBV_WC_LOC_PROT_ERR || wc[i].status == IBV_WC_LOC_LEN_ERR)
          why += " (local buffer not covered by a registered memory region)";
        retire_completed_locked();  // requests finished before the failure stay COMPLETED
        mark_dead_locked(why);
        continue;
      }
      if (wc[i].wr_id > completed_seq_) completed_seq_ = wc[i].wr_id;
    }
    if (n < want) break;  // the CQ was drained: a second, empty poll would only cost time
  }
  retire_completed_locked();
  return total;
}

void Endpoint::retire_completed_locked() {
  bool any = false;
  while (!inflight_.empty() && inflight_.front().first <= completed_seq_) {
    Req* r = reqs_.find(inflight_.front().second);
    if (r && r->status == Status::kWaiting) r->status = Status::kCompleted;
    inflight_.pop_front();
    any = true;
  }
  if (any && cv_waiters_) cv_.notify_all();
}

bool Endpoint::block_locked(std::unique_lock<util::Mutex>& lk, Clock::time_point deadline) {
  // One thread at a time sleeps on the completion channel and reaps what woke it; the others wait
  // on cv_, which every retirement signals. No waiter can miss a completion another thread reaped.
  auto now = Clock::now();
  if (now >= deadline) return false;
  auto slice = std::min<Clock::duration>(deadline - now, milliseconds(100));
  if (channel_waiter_) {
    ++cv_waiters_;
    cv_.wait_for(lk, slice);
    --cv_waiters_;
    return true;
  }
  channel_waiter_ = true;
  lk.unlock();
  try {
    send_cq_->wait_event(std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(slice)));
  } catch (...) {
    lk.lock();
    channel_waiter_ = false;
    throw;
  }
  lk.lock();
  channel_waiter_ = false;
  if (connected_ && !closed_) progress_locked(int(sq_depth_));
  if (cv_waiters_) cv_.notify_all();
  return true;
}

int Endpoint::progress(int budget) {
  std::lock_guard<util::Mutex> g(mu_);
  if (!connected_ || closed_) return 0;
  return progress_locked(budget);
}

uint32_t Endpoint::outstanding() const {
  std::lock_guard<util::Mutex> g(mu_);
  return uint32_t(next_seq_ - completed_seq_);
}

bool Endpoint::wait_for_room_locked(std::unique_lock<util::Mutex>& lk, uint32_t need, Clock::time_point deadline) {
  // Caller holds mu_. Reap completions until `need` slots are free; block between. False on deadline.
  ++stats_.backpressure_waits;
  auto spin_until = Clock::now() + spin_window_locked();  // as wait_done()
  while (sq_depth_ - (next_seq_ - completed_seq_) < need) {
    if (progress_locked(int(sq_depth_)) > 0) {
      note_progress_locked(Clock::now());
      return true;
    }
    if (dead_) return true;
    if (closed_) throw Error("endpoint closed while waiting for send-queue room");
    if (Clock::now() < spin_until) continue;
    if (!block_locked(lk, deadline)) return false;
  }
  return true;
}

uint64_t Endpoint::submit(Op op, const std::vector<Desc>& descs, uint32_t imm, milliseconds timeout) {
  // Validate everything before posting anything. (No heap allocation on the small-request path:
  // this runs once per transfer and shows up directly in the 8 B latency.)
  uint32_t lkey_small[8];
  std::vector<uint32_t> lkey_big;
  uint32_t* lkeys = lkey_small;
  if (descs.size() > 8) {
    lkey_big.resize(descs.size());
    lkeys = lkey_big.data();
  }
  uint64_t total = 0;  // work requests this request needs
  uint64_t bytes = 0;
  uint64_t slice = opts_.slice_bytes;
  for (size_t i = 0; i < descs.size(); ++i) {
    const Desc& d = descs[i];
    if (d.local_addr + d.length < d.local_addr || d.remote_addr + d.length < d.remote_addr)
      throw Error(CallDesc("submit").arg("op", op_name(op)).arg("desc", i).hex("local_addr", d.local_addr)
                      .hex("remote_addr", d.remote_addr).arg("len", d.length).str() + ": range wraps the address space");
    lkeys[i] = !d.length ? 0 : d.has_lkey ? d.lkey : lkey_for(d.local_addr, d.length, op == Op::kRead);
    total += (d.length + slice - 1) / slice;
    bytes += d.length;
  }
  if (opts_.max_slices && total > opts_.max_slices + descs.size()) {  // larger slices (see EndpointOptions)
    const uint64_t even = (bytes + opts_.max_slices - 1) / opts_.max_slices;
    slice = std::min<uint64_t>((even + 4095) & ~uint64_t(4095), max_slice_);  // whole pages: whole packets
    total = 0;
    for (const Desc& d : descs) total += (d.length + slice - 1) / slice;
  }
  const bool pure_flag = op == Op::kWriteImm && total == 0;  // zero-length write-with-imm
  if (pure_flag) total = 1;
  std::unique_lock<util::Mutex> lk(mu_);
  check_usable_locked();
  auto [id, slot] = reqs_.emplace();  // stays valid while mu_ is dropped to wait for room (IdSlab's slots never move)
  if (!id)
    throw Error(CallDesc("submit").arg("op", op_name(op)).arg("outstanding_requests", reqs_.size()).str() +
                ": too many requests not yet collected with status()/wait()", EAGAIN);
  Req& req = *slot;  // filled in place (a reused slot keeps old values)
  req.status = Status::kWaiting;
  req.deadline = deadline_after(timeout);
  req.error.clear();

  if (total == 0) {
    req.status = Status::kCompleted;
    return id;
  }

  // Cursor over the slices: descriptor index and offset inside it (zero-length descriptors skipped).
  size_t cur_d = 0;
  uint64_t cur_off = 0;
  auto skip_empty = [&] { while (cur_d < descs.size() && descs[cur_d].length == 0) ++cur_d; };
  skip_empty();
  uint64_t next = 0;
  while (next < total) {
    if (dead_ || closed_) break;  // failed or closed meanwhile (fail_all_locked freed the "room")
    // Backpressure: wait until a whole chain fits, so doorbells stay batched under load.
    uint32_t want = uint32_t(std::min<uint64_t>(opts_.max_chain, total - next));
    if (sq_depth_ - (next_seq_ - completed_seq_) < want) {
      bool room;
      try {
        room = wait_for_room_locked(lk, want, req.deadline);
      } catch (...) {
        reqs_.erase(id);
        throw;
      }
      if (!room) {  // what was posted stays in flight; the request is reported TIMEOUT
        req.status = Status::kTimeout;
        req.error = "request " + std::to_string(id) + " timed out waiting for send-queue room after posting " +
                    std::to_string(next) + " of " + std::to_string(total) + " work requests";
        return id;
      }
      continue;
    }
    uint32_t room = uint32_t(sq_depth_ - (next_seq_ - completed_seq_));
    uint32_t n = uint32_t(std::min<uint64_t>({uint64_t(room), uint64_t(opts_.max_chain), total - next}));
    for (uint32_t k = 0; k < n; ++k) {
      ibv_send_wr& wr = wrs_[k];
      ibv_sge& sge = sges_[k];
      wr = ibv_send_wr{};
      uint64_t seq = next_seq_ + 1 + k;
      wr.wr_id = seq;
      bool last_of_req = next + k + 1 == total;
      uint64_t len = 0;
      if (!pure_flag) {
        const Desc& d = descs[cur_d];
        len = std::min<uint64_t>(slice, d.length - cur_off);
        sge.addr = d.local_addr + cur_off;
        sge.length = uint32_t(len);
        sge.lkey = lkeys[cur_d];
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.wr.rdma.remote_addr = d.remote_addr + cur_off;
        wr.wr.rdma.rkey = d.rkey;
        cur_off += len;
        if (cur_off == d.length) {
          ++cur_d;
          cur_off = 0;
          skip_empty();
        }
      }
      if (op == Op::kRead) {
        wr.opcode = IBV_WR_RDMA_READ;
      } else if (op == Op::kWriteImm && last_of_req) {
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = htonl(imm);
      } else {
        wr.opcode = IBV_WR_RDMA_WRITE;
      }
      if (op != Op::kRead && len && len <= opts_.max_inline) wr.send_flags |= IBV_SEND_INLINE;
      // Selective signaling: the last WR of the request, of the chain, and every signal_every-th.
      if (last_of_req || k + 1 == n || seq % signal_every_ == 0) {
        wr.send_flags |= IBV_SEND_SIGNALED;
        ++stats_.signaled;
      }
      wr.next = k + 1 < n ? &wrs_[k + 1] : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(qp_->get(), &wrs_[0], &bad);
    if (rc != 0) {
      // Whatever was accepted before `bad` is in flight and will complete; the rest was not posted.
      uint32_t accepted = bad ? uint32_t(bad - &wrs_[0]) : 0;
      std::string why = CallDesc("ibv_post_send").arg("qpn", qp_->qpn()).arg("op", op_name(op)).arg("chain", n)
                            .arg("accepted", accepted).arg("outstanding", next_seq_ - completed_seq_).str() +
                        " failed: " + errno_str(rc);
      next_seq_ += accepted;
      reqs_.erase(id);
      mark_dead_locked(why);
      throw Error(why, rc);
    }
    next_seq_ += n;
    next += n;
    stats_.posted_wrs += n;
    ++stats_.doorbells;
  }
  if (req.status == Status::kWaiting && (dead_ || closed_)) {
    req.status = Status::kFailed;
    req.error = dead_ ? dead_reason_ : "endpoint closed before the request was fully posted";
  }
  if (req.status == Status::kWaiting) inflight_.emplace_back(next_seq_, id);
  return id;
}

bool Endpoint::done_locked(uint64_t id) {
  Req* found = reqs_.find(id);
  if (!found) return true;
  // Completions are reaped in batches: a request an earlier poll retired needs no poll now.
  if (found->status != Status::kWaiting) return true;
  if (connected_ && !closed_) progress_locked(int(sq_depth_));
  Req& r = *found;
  if (r.status == Status::kWaiting && r.deadline != Clock::time_point::max() && Clock::now() >= r.deadline) {
    r.status = Status::kTimeout;
    r.error = "request " + std::to_string(id) + " passed its deadline";
  }
  return r.status != Status::kWaiting;
}

RequestResult Endpoint::status_locked(uint64_t id) {
  if (!done_locked(id)) return {Status::kWaiting, ""};
  Req* r = reqs_.find(id);
  if (!r) return {Status::kFailed, "unknown request " + std::to_string(id)};
  RequestResult out{r->status, std::move(r->error)};
  reqs_.erase(id);
  return out;
}

RequestResult Endpoint::status(uint64_t id) {
  std::lock_guard<util::Mutex> g(mu_);
  return status_locked(id);
}

Clock::duration Endpoint::spin_window_locked() const {
  const Clock::duration floor = std::chrono::microseconds(opts_.busy_poll_us);
  return std::max(floor, std::min<Clock::duration>(4 * gap_, std::chrono::microseconds(kMaxSpinUs)));
}

void Endpoint::note_progress_locked(Clock::time_point now) {
  if (last_progress_ != Clock::time_point{}) {
    auto g = std::min<Clock::duration>(now - last_progress_, std::chrono::microseconds(kMaxSpinUs));
    gap_ = (3 * gap_ + g) / 4;
  }
  last_progress_ = now;
}

bool Endpoint::wait_done(uint64_t id, milliseconds timeout) {
  // Spin while completions keep arriving (a full pipeline: the next one is about a gap away), block
  // on the completion channel once none came for the spin window: busy_poll_us, or 4x the recent
  // gap between completions when that is longer (a slow link or a software device), at most
  // kMaxSpinUs. An idle wait costs at most that much CPU; a streaming one never sleeps.
  auto deadline = deadline_after(timeout);
  std::unique_lock<util::Mutex> lk(mu_);
  auto spin_until = Clock::now() + spin_window_locked();
  uint64_t seen = completed_seq_;
  for (;;) {
    if (done_locked(id)) return true;
    const auto now = Clock::now();
    if (completed_seq_ != seen) {
      seen = completed_seq_;
      note_progress_locked(now);
      spin_until = now + spin_window_locked();
    }
    if (now < spin_until) {  // busy poll: drop the lock so others can post meanwhile
      lk.unlock();
      lk.lock();
      continue;
    }
    if (closed_ || !block_locked(lk, deadline)) return done_locked(id);
  }
}

RequestResult Endpoint::wait(uint64_t id, milliseconds timeout) {
  wait_done(id, timeout);
  return status(id);
}
}  // namespace hixl::rdma
