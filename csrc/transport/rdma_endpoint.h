// One RC connection over libibverbs: registration, one-sided WRITE / READ / WRITE_WITH_IMM,
// doorbell batching, selective signaling, send-queue backpressure, busy and blocking completion.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/oob.h"
#include "util/id_slab.h"
#include "util/mutex.h"
#include "verbs/device.h"
#include "verbs/resources.h"
#include "wire/wire.h"

namespace hixl::rdma {

using Clock = std::chrono::steady_clock;

enum class Op : int { kRead = 0, kWrite = 1, kWriteImm = 2 };
// Values match hixl.TransferStatus.
enum class Status : int { kWaiting = 0, kCompleted = 1, kTimeout = 2, kFailed = 3 };

const char* op_name(Op op);
// A deadline `timeout` after `now` (or from now); negative = never. Clamped so huge values cannot
// overflow the clock. Without a timeout the clock is not read.
Clock::time_point deadline_after(Clock::time_point now, std::chrono::milliseconds timeout);
Clock::time_point deadline_after(std::chrono::milliseconds timeout);

struct EndpointOptions {
  std::string device;          // "" -> $HIXL_DEVICE -> first device with an ACTIVE port
  uint8_t port = 1;
  int gid_index = -1;          // -1 -> $HIXL_GID_INDEX -> RoCEv2 IPv4-mapped
  uint32_t sq_depth = 256;
  uint32_t rq_depth = 256;
  uint32_t max_inline = 64;    // small writes go inline (falls back to 0 if the device refuses)
  uint64_t slice_bytes = 4u << 20;  // larger descriptors are sliced into several work requests
  // 0: slice_bytes is a fixed cap. n: a request whose bytes would take more than n slices gets larger
  // ones, bytes / n (so it takes at most n work requests plus one per descriptor, and a big request does
  // not fill the send queue and block its submitter on backpressure).
  uint32_t max_slices = 0;
  // 0: a queue pair has as many work requests in flight as its send queue holds. n: at most n bytes of
  // work requests posted and not yet completed (at least one work request), so that a lost packet makes
  // the device resend fewer after it (go-back-N). What does not fit waits in the endpoint, in order,
  // and is posted as completions free the window: by whoever polls (progress(), status(), a waiter),
  // and by a driver that calls send_event() when send_fd() is readable while has_pending() (RdmaPath's
  // thread). submit() then never waits for send-queue room; max_slices is not applied.
  uint64_t window_bytes = 0;
  uint32_t max_chain = 64;     // work requests per ibv_post_send (one doorbell)
  uint32_t busy_poll_us = 20;  // spin at least this long without a completion before blocking on the channel
  uint8_t traffic_class = 0;
  uint8_t service_level = 0;
  uint8_t timeout = 14;
  uint8_t retry_cnt = 7;
  // Shared secret of the out-of-band handshake (listen/accept/connect_tcp), as the engine's
  // HixlAuthToken (auth/handshake.h): "" = none. With one, nothing of ours (QPN, GID, regions, rkeys)
  // is sent before the peer proved it knows the token, and a peer that cannot is refused.
  std::string auth_token;
};

struct Desc {
  uint64_t local_addr = 0;
  uint64_t remote_addr = 0;
  uint64_t length = 0;
  uint32_t rkey = 0;
  uint32_t lkey = 0;       // used when has_lkey: the caller registered the memory (e.g. the engine)
  bool has_lkey = false;   // else the lkey is looked up among this endpoint's own registrations
};

struct LocalInfo {
  wire::Hello hello;  // qpn, psn, lid, gid, mtu (active MTU of the port), port, regions
  std::string device;
  int gid_index = 0;
  uint8_t link_layer = 0;
};

// A request's status, and why it failed. Handed up through the endpoint, the data path and the
// engine's request table for every request: moving a std::string copies its inline buffer with a call
// to memcpy even when it is empty (~200 instructions per request over those moves), so a move here
// touches the string only when there is an error to carry.
struct RequestResult {
  Status status = Status::kFailed;
  std::string error;

