// rdma::Endpoint's send side (rdma_endpoint.h): posting requests as work requests (slicing, doorbell
// batching, selective signaling, send-queue backpressure, the send window), reaping their completions,
// and waiting for them (busy poll, then the send completion channel). Set-up, handshake, registration,
// receives and close() are in rdma_endpoint.cc.
#include <arpa/inet.h>

#include <algorithm>

#include "transport/rdma_endpoint.h"
#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::rdma {

using std::chrono::milliseconds;

std::string Endpoint::pending_note(const Cursor& c) {
  return " with " + std::to_string(c.next) + " of " + std::to_string(c.total) +
         " work requests posted (the rest waited for the send window)";
}

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
  for (Pending& p : pending_) {
    Req* r = reqs_.find(p.c.id);
    if (r && r->status == Status::kWaiting) {
      r->status = Status::kFailed;
      r->error = why + pending_note(p.c);
    }
  }
  pending_.clear();
  has_pending_ = false;
  completed_seq_ = next_seq_;
  acked_bytes_ = posted_bytes_;
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
  if (opts_.window_bytes) {
    if (completed_seq_ && !dead_) acked_bytes_ = posted_at_[completed_seq_ % sq_depth_];
    if (!pending_.empty()) pump_locked();
  }
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

uint32_t Endpoint::room_locked() const {
  if (opts_.window_bytes && posted_bytes_ - acked_bytes_ >= opts_.window_bytes) return 0;
  return uint32_t(std::min<uint64_t>(sq_depth_ - (next_seq_ - completed_seq_), opts_.max_chain));
}

int Endpoint::post_chain_locked(Cursor& c, uint32_t n, std::string* why) {
  // Caller made sure n work requests fit the send queue. With a send window the chain ends early, at
  // the work request that fills it.
  n = uint32_t(std::min<uint64_t>(n, c.total - c.next));
  const uint64_t window = opts_.window_bytes;
  const uint64_t quarter = window ? std::max<uint64_t>(1, window / 4) : 0;
  uint64_t bytes = posted_bytes_;  // posted so far, counting this chain's work requests
  uint32_t k = 0;
  while (k < n) {
    ibv_send_wr& wr = wrs_[k];
    ibv_sge& sge = sges_[k];
    wr = ibv_send_wr{};
    const uint64_t seq = next_seq_ + 1 + k;
    wr.wr_id = seq;
    const bool last_of_req = c.next + k + 1 == c.total;
    uint64_t len = 0;
    if (!c.pure_flag) {
      const Desc& d = c.descs[c.cur_d];
      len = std::min<uint64_t>(c.slice, d.length - c.cur_off);
      sge.addr = d.local_addr + c.cur_off;
      sge.length = uint32_t(len);
      sge.lkey = c.lkeys[c.cur_d];
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.wr.rdma.remote_addr = d.remote_addr + c.cur_off;
      wr.wr.rdma.rkey = d.rkey;
      c.cur_off += len;
      if (c.cur_off == d.length) {
        ++c.cur_d;
        c.cur_off = 0;
        c.skip_empty();
      }
    }
    if (c.op == Op::kRead) {
      wr.opcode = IBV_WR_RDMA_READ;
    } else if (c.op == Op::kWriteImm && last_of_req) {
      wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr.imm_data = htonl(c.imm);
    } else {
      wr.opcode = IBV_WR_RDMA_WRITE;
    }
    if (c.op != Op::kRead && len && len <= opts_.max_inline) wr.send_flags |= IBV_SEND_INLINE;
    bool end = k + 1 == n;
    // Selective signaling: the last WR of the request, of the chain, and every signal_every-th; with a
    // window also each one that crosses a quarter of it, so that room comes back while the rest flies.
    bool signal = last_of_req || seq % signal_every_ == 0;
    if (window) {
      signal = signal || bytes / quarter != (bytes + len) / quarter;
      bytes += len;
      posted_at_[seq % sq_depth_] = bytes;
      if (bytes - acked_bytes_ >= window) end = true;
    }
    if (signal || end) {
      wr.send_flags |= IBV_SEND_SIGNALED;
      ++stats_.signaled;
    }
    wr.next = end ? nullptr : &wrs_[k + 1];
    ++k;
    if (end) break;
  }
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qp_->get(), &wrs_[0], &bad);
  if (rc != 0) {
    // Whatever was accepted before `bad` is in flight and will complete; the rest was not posted.
    const uint32_t accepted = bad ? uint32_t(bad - &wrs_[0]) : 0;
    *why = CallDesc("ibv_post_send").arg("qpn", qp_->qpn()).arg("op", op_name(c.op)).arg("chain", k)
               .arg("accepted", accepted).arg("outstanding", next_seq_ - completed_seq_).str() +
           " failed: " + errno_str(rc);
    next_seq_ += accepted;
    if (window) posted_bytes_ = accepted ? posted_at_[next_seq_ % sq_depth_] : posted_bytes_;
    return rc;
  }
  next_seq_ += k;
  c.next += k;
  if (window) posted_bytes_ = bytes;
  stats_.posted_wrs += k;
  ++stats_.doorbells;
  return 0;
}

