// Engine control channel: the frames an engine exchanges with a peer over its TCP control
// connection (connection setup, notifies, region-list updates, link abort, goodbye).
// Data never travels here on the RDMA transport.
//
// Every frame = wire header (wire.h) + one payload below (little endian; str = u32 len + bytes):
//   Connect    u32 transport, u32 offers, u64 instance, u64 version, str name, str boot_id, u32 pid,
//              u64 probe_addr, u64 probe_value, u32 hello_len, hello payload (wire.h; 0 = none), extents,
//              regions (the sender's registered regions, whatever the transport), u64 link
//              (transport: what the sender wants / the server chose; offers: bit 1<<t for each it can use;
//              version: the sender's region registry version; probe: a cookie the peer may read with
//              process_vm_readv to prove same-host access; link: the initiator's random id for this
//              link, echoed in the Accept), u32 fence_fd (the sender's fence memfd, transport/shm_fence.h;
//              same-host peers map it), u32 count, count * {u32 qpn, u32 psn}: the sender's further
//              queue pairs (a striped rdma link, 0..15 of them, only with a hello; same port, GID and
//              MTU as hello's; the Accept's count, at most the Connect's, is the link's)
//   Accept     same as Connect (the server's side; transport = the one chosen)
//   Refuse     u32 status (hixl status code), str reason
//   Notify     u64 seq, str name, str message
//   NotifyAck  u64 seq, u32 status
//   Regions    u64 seq (0 = unsolicited push), u64 version, regions (wire.h layout), extents
//   extents    u32 count, count * {u64 addr, u64 len, u64 offset, u32 fd, u32 0}: memfd-backed regions
//   RegionsReq u64 seq
//   Abort      u64 seq, str reason      AbortAck  u64 seq
//   Bye        str reason
//   Attach     u64 instance, str name, u32 direction, u64 link (TCP transport: a data connection of the
//              link with that id; one of a link already replaced is dropped, never attached to its successor)
//   Flag       u32 value (a completion flag, sent after the bytes of the transfer it completes landed:
//              the shm/tcp counterpart of RDMA WRITE_WITH_IMM's immediate)
//   AuthHello      u32 scheme (1 = HMAC-SHA-256 challenge/response), u8[32] client nonce
//   AuthChallenge  u8[32] server nonce
//   AuthProof      u8[32] HMAC (client's, then server's; auth/handshake.h)
//   Ping       empty (the heartbeat: the peer answers with a Pong at once)    Pong  empty
// A payload must be consumed exactly; strings are bounded (kMaxName / kMaxText) before copying.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "wire/wire.h"

namespace hixl::wire {

enum class Transport : uint32_t { kNone = 0, kRdma = 1, kShm = 2, kTcp = 3 };
constexpr Transport kLastTransport = Transport::kTcp;
const char* transport_name(Transport t);
inline uint32_t transport_bit(Transport t) { return 1u << uint32_t(t); }

struct Extent {  // a region backed by a memfd the peer may map
  uint64_t addr = 0, len = 0, offset = 0;
  uint32_t fd = 0;
  bool operator==(const Extent& o) const { return addr == o.addr && len == o.len && offset == o.offset && fd == o.fd; }
};
constexpr size_t kMaxExtents = 1u << 16;

constexpr size_t kMaxName = 4096;       // engine names, notify names (1024 chars of UTF-8 fit)
constexpr size_t kMaxText = 64 * 1024;  // notify messages, reasons
constexpr size_t kAuthBytes = 32;        // nonces and proofs of the Auth* frames
constexpr size_t kMaxMoreQps = 15;       // queue pairs of a link beyond the first

struct Control {
  FrameType type = FrameType::kBye;
  uint64_t seq = 0;
  uint32_t status = 0;                  // Refuse, NotifyAck; Flag: the flag value
  Transport transport = Transport::kNone;  // Connect, Accept
  uint32_t offers = 0;                  // Connect, Accept: transport bits the sender can use
  std::string boot_id;                  // Connect, Accept: same value = same host
  uint32_t pid = 0;                     // Connect, Accept
  uint64_t probe_addr = 0, probe_value = 0;  // Connect, Accept
  uint32_t direction = 0;               // Attach
  std::vector<Extent> extents;          // Connect, Accept, Regions
  uint32_t fence_fd = UINT32_MAX;       // Connect, Accept: the sender's fence memfd (same-host peers map it)
  uint64_t instance = 0;                // Connect/Accept/Attach: random per engine object
  uint64_t link = 0;                    // Connect/Accept/Attach: random per link (the initiator's choice)
  uint64_t version = 0;                 // Connect/Accept/Regions: region registry version (newer wins)
  std::string name;                     // Connect/Accept: engine name; Notify: notify name
  std::string text;                     // Notify: message; Refuse/Abort/Bye: reason
  std::optional<Hello> hello;           // Connect/Accept (RDMA queue pair + regions)
  std::vector<std::pair<uint32_t, uint32_t>> more_qps;  // Connect/Accept: further queue pairs (qpn, psn)
  std::vector<Region> regions;          // Connect, Accept, Regions
  uint32_t scheme = 0;                  // AuthHello
  std::array<uint8_t, kAuthBytes> nonce{};  // AuthHello (the client's), AuthChallenge (the server's)
  std::array<uint8_t, kAuthBytes> proof{};  // AuthProof
};

std::vector<uint8_t> encode_control(const Control& c);                        // whole frame
Control parse_control(FrameType type, const uint8_t* payload, size_t len);    // throws hixl::Error
Control parse_control_frame(const uint8_t* data, size_t len);                 // header + payload

}  // namespace hixl::wire
