// hixl engine: the CANN-hixl-compatible transfer engine behind hixl.Hixl.
//
// The Engine is a facade over parts, each in its own files, each owning its state and its lock:
//
//   part (file)                  holds                                                lock
//   Registry (registry.h)        local regions, MRs, memfds, the range table,          mu_ (leaf) (+ uses_cv_)
//                                the version, the tcp requests being served
//   LinkTable (link_table.h)     links by peer, handshake claims, closed records       mu_
//   Link (link.h)                one peer: control connection + reader, data path,    mu (state)
//                                the peer's regions, replies awaited
//   ControlOut (control_out.h)   a link's frames out: one queue, written in order     mu_ (leaf)
//   Handshakes (handshakes.h)    sockets in a handshake, limits on incoming ones       mu_ (leaf)
//   Requests (requests.h)        async transfers, deadlines, expiry                    mu_ (+ cv_)
//   Inbox (inbox.h)              notifies, completion flags and their eventfd          notify_mu_, flag_mu_ (leaves)
//   DescLists (desc_lists.h)     prepared descriptor lists (blocks resolved once)      mu_ (leaf); each list's mu
//   Metrics (metrics.h)          counters of transfers, links closed, notifies, refusals  none (atomics)
//   Engine (this file)           lifecycle: state, options, name, threads, workers     mu_, workers_mu_, push_mu_
//
// The engine's own files split its work by concern: engine.cc (lifecycle, registration, queries),
// connector.cc (connect, accept, handshakes, disconnect; building a link's data path), transfers.cc
// (transfers, their status, notifies out), control.cc (the progress thread reading control frames,
// the watchdog: heartbeat and request expiry; region pushes).
//
// Lock order: a thread holding a lock on the left may take the one on its right, never the reverse;
// the locks not listed on a left side are leaves (nothing else is taken while they are held).
//   Engine::mu_        -> LinkTable::mu_, Handshakes::mu_ (finalize closes both with the state)
//   Engine::push_mu_   -> Registry::mu_, ControlOut::mu_ of the links the regions are queued on
//   Requests::mu_      -> Link::mu (and the data path's own lock: status, wait_done(0))
//   DescList::mu of a local list -> DescList::mu of a remote list -> Registry::mu_, Link::mu
//                         (a prepared transfer re-resolving its lists)
// No lock of a part is held across a network wait: a frame to a peer is queued and written without
// waiting under ControlOut::mu_ (a sender waits for its own frame with no lock held, until its
// deadline). What stays serialised per link is its data path's stream: a tcp or shm request runs
// under the path's run lock, and an rdma flag goes out on every queue pair under the path's flag
// lock; a request waits for either until its own deadline, never longer, and a request's socket
// waits end at its deadline or at the frame stall bound (transport/tcp_path.h).
// The locks on the request path (Registry::mu_, LinkTable::mu_, Link::mu, Requests::mu_ and the rdma
// endpoint's send-side lock) are util::Mutex (util/mutex.h), the others std::mutex. A thread's repeated
// lookup of one peer's link takes no lock (LinkTable::find with the thread's LinkLookup).
//
// Threads: an acceptor accepts peers and hands each handshake to a worker thread of its own
// (bounded by deadlines and by kMaxHandshakes; the oldest unauthenticated one gives way to a new one
// when they are full: handshakes.h); the progress thread serves the control connections,
// reading each incrementally (a peer that stops in the middle of a frame holds up no other link) and
// queueing its replies per link (a peer that stops reading holds up no other link: link.h);
// the watchdog sends heartbeats (queued too), closes links whose peer is dead (a silent peer that is
// provably alive is slow, not dead: liveness.h) and expires requests. The data path never involves the receiver's CPU.
//
// Every public method returns a hixl status code (or a pair starting with one) and never throws.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/desc_lists.h"
#include "engine/handshakes.h"
#include "engine/inbox.h"
#include "engine/link.h"
#include "engine/link_table.h"
#include "engine/metrics.h"
#include "engine/registry.h"
#include "engine/requests.h"
#include "engine/types.h"
#include "transport/oob.h"
#include "transport/rdma_endpoint.h"
#include "verbs/resources.h"
#include "wire/control.h"