void Endpoint::queue_rest_locked(const Cursor& c) {
  // Keeps what is not posted yet: the descriptors from the current one on (the cursor's offset into it stays).
  Pending& p = pending_.emplace_back();
  p.c = c;
  if (c.n_descs) {
    p.descs.assign(c.descs + c.cur_d, c.descs + c.n_descs);
    p.lkeys.assign(c.lkeys + c.cur_d, c.lkeys + c.n_descs);
  }
  p.c.descs = p.descs.data();
  p.c.lkeys = p.lkeys.data();
  p.c.n_descs = p.descs.size();
  p.c.cur_d = 0;
  has_pending_ = true;
}

void Endpoint::pump_locked() {
  Clock::time_point now{};
  while (!pending_.empty() && !dead_ && !closed_) {
    Pending& p = pending_.front();
    Req* r = reqs_.find(p.c.id);
    if (r && r->status == Status::kWaiting && r->deadline != Clock::time_point::max()) {
      if (now == Clock::time_point{}) now = Clock::now();
      if (now >= r->deadline) {
        r->status = Status::kTimeout;
        r->error = "request " + std::to_string(p.c.id) + " passed its deadline" + pending_note(p.c);
      }
    }
    if (!r || r->status != Status::kWaiting) {  // timed out: what was posted flies on, the rest is dropped
      pending_.pop_front();
      continue;
    }
    const uint32_t n = room_locked();
    if (!n) break;
    std::string why;
    if (post_chain_locked(p.c, n, &why) != 0) {
      mark_dead_locked(why);  // fails every request, the pending ones too
      return;
    }
    if (p.c.next == p.c.total) {
      inflight_.emplace_back(next_seq_, p.c.id);
      pending_.pop_front();
    }
  }
  has_pending_ = !pending_.empty();
}

int Endpoint::send_fd() const { return send_ch_->fd(); }

bool Endpoint::send_event() {
  std::lock_guard<util::Mutex> g(mu_);
  if (channel_waiter_) return false;  // a waiter sleeps on the channel: it takes the event and pumps
  if (closed_) return true;
  send_cq_->wait_event(milliseconds(0));  // takes the event if it is still there, and re-arms the CQ
  if (connected_) progress_locked(int(sq_depth_));
  return true;
}

inline uint64_t Endpoint::plan_request(Op op, const std::vector<Desc>& descs, uint32_t* lkeys,
                                       uint64_t* slice_out) const {
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
  if (!opts_.window_bytes && opts_.max_slices && total > opts_.max_slices + descs.size()) {  // see EndpointOptions
    const uint64_t even = (bytes + opts_.max_slices - 1) / opts_.max_slices;
    slice = std::min<uint64_t>((even + 4095) & ~uint64_t(4095), max_slice_);  // whole pages: whole packets
    total = 0;
    for (const Desc& d : descs) total += (d.length + slice - 1) / slice;
  }
  *slice_out = slice;
  return total;
}

inline std::pair<uint64_t, Endpoint::Req*> Endpoint::open_request_locked(Op op, milliseconds timeout) {
  check_usable_locked();
  auto [id, slot] = reqs_.emplace();  // stays valid while mu_ is dropped to wait for room (IdSlab's slots never move)
  if (!id)
    throw Error(CallDesc("submit").arg("op", op_name(op)).arg("outstanding_requests", reqs_.size()).str() +
                ": too many requests not yet collected with status()/wait()", EAGAIN);
  Req& req = *slot;  // filled in place (a reused slot keeps old values)
  req.status = Status::kWaiting;
  req.deadline = deadline_after(timeout);
  req.error.clear();
  return {id, slot};
}

