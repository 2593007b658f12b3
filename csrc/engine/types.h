// The engine's public vocabulary: status codes, options, descriptors and what the engine reports.
// Shared by the facade (engine.h), its parts and the Python binding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/rdma_endpoint.h"

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

enum class MemType : int { kDevice = 0, kHost = 1 };
enum class TransferOp : int { kRead = 0, kWrite = 1 };
using TransferStatus = rdma::Status;  // WAITING 0, COMPLETED 1, TIMEOUT 2, FAILED 3

constexpr size_t kMaxUnreadNotifies = 4096;  // per peer; beyond that the sender gets RESOURCE_EXHAUSTED
// Unread notifies held by one engine from all its peers together, by count and by bytes (name +
// message): beyond either the sender gets RESOURCE_EXHAUSTED, so peers under invented names cannot
// multiply the per-peer bound. 4x one peer's bound, at most 64 MiB (a notify is at most 8 KiB).
constexpr size_t kMaxHeldNotifies = 4 * kMaxUnreadNotifies;
constexpr size_t kMaxHeldNotifyBytes = 64u << 20;
constexpr size_t kMaxNotifyBytes = 4096;     // name / message: 1024 characters of UTF-8

struct Options {
  std::string transport = "auto";  // auto (rdma > shm > tcp, as both ends allow) | rdma | shm | tcp
  std::string device;              // RDMA device ("" -> $HIXL_DEVICE -> first ACTIVE)
  int gid_index = -1;              // -1 -> $HIXL_GID_INDEX -> RoCEv2 IPv4-mapped
  int traffic_class = -1;          // GRH traffic class (-1 = default 0)
  int service_level = -1;          // SL (-1 = default 0)
  // The RC queue pair's local ACK timeout, 4.096 us * 2^rdma_timeout (1..31; -1: 14, 67 ms; 0, "wait
  // forever", is refused), and how often a send is retried before the QP fails (0..7; -1: 7). On a
  // lossy fabric (RoCE without PFC, Soft-RoCE) every lost tail packet costs a full timeout: a smaller
  // value recovers sooner, too small retries spuriously on a congested one.
  int rdma_timeout = -1;
  int rdma_retry_count = -1;
  // RC queue pairs per rdma link (1..16; -1: 1). With more than one a request's bytes are striped
  // across them (transport/data_path.h), so one queue pair waiting out a retransmission does not stall
  // the link. A link gets the smaller of the two ends' values.
  int rdma_qps_per_link = -1;
  // On Soft-RoCE (rxe) the -1 default of rdma_qps_per_link is kSoftRoceQpsPerLink instead. rxe runs
  // over ordinary Ethernet, which loses packets, and recovers a lost packet that no NAK reports only
  // when the ACK timer fires: while one queue pair waits, the others keep the link busy. Across the
  // two-host link (ci/two-vm) 1 % loss kept 0.21x-0.28x of the clean bandwidth with one queue pair
  // and 0.35x-0.51x with 4 (ACK timeout 14 both). With 8, each with the Soft-RoCE send window below,
  // 0.63x-0.80x in quiet runs (12.6-14.9 MiB/s under loss against 4 queue pairs' 9.9-13.2 in the same
  // runs; 4-18 % less on the clean link). The ACK timeout stays 14: at 12 (16 ms) the striped links
  // mostly met 0.5x at 1 % loss (0.38x-0.61x), but twice in a day rxe failed a queue pair with "remote
  // invalid request" on a clean link under load (a retransmission it mishandles). Hardware keeps one
  // queue pair: it retransmits by itself on fabrics built not to drop, and 8x the queue pairs cost NIC
  // cache per peer.
  static constexpr int kSoftRoceQpsPerLink = 8;
  // The largest message one RDMA work request carries (4096..1 GiB; -1: EndpointOptions::slice_bytes,
  // 4 MiB, or on Soft-RoCE kSoftRoceMaxWrBytes); a longer descriptor is sliced into several work requests. The sending end's own.
  // rxe asks the peer for an ACK at the end of each work request, else every 65th packet, and once a NAK
  // started a retransmission it ignores further NAKs until an ACK came: a second loss in that stretch
  // waits out the whole ACK timeout. 16 KiB work requests (16 packets at rxe's 1024 B MTU) shorten the
  // stretch: across the two-host link 1 % loss kept 9.1-11.2 MiB/s against 6.9-9.4 with 4 MiB ones (9 runs,
  // both in each, 16 KiB ahead in every one; clean ~3 % slower). So that a big request does
  // not take thousands of work requests (filling the send queue: its submitter would wait), on Soft-RoCE
  // by default a queue pair's share of one request takes at most kSoftRoceMaxSlices of them, larger when
  // it must (rdma_max_slices); an explicit rdma_max_wr_bytes is a fixed cap.
  int64_t rdma_max_wr_bytes = -1;
  static constexpr int64_t kMinMaxWrBytes = 4096, kMaxMaxWrBytes = 1ll << 30;
  static constexpr int64_t kSoftRoceMaxWrBytes = 16 * 1024;
  static constexpr uint32_t kSoftRoceMaxSlices = 16;
  uint32_t rdma_max_slices = 0;  // set by initialize(): EndpointOptions::max_slices (the Soft-RoCE default)
  // The most bytes a queue pair has posted and not yet completed (0..1 GiB; 0: none, as many work
  // requests as its send queue holds; -1: none, but on Soft-RoCE see below). At least one work request
  // flies. What does not fit waits in the endpoint, in order, and is posted as completions come back
  // (rdma::EndpointOptions::window_bytes), so a submit never waits for send-queue room and max_slices is
  // not applied. The sending end's own.
  // rxe retransmits go-back-N (a lost packet makes it send everything of that queue pair after it
  // again, up to 128 packets): a window bounds that. But it caps each queue pair at window / round
  // trip, and that round trip is long under emulation: with 4 queue pairs a 64 KiB window cost 17 %
  // (1 MiB requests) to 34 % (8 MiB) of the clean bandwidth for about the same bytes under loss. With 8
  // queue pairs the link keeps as many bytes in flight as 4 without a window, in smaller runs per
  // queue pair. So on Soft-RoCE a striped link (rdma_qps_per_link > 1 at this end, as by default) has
  // kSoftRoceSendWindowBytes by default; one queue pair has none (a window would cap the link). It
  // follows this end's setting: a link its peer holds to one queue pair keeps the window. Elsewhere
  // none: hardware NICs on lossless fabrics.
  int64_t rdma_send_window_bytes = -1;
  static constexpr int64_t kMaxSendWindowBytes = 1ll << 30;
  static constexpr int64_t kSoftRoceSendWindowBytes = 64 * 1024;
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
  // Without a token a peer may claim only a name on the address it connects from (its source
  // address); true lifts that check (HixlTrustClaimedAddress): for peers behind NAT, whose source
  // address is not the one they listen on. Then any process that reaches our port may claim any
  // name that has no live link. A live link is never replaced by a claim alone either way.
  bool trust_claimed_address = false;
};