  RequestResult() = default;
  explicit RequestResult(Status s) : status(s) {}
  RequestResult(Status s, const std::string& e) : status(s), error(e) {}
  RequestResult(Status s, std::string&& e) : status(s) {  // {status, std::move(why)}: moved only if any
    if (!e.empty()) error = std::move(e);
  }
  RequestResult(const RequestResult&) = default;
  RequestResult& operator=(const RequestResult&) = default;
  RequestResult(RequestResult&& o) noexcept : status(o.status) {
    if (!o.error.empty()) error = std::move(o.error);
  }
  RequestResult& operator=(RequestResult&& o) noexcept {
    if (this == &o) return *this;
    status = o.status;
    if (!o.error.empty()) error = std::move(o.error);
    else error.clear();
    return *this;
  }
};

struct Stats {
  uint64_t posted_wrs = 0;
  uint64_t doorbells = 0;
  uint64_t signaled = 0;
  uint64_t backpressure_waits = 0;
  uint64_t imm_received = 0;
};

class Endpoint {
 public:
  explicit Endpoint(const EndpointOptions& opts = {});
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  LocalInfo local_info() const;
  const EndpointOptions& options() const { return opts_; }
  bool connected() const { return connected_; }
  int path_mtu() const { return path_mtu_; }  // bytes; 0 before connect()
  std::optional<wire::Hello> remote() const;

  // INIT -> (receives posted) -> RTR -> RTS against the peer's plain info. Path MTU = min(local, remote).
  void connect(const wire::Hello& remote);

  // Out-of-band TCP handshake (exchanges QP info and region lists, then a READY frame), after the
  // auth exchange when options().auth_token is set. A refused or failed accept() leaves the endpoint
  // unconnected and listening: accept() may be called again.
  uint16_t listen(const std::string& host, uint16_t port);
  wire::Hello accept(std::chrono::milliseconds timeout);
  wire::Hello connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);

  // Memory registration. Returns a handle (> 0). Access: verbs flags.
  std::pair<uint64_t, std::shared_ptr<verbs::MemoryRegion>> register_memory(void* addr, size_t len, int access);
  void deregister_memory(uint64_t handle);

  // Posts descs as one request; blocks only for send-queue room (never fails with "queue full"), and
  // with a send window (EndpointOptions::window_bytes) not even for that: the rest waits in the endpoint.
  // imm is used for kWriteImm (carried by the last work request). timeout < 0: no deadline.
  uint64_t submit(Op op, const std::vector<Desc>& descs, uint32_t imm = 0,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(-1));
  // Non-blocking status. A terminal status is returned once, then the request is forgotten;
  // an unknown request reports kFailed.
  RequestResult status(uint64_t req);
  // Waits for a terminal status up to timeout (busy poll, then the completion channel).
  // On timeout returns kWaiting and keeps the request.
  RequestResult wait(uint64_t req, std::chrono::milliseconds timeout);
  // Like wait(), but leaves the terminal status to be collected by status(): true once it is there
  // (or the request is unknown), false when the timeout passed first.
  bool wait_done(uint64_t req, std::chrono::milliseconds timeout);
  // Polls the send CQ up to budget completions; returns how many were reaped.
  int progress(int budget = 64);

  // Immediates from the peer's WRITE_WITH_IMM (receives are replenished automatically).
  std::vector<uint32_t> poll_imm(size_t max);
  std::optional<uint32_t> wait_imm(std::chrono::milliseconds timeout);
  // The send window's driver (EndpointOptions::window_bytes): while has_pending(), a thread that waits
  // on send_fd() (the send completion channel) calls send_event() once it is readable; it consumes the
  // event, reaps completions and posts what now fits. False when a waiter holds the channel (it does
  // the same): try again shortly.
  bool has_pending() const { return has_pending_; }
  int send_fd() const;
  bool send_event();
  // For one thread that waits on several endpoints' immediates at once (RdmaPath): the receive
  // completion channel's fd, readable when an immediate may have come; once it is, imm_event()
  // consumes the event and re-arms the CQ, then poll_imm() collects what came.
  int imm_fd() const;
  void imm_event();