namespace hixl::engine {

struct ThreadState;  // engine/thread_state.h

class Engine {
 public:
  Engine();
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int initialize(const std::string& local_engine, const Options& opts);
  void finalize();  // idempotent; afterwards every call returns kFailed

  // access: what peers may do with the region (wire::kRemoteRead | wire::kRemoteWrite by default;
  // kRemoteRead alone = read-only, 0 = usable only as our own source/destination). The MR gets the
  // matching IBV_ACCESS_REMOTE_* bits, so the device refuses what the checks before posting refuse.
  std::pair<int, uint64_t> register_mem(uint64_t addr, uint64_t len, MemType type,
                                        uint32_t access = wire::kRemoteRead | wire::kRemoteWrite);
  int deregister_mem(uint64_t handle);

  int connect(const std::string& remote, int timeout_ms);
  int disconnect(const std::string& remote, int timeout_ms);

  // flag >= 0 (WRITE only, < 2^32): the peer receives it as a completion flag once the bytes landed.
  int transfer_sync(const std::string& remote, TransferOp op, const OpDesc* descs, size_t n, int timeout_ms,
                    int64_t flag = -1);
  int transfer_sync(const std::string& remote, TransferOp op, const std::vector<OpDesc>& descs, int timeout_ms,
                    int64_t flag = -1) {
    return transfer_sync(remote, op, descs.data(), descs.size(), timeout_ms, flag);
  }
  // timeout_ms: the request's deadline (Options::async_timeout_ms); < 0: the engine's, 0: none.
  std::pair<int, uint64_t> transfer_async(const std::string& remote, TransferOp op, const OpDesc* descs, size_t n,
                                          uint64_t user_data, int64_t flag = -1, int timeout_ms = -1);
  std::pair<int, uint64_t> transfer_async(const std::string& remote, TransferOp op, const std::vector<OpDesc>& descs,
                                          uint64_t user_data, int64_t flag = -1, int timeout_ms = -1) {
    return transfer_async(remote, op, descs.data(), descs.size(), user_data, flag, timeout_ms);
  }

  // Prepared descriptor lists (desc_lists.h). prep_descs: n blocks [addr[i], addr[i]+len[i]) of our
  // registered memory (remote "") or of the peer `remote` (connected, or auto-connected), each
  // inside a region; a handle for transfer_prepped_*. release_descs: kParamInvalid for an unknown
  // handle. A prepared transfer moves block local_idx[i] of local_list to/from block remote_idx[i]
  // of remote_list (the peer is remote_list's), i < n; the pair must have the same length.
  std::pair<int, uint64_t> prep_descs(const std::string& remote, const uint64_t* addr, const uint64_t* len, size_t n,
                                      int timeout_ms);
  int release_descs(uint64_t handle);
  int transfer_prepped_sync(TransferOp op, uint64_t local_list, const uint64_t* local_idx, uint64_t remote_list,
                            const uint64_t* remote_idx, size_t n, int timeout_ms, int64_t flag = -1);
  std::pair<int, uint64_t> transfer_prepped_async(TransferOp op, uint64_t local_list, const uint64_t* local_idx,
                                                  uint64_t remote_list, const uint64_t* remote_idx, size_t n,
                                                  uint64_t user_data, int64_t flag = -1, int timeout_ms = -1);
  std::pair<int, int> transfer_status(uint64_t req);
  // Blocks up to timeout_ms (< 0: no limit) for the request to end, then reports like
  // transfer_status(); WAITING (and the request kept) when the time passed first.
  std::pair<int, int> transfer_wait(uint64_t req, int timeout_ms);
  std::pair<int, std::vector<TransferResult>> all_transfer_status(uint64_t max_count, bool skip_waiting);