// Handshakes served at once (each on its own thread, each bounded by handshake_timeout_ms): beyond
// these the oldest unauthenticated one gives way to a new connection, else that one is refused at
// once (RESOURCE_EXHAUSTED), so slow or hostile peers cannot pile up threads nor lock others out;
// one address may hold only part of them.
constexpr int kMaxHandshakes = 256;
constexpr int kMaxHandshakesPerHost = 32;
// An accepted connection must send its first bytes within this (or handshake_timeout_ms, when
// shorter): a peer that connects sends its first frame at once. Idle ones also give way to new
// ones when the slots are full (handshakes.h).
constexpr int kFirstBytesTimeoutMs = 3000;
// A claim for a name that has a live link: the old link is probed (a ping) for this long; it is dead
// when its connection closed meanwhile, or when nothing at all came from the peer and nothing shows
// it alive but slow (liveness.h; the heartbeat declares a silent link dead only after heartbeat_ms *
// heartbeat_misses, a slow one later still).
constexpr int kLivenessProbeMs = 1500;
// Links from one source address that peers opened to us (its engines' listening names, one
// client-only name): beyond that a new one is refused (RESOURCE_EXHAUSTED). A host runs one engine
// per process, typically one per accelerator (8-16); 64 leaves room for several per accelerator.
constexpr size_t kMaxLinksPerHost = 64;

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

// A flag that will not come: the peer said so (fail_flag: value is the flag, reason the peer's), or
// the link to the peer closed (value -1: none of its flags not yet seen will come; reason: why).
struct FlagFailure {
  std::string peer;
  int64_t value = -1;
  std::string reason;
};

struct LinkInfo {
  std::string remote;
  std::string transport;  // "rdma", "shm" or "tcp"
  bool initiator = false;  // we called connect()
  std::string device;
  int gid_index = 0;
  int path_mtu = 0;
  uint32_t qpn = 0, remote_qpn = 0;
  int traffic_class = 0, service_level = 0;  // as applied to the queue pair's address vector
  int rdma_timeout = 0, rdma_retry_count = 0;  // as applied to the queue pair (RTS)
  uint64_t rdma_max_wr_bytes = 0;  // the most one of our work requests carries (after the port's max_msg_sz)
  uint64_t posted_wrs = 0;         // work requests posted so far on all the link's queue pairs
  uint64_t rdma_send_window_bytes = 0;  // per queue pair; 0: none (the send queue bounds it)
  int qps = 0;  // rdma: queue pairs of the link (qpn, remote_qpn: the first one's)
  std::vector<uint32_t> qpns;  // rdma: all of ours, the first one first
  size_t remote_regions = 0;
};

}  // namespace hixl::engine
