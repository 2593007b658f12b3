// hixl engine: the CANN-hixl-compatible transfer engine behind hixl.Hixl.
//
// An engine owns: a listener (when its address has a port), one link per peer (a TCP control
// connection plus a data transport endpoint: an RDMA RC queue pair), the local region registry
// (registered once, on the device's shared protection domain, usable by every link), a cache of each
// peer's regions, the transfer requests, and the notify inbox. An acceptor thread accepts peers
// (each handshake then runs on a thread of its own, bounded by a deadline and by kMaxHandshakes), a
// progress thread serves the control connections, reading each incrementally (a peer that stops in
// the middle of a frame holds up no other link); the data path never involves the receiver's CPU.
//
// Every public method returns a hixl status code (or a pair starting with one) and never throws.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/region_table.h"
#include "transport/data_path.h"
#include "transport/oob.h"
#include "transport/rdma_endpoint.h"
#include "verbs/device.h"
#include "verbs/resources.h"
#include "wire/control.h"

namespace hixl::engine {

// CANN hixl status codes (values fixed by the public API).
enum Code : int {
  kSuccess = 0,
  kParamInvalid = 103900,
  kTimeout = 103901,
  kNotConnected = 103902,
  kAlreadyConnected = 103903,
  kNotifyFailed = 103904,
  kUnsupported = 103905,
  kResourceExhausted = 203900,
  kFailed = 503900,
};
const char* code_name(int code);

// hixl.AsyncConnectStatus values.
enum class ConnState : int {
  kNotConnect = 0, kConnectPending = 1, kConnecting = 2, kConnected = 3, kConnectFailed = 4,
  kDisconnectPending = 5, kDisconnecting = 6,
};

enum class MemType : int { kDevice = 0, kHost = 1 };
enum class TransferOp : int { kRead = 0, kWrite = 1 };
using TransferStatus = rdma::Status;  // WAITING 0, COMPLETED 1, TIMEOUT 2, FAILED 3

constexpr size_t kMaxUnreadNotifies = 4096;  // per peer; beyond that the sender gets RESOURCE_EXHAUSTED
constexpr size_t kMaxNotifyBytes = 4096;     // name / message: 1024 characters of UTF-8

struct Options {
  std::string transport = "auto";  // auto (rdma > shm > tcp, as both ends allow) | rdma | shm | tcp
  std::string device;              // RDMA device ("" -> $HIXL_DEVICE -> first ACTIVE)
  int gid_index = -1;              // -1 -> $HIXL_GID_INDEX -> RoCEv2 IPv4-mapped
  int traffic_class = -1;          // GRH traffic class (-1 = default 0)
  int service_level = -1;          // SL (-1 = default 0)
  bool auto_connect = false;
  int handshake_timeout_ms = 5000;  // an accepted peer must finish its handshake within this
  // transfer_async(): a request not complete this long after it was submitted ends (0: no deadline
  // of its own; the heartbeat still ends it when the peer hangs). Its link is aborted as for a
  // transfer_sync() TIMEOUT, and the request reports TIMEOUT once the peer confirmed it stopped
  // too, else FAILED (within the 5 s an abort waits for that confirmation).
  int async_timeout_ms = 60000;
  // Heartbeat on every control connection: a Ping every heartbeat_ms (0: none), which the peer
  // answers at once; a link that brings no frame at all for heartbeat_ms * heartbeat_misses is
  // declared dead and closed (its requests end FAILED), also while idle. Only our own settings
  // decide: a peer with other settings (or none) still answers our pings.
  int heartbeat_ms = 1000;
  int heartbeat_misses = 10;
  // Shared secret ("" = none). With one, every connection to our listener must prove it before
  // anything of ours is sent, and we connect only to peers that prove it too (auth/handshake.h).
  // A connect() refused for it (missing or wrong token on either side, a server without one)
  // returns kFailed, and last_error() says "authentication ..."; the refusing listener logs a
  // warning naming the peer's address. The token itself is never logged or sent.
  std::string auth_token;
};

// Handshakes served at once (each on its own thread, each bounded by handshake_timeout_ms): beyond
// these, a new connection is refused at once (RESOURCE_EXHAUSTED), so slow or hostile peers cannot
// pile up threads; one address may hold only part of them, so it cannot lock others out.
constexpr int kMaxHandshakes = 256;
constexpr int kMaxHandshakesPerHost = 32;

struct OpDesc {
  uint64_t local_addr = 0;
  uint64_t remote_addr = 0;
  uint64_t len = 0;
};

struct TransferResult {
  uint64_t req = 0;
  uint64_t user_data = 0;
  int status = int(TransferStatus::kWaiting);
};

struct Notify {
  std::string name;
  std::string msg;
};

// A completion flag a peer attached to a WRITE: it arrives after every byte of that write (and of
// every earlier request on the link) is in our memory.
struct FlagEvent {
  std::string peer;  // canonical name of the engine that wrote
  uint32_t value = 0;
};
constexpr size_t kMaxPendingFlags = 1u << 20;  // beyond that, flags are dropped with an error logged

struct LinkInfo {
  std::string remote;
  std::string transport;  // "rdma", "shm" or "tcp"
  bool initiator = false;  // we called connect()
  std::string device;
  int gid_index = 0;
  int path_mtu = 0;
  uint32_t qpn = 0, remote_qpn = 0;
  int traffic_class = 0, service_level = 0;  // as applied to the queue pair's address vector
  size_t remote_regions = 0;
};

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
  int connect_async(const std::string& remote, int timeout_ms);
  int disconnect_async(const std::string& remote, int timeout_ms);
  std::pair<int, int> async_connect_status(const std::string& remote);
  std::pair<int, std::vector<std::pair<std::string, int>>> all_async_connect_status();