  int send_notify(const std::string& remote, const std::string& name, const std::string& msg, int timeout_ms);
  std::pair<int, std::vector<Notify>> get_notifies();
  // Blocks up to timeout_ms (< 0: no limit) until at least one notify is there, then get_notifies().
  std::pair<int, std::vector<Notify>> wait_notifies(int timeout_ms);

  // Completion flags from peers, oldest first. poll: what is there now; wait: blocks up to
  // timeout_ms (< 0: no limit) for at least one (empty on timeout). flag_fd(): an eventfd that is
  // readable while flags are pending (for select/poll/asyncio); -1 before initialize().
  std::pair<int, std::vector<FlagEvent>> poll_flags(size_t max);
  std::pair<int, std::vector<FlagEvent>> wait_flags(size_t max, int timeout_ms);
  int flag_fd() const { return inbox_.flag_fd(); }
  // Flag failures: fail_flag tells a connected peer that flag `value` will not come, and why (its
  // poll_flag_failures returns it; reason: at most kMaxNotifyBytes, longer is cut). A link that
  // closes (except by finalize, or replaced by a new one) gives a failure with value -1: none of
  // that peer's flags not yet seen will come over it. Opt-in: failures are kept from the first
  // poll_flag_failures() call on; from then on the flag eventfd and wait_flags wake for them too
  // (an engine whose user never asks behaves as before: no wake-up, nothing kept).
  int fail_flag(const std::string& remote, uint32_t value, const std::string& reason, int timeout_ms);
  std::pair<int, std::vector<FlagFailure>> poll_flag_failures(size_t max);

  // Beyond CANN.
  std::string local_engine() const;     // canonical "ip:port" (the bound port), or "ip" (client only)
  std::string data_transport() const;   // the transports this engine offers, e.g. "rdma,shm,tcp"
  std::pair<int, LinkInfo> link_info(const std::string& remote);
  std::vector<std::string> peers();
  std::string last_error() const;       // the reason behind the last non-SUCCESS status of this thread
  // The counters (metrics.h) and the links open now, by transport (rdma, shm, tcp).
  Metrics::Snapshot metrics(std::array<uint64_t, Metrics::kTransports>* links) const;
  // Tests: hands an async event (ibv_event_type, QP number, port) to the engine's handler as if its
  // device had reported it (kUnsupported without an RDMA device).
  int inject_async_event(int type, uint32_t qp_num, int port);
  // A transfer refused before it reached the engine (the Python layer's argument checks).
  void count_refused(Metrics::Refused r) { metrics_.refused(r); }


 private:
  struct Worker;
  enum class State { kNew, kReady, kFinalized };

  bool ready() const;
  // initialize()'s steps (engine.cc): the wake and accept-wake eventfds and the inbox's (nothing left
  // open when it throws); then, with the state set, the threads and the device's async events.
  void open_event_fds(const std::string& name, int* wfd, int* afd);
  void start_threads();
  void spawn(std::function<void()> fn);  // throws hixl::Error once finalize() began
  void wake();                           // the progress thread re-reads the link table