  bool dead() const { return dead_; }
  bool closed() const { return closed_; }
  std::string dead_reason() const;
  Stats stats() const;
  uint32_t sq_depth() const { return sq_depth_; }
  uint32_t outstanding() const;
  // QP -> ERR, drain with a deadline. Idempotent. Later calls fail with a clear error.
  void close();

 private:
  struct Req {
    Status status = Status::kWaiting;  // its last work request's sequence lives in inflight_
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
    std::string error;
    void on_erase() { error.clear(); }  // IdSlab::erase
  };

  void check_usable_locked() const;
  uint32_t lkey_for(uint64_t addr, uint64_t len, bool local_write) const;
  int progress_locked(int budget);
  void retire_completed_locked();
  void mark_dead_locked(const std::string& why);
  RequestResult status_locked(uint64_t req);
  bool done_locked(uint64_t req);  // terminal (or unknown) without consuming it
  // Sleeps (mu_ released) until completions may have moved or the deadline; false once it passed.
  bool block_locked(std::unique_lock<util::Mutex>& lk, std::chrono::steady_clock::time_point deadline);
  void fail_all_locked(const std::string& why);
  void post_recvs(uint32_t n);
  void handle_recv_wc(const ibv_wc& wc, std::vector<uint32_t>& out);
  wire::Hello handshake(oob::Socket& s, bool server, std::chrono::milliseconds timeout);
  // How long a waiter spins without seeing a completion before it blocks (wait_done()).
  Clock::duration spin_window_locked() const;
  void note_progress_locked(Clock::time_point now);  // a waiter saw completions arrive at `now`
  bool wait_for_room_locked(std::unique_lock<util::Mutex>& lk, uint32_t need,
                            std::chrono::steady_clock::time_point deadline);

  // Where posting one request stands: its descriptors, the next slice, its work requests posted so far.
  struct Cursor {
    uint64_t id = 0;
    Op op = Op::kWrite;
    uint32_t imm = 0;
    bool pure_flag = false;  // a zero-length WRITE_WITH_IMM: one work request without bytes
    const Desc* descs = nullptr;
    const uint32_t* lkeys = nullptr;
    size_t n_descs = 0;
    uint64_t slice = 0;
    uint64_t total = 0, next = 0;  // work requests: all, posted
    size_t cur_d = 0;              // descriptor and offset of the next slice (empty descriptors skipped)
    uint64_t cur_off = 0;
    void skip_empty() { while (cur_d < n_descs && descs[cur_d].length == 0) ++cur_d; }
  };
  // A request not yet fully posted because the send window (or queue) is full: owns a copy of what is left.
  struct Pending {
    Cursor c;
    std::vector<Desc> descs;
    std::vector<uint32_t> lkeys;
  };
  // How many work requests may go now: send-queue room, and the window (0 when full), at most max_chain.
  uint32_t room_locked() const;
  // Posts up to n work requests of c in one doorbell (fewer where the send window fills). 0, or
  // ibv_post_send's error with *why describing it: the caller marks the endpoint dead.
  int post_chain_locked(Cursor& c, uint32_t n, std::string* why);
  // Posts pending requests, in order, while the window and the send queue have room.
  void pump_locked();
  void queue_rest_locked(const Cursor& c);
  // What an error adds for a request that ended while part of it still waited for the send window.
  static std::string pending_note(const Cursor& c);
  // submit()'s steps, defined inline in rdma_submit.cc so that the request path stays one function:
  // plan_request checks the ranges (no lock), finds each descriptor's lkey (into lkeys) and returns
  // how many work requests the request needs, *slice their size; open_request_locked puts a waiting
  // request with its deadline in reqs_; then one of the two posts it: post_in_window_locked (a send
  // window: what fits now, the rest kept for the pump) or post_with_backpressure_locked (all of it,
  // waiting for send-queue room; TIMEOUT when the deadline passes first). Always inlined: as one
  // function the compiler keeps the request in registers, and no call is added per request.
  [[gnu::always_inline]] inline uint64_t plan_request(Op op, const std::vector<Desc>& descs, uint32_t* lkeys,
                                                     uint64_t* slice) const;
  [[gnu::always_inline]] inline std::pair<uint64_t, Req*> open_request_locked(Op op,
                                                                               std::chrono::milliseconds timeout);
  [[gnu::always_inline]] inline void post_in_window_locked(Cursor& c);
  [[gnu::always_inline]] inline void post_with_backpressure_locked(std::unique_lock<util::Mutex>& lk, Cursor& c,
                                                                   Req& req);