  // flag >= 0 (WRITE only, < 2^32): the peer receives it as a completion flag once the bytes landed.
  int transfer_sync(const std::string& remote, TransferOp op, const std::vector<OpDesc>& descs, int timeout_ms,
                    int64_t flag = -1);
  // timeout_ms: the request's deadline (Options::async_timeout_ms); < 0: the engine's, 0: none.
  std::pair<int, uint64_t> transfer_async(const std::string& remote, TransferOp op, const std::vector<OpDesc>& descs,
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
  int flag_fd() const { return flag_fd_; }

  // Beyond CANN.
  std::string local_engine() const;     // canonical "ip:port" (the bound port), or "ip" (client only)
  std::string data_transport() const;   // the transports this engine offers, e.g. "rdma,shm,tcp"
  std::pair<int, LinkInfo> link_info(const std::string& remote);
  std::vector<std::string> peers();
  std::string last_error() const;       // the reason behind the last non-SUCCESS status of this thread

 private:
  struct Link;
  struct Request;
  struct Worker;
  class HandshakeGuard;
  enum class State { kNew, kReady, kFinalized };

  // Implementation of the public calls (may throw; the public wrappers turn that into codes).
  int connect_impl(const std::string& remote, int timeout_ms);
  int disconnect_impl(const std::string& key, int timeout_ms, const std::string& why);
  int ensure_link(const std::string& key, int timeout_ms, std::shared_ptr<Link>* out);
  int prepare(const std::shared_ptr<Link>& link, TransferOp op, const std::vector<OpDesc>& descs,
              std::chrono::steady_clock::time_point deadline, std::vector<rdma::Desc>* out);
  // True once the peer confirmed its queue pair is in the error state too.
  bool abort_link(const std::shared_ptr<Link>& link, const std::string& why);

  std::shared_ptr<rdma::Endpoint> make_endpoint() const;
  wire::Control hello_frame(wire::FrameType type, const std::shared_ptr<rdma::Endpoint>& ep, uint32_t offers) const;
  // Builds the data path of a link whose transport was agreed; throws on failure.
  void make_path(Link& link, const wire::Control& peer);
  int connect_once(const std::string& key, int timeout_ms, uint32_t offers, std::string* shm_refusal);
  void serve_attach(oob::Socket s, const wire::Control& c);
  std::vector<wire::Extent> local_extents() const;
  std::vector<wire::Region> local_regions(uint64_t* version = nullptr) const;
  std::shared_ptr<Link> find_link(const std::string& key);
  // Publishes a link whose path is built; false when finalizing or (without superseded) one exists.
  bool add_link(const std::shared_ptr<Link>& link, oob::Socket s, const wire::Control& peer,
                std::shared_ptr<Link>* superseded);
  // by_disconnect: our own disconnect(); any other end of the current link (the peer's goodbye, a
  // failure, an abort) is remembered in closed_, so that the user's disconnect() still succeeds.
  void remove_link(const std::shared_ptr<Link>& link, const std::string& why, bool by_disconnect = false);
  // Consumes closed_'s record for key: true when the link to it ended without our disconnect().
  bool take_closed(const std::string& key);
  void push_regions();

  void progress_loop();
  // What the link's control connection holds now (one read, never a wait for more): every frame it
  // completes is handled, in order; a frame left incomplete stays in the link's reader. Throws when
  // the connection failed or the peer broke the format (the caller closes the link).
  void read_control(const std::shared_ptr<Link>& link);
  // Closes the link when its incomplete control frame began more than kFrameCompleteBound ago.
  void close_if_frame_stuck(const std::shared_ptr<Link>& link, std::chrono::steady_clock::time_point now);
  // Every tick: the heartbeat (pings, links gone silent) and the async requests past their deadline.
  void watchdog_loop();
  void heartbeat();
  void expire_requests();
  // The abort of a link for expired requests ended: they report TIMEOUT (confirmed) or FAILED.
  void finish_expired(const std::shared_ptr<Link>& link, bool confirmed);
  // A request's status without consuming it from reqs_ (mu_ held); the path's is consumed.
  rdma::RequestResult poll_locked(Request& r);
  void erase_request_locked(std::map<uint64_t, Request>::iterator it);
  void accept_loop();
  void accept_incoming();
  void serve_incoming(oob::Socket s);
  void handle_frame(const std::shared_ptr<Link>& link, const wire::Control& c);
  void spawn(std::function<void()> fn);  // throws hixl::Error once finalize() began
  void push_flag(const std::string& peer, uint32_t value);
  std::vector<FlagEvent> take_flags_locked(size_t max);
  int submit_checks(TransferOp op, int64_t flag, const char* call);
  void wake();
  bool ready() const;

  mutable std::mutex mu_;  // state, links, connecting set, async states, requests
  State state_ = State::kNew;
  Options opts_;
  std::string name_;
  std::string host_;
  uint32_t offers_ = 0;  // wire::transport_bit() of each transport this engine may use
  bool auto_transport_ = true;
  const uint64_t probe_cookie_;  // peers on this host read it with process_vm_readv
  std::string boot_id_;
  std::shared_ptr<verbs::ProtectionDomain> pd_;  // shared with every link's endpoint

  const uint64_t instance_;  // random: tells this engine object apart from a restarted one

  mutable std::mutex reg_mu_;  // local registrations
  struct LocalRegion {
    uint64_t addr = 0, len = 0;
    MemType type = MemType::kHost;
    uint32_t access = wire::kRemoteRead | wire::kRemoteWrite;  // what peers may do (wire::RegionAccess)
    std::shared_ptr<verbs::MemoryRegion> mr;  // null without an RDMA device
    int fd = -1;              // memfd behind it (hixl.acl memory): same-host peers map it
    uint64_t fd_offset = 0;
  };
  std::map<uint64_t, LocalRegion> regions_;
  std::map<std::pair<uint64_t, uint64_t>, uint64_t> region_by_range_;
  RegionTable local_table_;
  uint64_t next_handle_ = 1;
  uint64_t reg_version_ = 1;   // bumped on every (de)registration; peers keep the newest list
  bool reg_closed_ = false;    // finalize() cleared the registry: no more insertions
  std::mutex push_mu_;         // one region push at a time, so each link sees versions in order
  // Held shared while a TCP peer's request touches our memory, exclusively by deregister_mem(): once
  // that returns, no TCP write lands in the region any more.
  std::shared_mutex data_mu_;

  std::map<std::string, std::shared_ptr<Link>> links_;  // by canonical peer name
  std::set<std::string> connecting_;                    // our outgoing handshakes
  std::set<std::string> incoming_;                      // handshakes peers started with us
  std::set<oob::Socket*> handshakes_;                   // sockets in a handshake (shut down by finalize)
  int serving_ = 0;                                     // incoming connections being served (kMaxHandshakes)
  std::map<std::string, int> serving_by_host_;          // ... by peer IP (kMaxHandshakesPerHost)
  std::chrono::steady_clock::time_point last_limit_log_{};               // refusals over the limits: one warning a second
  size_t limit_refusals_ = 0;
  std::map<std::string, ConnState> async_;              // pending/finished async (dis)connects
  // Links that ended without our disconnect() (peer's goodbye or finalize, failure, abort): peer ->
  // (link id, why). The next disconnect() of that peer returns SUCCESS and consumes the record, so a
  // disconnect racing the peer's own goodbye does not fail; connect() clears it. Bounded.
  std::map<std::string, std::pair<uint64_t, std::string>> closed_;
  static constexpr size_t kMaxClosedRecords = 4096;
  std::map<uint64_t, Request> reqs_;
  std::set<std::pair<std::chrono::steady_clock::time_point, uint64_t>> deadlines_;  // async requests with one
  std::condition_variable req_cv_;  // with mu_: expired requests got their final status
  uint64_t next_req_ = 1;

  std::mutex notify_mu_;
  std::condition_variable notify_cv_;
  std::deque<Notify> inbox_;
  std::map<std::string, size_t> unread_;        // peer -> unread notifies (kept across reconnects)

  std::mutex flag_mu_;
  std::condition_variable flag_cv_;
  std::deque<FlagEvent> flags_;
  int flag_fd_ = -1;  // eventfd: counter > 0 exactly while flags_ is not empty

  oob::Socket listener_;
  int wake_fd_ = -1;
  int accept_wake_fd_ = -1;  // eventfd: finalize() wakes the acceptor with it
  std::thread acceptor_;     // accepts peers and hands each to a handshake thread; never waits on a link
  std::atomic<bool> stop_{false};
  std::thread progress_;
  std::thread watchdog_;
  std::mutex watchdog_mu_;
  std::condition_variable watchdog_cv_;
  std::mutex workers_mu_;
  bool workers_closed_ = false;
  std::vector<std::shared_ptr<Worker>> workers_;
};

}  // namespace hixl::engine