  // connector.cc
  int connect_settled(const std::string& key, int timeout_ms);
  int connect_impl(const std::string& key, int timeout_ms);
  int connect_once(const std::string& key, int timeout_ms, uint32_t offers, std::string* shm_refusal);
  // connect_once()'s handshake on s (under the Handshakes guard): auth, our Connect, the peer's
  // Accept checked, the queue pairs connected (ep, and as many of `more` as the peer answered), the
  // data path built, our READY sent. kSuccess; a refusal's status (fail()); kRetryWithoutShm when
  // the same-host transport the peer chose is not usable from here (the server was told; the
  // reason in *shm_refusal). Throws hixl::Error on a broken or timed-out exchange.
  int connect_handshake(oob::Socket& s, Link& link, const std::shared_ptr<rdma::Endpoint>& ep,
                        std::vector<std::shared_ptr<rdma::Endpoint>>& more, uint32_t offers, std::string* shm_refusal,
                        std::chrono::steady_clock::time_point deadline, wire::Control* peer);
  // Why the same-host transport to peer is not usable from here ("": it is).
  std::string shm_unusable(const wire::Control& peer) const;
  // Tells the server why this attempt ends (a Refuse) and waits for it to close the connection.
  void end_for_retry_without_shm(oob::Socket& s, const std::string& why,
                                 std::chrono::steady_clock::time_point deadline);
  // The TCP link's two data connections, once the server published the link; throws.
  void attach_tcp_data(Link& link, const std::string& host, uint16_t port,
                       std::chrono::steady_clock::time_point deadline);
  int disconnect_impl(const std::string& key, int timeout_ms, const std::string& why);
  std::shared_ptr<rdma::Endpoint> make_endpoint() const;
  // A link's further queue pairs (HixlRdmaQpsPerLink - 1 of them, or fewer as the peer allows).
  std::vector<std::shared_ptr<rdma::Endpoint>> make_more_endpoints(size_t n) const;
  size_t more_qps_wanted() const;
  wire::Control hello_frame(wire::FrameType type, const std::shared_ptr<rdma::Endpoint>& ep, uint32_t offers,
                            const std::vector<std::shared_ptr<rdma::Endpoint>>& more = {}) const;
  void make_path(Link& link, const wire::Control& peer);  // the agreed transport's data path; throws
  // Publishes a link whose path is built; false when finalizing or (without superseded) one exists.
  bool add_link(const std::shared_ptr<Link>& link, oob::Socket s, const wire::Control& peer,
                std::shared_ptr<Link>* superseded);
  // Unpublishes the link and closes it (idempotent; counted once, under cause). Cause::kDisconnect:
  // our own disconnect().
  void remove_link(const std::shared_ptr<Link>& link, const std::string& why, Metrics::Cause cause);
  void close_path(const std::shared_ptr<transport::DataPath>& path, Metrics::Cause cause);
  bool take_closed(const std::string& key);  // a link to key ended without our disconnect()
  void accept_loop();
  void accept_incoming();
  void serve_incoming(oob::Socket s, uint64_t slot);  // slot: its Handshakes slot
  // serve_incoming()'s steps. refuse_peer: logs the refusal, sends it (best effort) and lets the
  // peer read it. read_connect: the auth exchange (when we have a token: authenticate_peer) and the
  // peer's Connect into *c; false when the connection was answered here (refused, or a TCP data
  // connection attached). choose_transport: the one both ends can use (kNone: none; *shm_why says
  // why not the same-host one). incoming_link: the link with its queue pairs connected and its
  // data path built; accept_and_publish: our Accept, the peer's READY, the link published (our
  // claim on its name ended: *claimed false; the link it replaced in *old, retired) and our READY.
  // await_first_bytes: the first bytes within kFirstBytesTimeoutMs; refuse_dropped: the answer of a
  // handshake whose slot gave way to a newer one (RESOURCE_EXHAUSTED; false). Both false when the
  // connection was answered here.
  void refuse_peer(oob::Socket& s, const std::string& from, std::chrono::steady_clock::time_point deadline, int code,
                   const std::string& why, bool warn = false, const std::string& detail = "");
  bool refuse_dropped(oob::Socket& s, const std::string& from, std::chrono::steady_clock::time_point deadline);
  bool await_first_bytes(oob::Socket& s, uint64_t slot, const std::string& from,
                         std::chrono::steady_clock::time_point deadline);
  bool read_connect(oob::Socket& s, const std::string& from, uint64_t slot,
                    std::chrono::steady_clock::time_point deadline, wire::Control* c);
  // Peer identity. name_on_source: without a token (and without trust_claimed_address) the name
  // `key` a peer claims must be on the connection's source address. claim_name: the peer's claim on
  // key (its Connect c); its source may hold at most kMaxLinksPerHost links; a name with a live link
  // is claimed only once that link is proven dead (proven_dead). True: key is claimed for this
  // handshake. Both false when refused (answered here).
  bool name_on_source(oob::Socket& s, const std::string& from, const std::string& key,
                      std::chrono::steady_clock::time_point deadline);
  bool claim_name(oob::Socket& s, const std::string& from, const wire::Control& c, const std::string& key,
                  bool listens, std::chrono::steady_clock::time_point deadline);
  // The liveness probe of a link a new connection claims the name of, holding no lock: true (and
  // *how) when it closed, its peer closed the control connection, or nothing came from the peer
  // within kLivenessProbeMs of a ping and nothing shows it alive (liveness.h: its process runs on
  // this host, or its host acknowledged the ping); false when the peer answered or is alive but
  // slow (*how says so).
  bool proven_dead(const std::shared_ptr<Link>& link, std::chrono::steady_clock::time_point deadline,
                   std::string* how);
  bool authenticate_peer(oob::Socket& s, const std::string& from, uint64_t slot,
                         std::chrono::steady_clock::time_point deadline);
  wire::Transport choose_transport(const wire::Control& c, std::string* shm_why) const;
  std::shared_ptr<Link> incoming_link(const wire::Control& c, const std::string& key, wire::Transport chosen);
  void accept_and_publish(const std::shared_ptr<Link>& link, oob::Socket& s, const wire::Control& c,
                          std::chrono::steady_clock::time_point deadline, bool* claimed, std::shared_ptr<Link>* old);
  void serve_attach(oob::Socket s, const wire::Control& c);