inline void Endpoint::post_in_window_locked(Cursor& c) {
  // Posts what the window holds now, behind what already waits for it, and keeps the rest for the pump.
  std::string why;
  if (pending_.empty()) {
    while (c.next < c.total) {
      const uint32_t n = room_locked();
      if (!n) break;
      if (int rc = post_chain_locked(c, n, &why)) {
        reqs_.erase(c.id);
        mark_dead_locked(why);
        throw Error(why, rc);
      }
    }
  }
  if (c.next < c.total) queue_rest_locked(c);
  else inflight_.emplace_back(next_seq_, c.id);
}

inline void Endpoint::post_with_backpressure_locked(std::unique_lock<util::Mutex>& lk, Cursor& c, Req& req) {
  std::string why;
  while (c.next < c.total) {
    if (dead_ || closed_) break;  // failed or closed meanwhile (fail_all_locked freed the "room")
    // Backpressure: wait until a whole chain fits, so doorbells stay batched under load.
    const uint32_t want = uint32_t(std::min<uint64_t>(opts_.max_chain, c.total - c.next));
    if (sq_depth_ - (next_seq_ - completed_seq_) < want) {
      bool room;
      try {
        room = wait_for_room_locked(lk, want, req.deadline);
      } catch (...) {
        reqs_.erase(c.id);
        throw;
      }
      if (!room) {  // what was posted stays in flight; the request is reported TIMEOUT
        req.status = Status::kTimeout;
        req.error = "request " + std::to_string(c.id) + " timed out waiting for send-queue room after posting " +
                    std::to_string(c.next) + " of " + std::to_string(c.total) + " work requests";
        return;
      }
      continue;
    }
    if (int rc = post_chain_locked(c, room_locked(), &why)) {
      reqs_.erase(c.id);
      mark_dead_locked(why);
      throw Error(why, rc);
    }
  }
  if (req.status == Status::kWaiting && (dead_ || closed_)) {
    req.status = Status::kFailed;
    req.error = dead_ ? dead_reason_ : "endpoint closed before the request was fully posted";
  }
  if (req.status == Status::kWaiting) inflight_.emplace_back(next_seq_, c.id);
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
  uint64_t slice;
  uint64_t total = plan_request(op, descs, lkeys, &slice);
  const bool pure_flag = op == Op::kWriteImm && total == 0;  // zero-length write-with-imm
  if (pure_flag) total = 1;
  std::unique_lock<util::Mutex> lk(mu_);
  auto [id, slot] = open_request_locked(op, timeout);
  Req& req = *slot;

  if (total == 0) {
    req.status = Status::kCompleted;
    return id;
  }

  Cursor c;
  c.id = id;
  c.op = op;
  c.imm = imm;
  c.pure_flag = pure_flag;
  c.descs = descs.data();
  c.lkeys = lkeys;
  c.n_descs = descs.size();
  c.slice = slice;
  c.total = total;
  c.skip_empty();
  if (opts_.window_bytes) post_in_window_locked(c);
  else post_with_backpressure_locked(lk, c, req);
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
    // Still waiting for the send window: what was posted flies on, the rest is dropped.
    auto it = std::find_if(pending_.begin(), pending_.end(), [id](const Pending& p) { return p.c.id == id; });
    if (it != pending_.end()) {
      r.error += pending_note(it->c);
      pending_.erase(it);
      has_pending_ = !pending_.empty();
    }
  }
  return r.status != Status::kWaiting;
}

RequestResult Endpoint::status_locked(uint64_t id) {
  if (!done_locked(id)) return RequestResult(Status::kWaiting);
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
  std::unique_lock<util::Mutex> lk(mu_);
  // In a windowed stream the request waited for has mostly ended already: no clock read for that. A
  // clock_gettime the vDSO cannot serve (an HPET clocksource, as in the rxe VM) is a syscall, ~0.7 us.
  uint64_t seen = completed_seq_;
  if (done_locked(id)) return true;
  auto now = Clock::now();
  const auto deadline = deadline_after(now, timeout);
  auto spin_until = now + spin_window_locked();
  for (;;) {
    if (completed_seq_ != seen) {
      seen = completed_seq_;
      note_progress_locked(now);
      spin_until = now + spin_window_locked();
    }
    if (now < spin_until) {  // busy poll: drop the lock so others can post meanwhile
      lk.unlock();
      lk.lock();
    } else if (closed_ || !block_locked(lk, deadline)) {
      return done_locked(id);
    }
    if (done_locked(id)) return true;
    now = Clock::now();
  }
}

RequestResult Endpoint::wait(uint64_t id, milliseconds timeout) {
  wait_done(id, timeout);
  return status(id);
}
}  // namespace hixl::rdma