  EndpointOptions opts_;
  // Declaration order = reverse teardown order: PD (holding the context) first, QP last.
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  std::shared_ptr<verbs::CompletionChannel> send_ch_, recv_ch_;
  std::shared_ptr<verbs::CompletionQueue> send_cq_, recv_cq_;
  mutable std::mutex reg_mu_;
  std::map<uint64_t, std::shared_ptr<verbs::MemoryRegion>> regions_;  // handle -> MR
  uint64_t next_handle_ = 1;
  std::unique_ptr<verbs::QueuePair> qp_;

  verbs::PortInfo port_info_;
  uint64_t max_slice_ = 1ull << 30;  // the most one work request may carry (ibv_sge.length, max_msg_sz)
  verbs::Gid gid_{};
  int gid_index_ = 0;
  uint32_t psn_ = 0;
  uint32_t sq_depth_ = 0;
  uint32_t signal_every_ = 0;
  std::atomic<int> path_mtu_{0};
  std::atomic<bool> connected_{false};
  std::atomic<bool> dead_{false};
  std::atomic<bool> closed_{false};
  std::optional<wire::Hello> remote_;
  oob::Socket listener_;

  mutable util::Mutex mu_;  // send side: sequence numbers, requests, send-CQ polling
  std::condition_variable_any cv_;  // signaled whenever requests retire or fail, when someone waits on it
  uint32_t cv_waiters_ = 0;         // threads in cv_.wait_for (mu_): a retirement with none skips the notify
  bool channel_waiter_ = false;  // one thread at a time sleeps on the send completion channel
  static constexpr int kMaxSpinUs = 200;   // the longest spin window, and the longest gap counted
  Clock::time_point last_progress_{};      // when a waiter last saw completions arrive
  Clock::duration gap_{};                  // moving average of the time between those
  uint64_t next_seq_ = 0;       // last sequence handed out
  uint64_t completed_seq_ = 0;  // every WR up to this one has completed
  util::IdSlab<Req> reqs_;  // no allocation per request (util/id_slab.h)
  std::deque<std::pair<uint64_t, uint64_t>> inflight_;  // (last_seq, req), in SQ order
  // Send window (opts_.window_bytes > 0): bytes posted and bytes completed, and the running total of
  // posted bytes after each work request in flight (indexed by sequence % sq_depth_).
  uint64_t posted_bytes_ = 0, acked_bytes_ = 0;
  std::vector<uint64_t> posted_at_;
  std::deque<Pending> pending_;            // in submission order
  std::atomic<bool> has_pending_{false};   // !pending_.empty(), for a driver that reads it without mu_
  std::string dead_reason_;
  Stats stats_;
  std::vector<ibv_send_wr> wrs_;
  std::vector<ibv_sge> sges_;

  std::atomic<uint64_t> imm_received_{0};
  std::mutex recv_mu_;
  std::deque<uint32_t> imm_backlog_;
};

}  // namespace hixl::rdma