  // transfers.cc
  // The link to `remote` (the name as given, when a link has it: no parsing per transfer; else its
  // canonical form, auto-connecting when allowed); *key (when not null) its canonical name. last: the
  // thread's last lookup (LinkTable::find), when the caller has its ThreadState at hand.
  int find_link(const std::string& remote, int timeout_ms, const char* call, std::shared_ptr<Link>* out,
                std::string* key, LinkLookup* last = nullptr);
  int ensure_link(const std::string& key, int timeout_ms, std::shared_ptr<Link>* out);
  // Resolves and checks descs into *out (local keys from our registry, remote keys from the link).
  int prepare(const std::shared_ptr<Link>& link, TransferOp op, const OpDesc* descs, size_t n,
              std::chrono::steady_clock::time_point deadline, std::vector<rdma::Desc>* out);
  // Asks the peer for its region list once (it may have registered since), bounded by deadline.
  void refresh_regions(const std::shared_ptr<Link>& link, std::chrono::steady_clock::time_point deadline);
  // A prepared transfer's descriptors, checked (indices, lengths, access), into *out; *link its peer's.
  int build_prepped(TransferOp op, uint64_t local_list, const uint64_t* local_idx, uint64_t remote_list,
                    const uint64_t* remote_idx, size_t n, int timeout_ms, const char* call,
                    std::shared_ptr<Link>* link, std::vector<rdma::Desc>* out);
  // Posting checked descriptors (both kinds of transfer end here).
  int run_sync(const std::shared_ptr<Link>& link, TransferOp op, const std::vector<rdma::Desc>& rd,
               std::chrono::steady_clock::time_point deadline, int timeout_ms, int64_t flag, const char* call);
  // A refused transfer: counted under r, and rc returned.
  int refuse(Metrics::Refused r, int rc) {
    metrics_.refused(r);
    return rc;
  }
  std::pair<int, uint64_t> run_async(const std::shared_ptr<Link>& link, TransferOp op,
                                     const std::vector<rdma::Desc>& rd, uint64_t user_data, int64_t flag,
                                     int timeout_ms, std::chrono::steady_clock::time_point start, const char* call,
                                     ThreadState& ts);
  int submit_checks(TransferOp op, int64_t flag, const char* call);
  // True once the peer confirmed its queue pair is in the error state too.
  bool abort_link(const std::shared_ptr<Link>& link, const std::string& why);
  // A transfer on the link failed: the link goes (cause transfer_error), unless an abort of it is under
  // way, which closed the path itself and removes the link once the peer confirmed (removing it here
  // closed the control connection before the confirmation could arrive: TIMEOUT became FAILED).
  void transfer_failed(const std::shared_ptr<Link>& link, const std::string& why);

  // A QP error ends the link of that QP, a port or device error every RDMA link (engine.cc).
  void on_async_event(const verbs::AsyncEvent& ev);

  // control.cc
  void push_regions();
  void progress_loop();
  // What the link's control connection holds now (one read, never a wait for more): every frame it
  // completes is handled, in order; a frame left incomplete stays in the link's reader. Throws when
  // the connection failed or the peer broke the format (the caller closes the link).
  void read_control(const std::shared_ptr<Link>& link);
  void handle_frame(const std::shared_ptr<Link>& link, const wire::Control& c);
  // Closes the link when its incomplete control frame began more than kFrameCompleteBound ago.
  void close_if_frame_stuck(const std::shared_ptr<Link>& link, std::chrono::steady_clock::time_point now);
  // Closes the link when the peer stopped reading our replies (control_out.h: ControlOut::stalled).
  void close_if_not_reading(const std::shared_ptr<Link>& link, std::chrono::steady_clock::time_point now);
  // Every tick: the heartbeat (pings, links gone silent) and the async requests past their deadline.
  void watchdog_loop();
  void heartbeat();
  // A link silent past the heartbeat bound whose peer shows signs of life (engine/liveness.h) is
  // kept, up to kSlowPeerFactor times the bound: true (logged once per slow spell).
  bool keep_silent_link(Link& link, milliseconds silent, milliseconds limit);
  void expire_requests();

  // Lifecycle (mu_): written by initialize()/finalize() only; read by everyone after ready().
  mutable std::mutex mu_;
  // Written under mu_ (initialize/finalize); read without it by ready(), once per call on the
  // transfer path (a call racing finalize() is refused by the part it reaches next anyway).
  std::atomic<State> state_{State::kNew};
  Options opts_;
  std::string name_;
  std::string host_;
  uint32_t offers_ = 0;  // wire::transport_bit() of each transport this engine may use
  bool auto_transport_ = true;
  const uint64_t probe_cookie_;  // peers on this host read it with process_vm_readv
  const uint64_t instance_;      // random: tells this engine object apart from a restarted one
  std::string boot_id_;
  std::shared_ptr<verbs::ProtectionDomain> pd_;  // shared with every link's endpoint and the registry
  uint64_t async_sub_ = 0;                        // our subscription to the device's async events

  // The parts (metrics_ first: Requests counts into it).
  Metrics metrics_;
  Registry registry_;
  LinkTable links_;
  Handshakes handshakes_;
  Requests requests_;
  Inbox inbox_;
  DescLists lists_;
  std::mutex push_mu_;  // one region push at a time, so each link sees versions in order

  // Threads.
  oob::Socket listener_;
  int wake_fd_ = -1;
  int accept_wake_fd_ = -1;  // eventfd: finalize() wakes the acceptor with it
  std::thread acceptor_;     // accepts peers and hands each to a handshake thread; never waits on a link
  std::atomic<bool> stop_{false};
  std::thread progress_;
  std::thread watchdog_;
  std::atomic<std::thread::id> progress_id_{}, watchdog_id_{};  // set by those threads: close_path()
  std::mutex watchdog_mu_;
  std::condition_variable watchdog_cv_;
  std::mutex workers_mu_;
  bool workers_closed_ = false;
  std::vector<std::shared_ptr<Worker>> workers_;
};

}  // namespace hixl::engine
