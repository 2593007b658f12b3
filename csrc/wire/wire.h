// Out-of-band handshake wire format: versioned, length-prefixed, bounds-checked.
//
// Frame  = header (16 bytes, little endian) + payload
//   u32 magic 'HIXL' (0x4c584948), u16 version, u16 type, u32 payload_len, u32 reserved (0)
// Hello payload (type 1) = u32 qpn, u32 psn, u16 lid, u8 mtu_bytes_log2, u8 port, u8[16] gid,
//   u32 flags, u32 region_count, then region_count * {u64 addr, u64 len, u32 rkey, u32 access,
//   u32 fence, u32 tag} (fence: the region's slot in its owner's fence, tag: the slot's tag for it)
// Ready payload (type 2) = empty.   Reject payload (type 3) = UTF-8 reason.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hixl::wire {

constexpr uint32_t kMagic = 0x4c584948;  // "HIXL" in little endian
// 2: Connect/Accept/Attach carry the link id; 3: and further queue pairs; 4: regions carry their fence
// slot and tag, Connect/Accept the fence's fd
constexpr uint16_t kVersion = 4;
constexpr size_t kHeaderSize = 16;
constexpr uint32_t kMaxPayload = 1u << 20;  // 1 MiB: ~32k regions; anything bigger is hostile
constexpr size_t kRegionSize = 32;
constexpr size_t kHelloFixed = 4 + 4 + 2 + 1 + 1 + 16 + 4 + 4;

// 1-3: endpoint handshake. 4+: engine control channel (wire/control.h).
enum class FrameType : uint16_t {
  kHello = 1, kReady = 2, kReject = 3,
  kConnect = 4, kAccept = 5, kRefuse = 6, kNotify = 7, kNotifyAck = 8, kRegions = 9, kRegionsReq = 10,
  kAbort = 11, kAbortAck = 12, kBye = 13, kAttach = 14, kFlag = 15,
  kAuthHello = 16, kAuthChallenge = 17, kAuthProof = 18,
  kPing = 19, kPong = 20, kFlagFailed = 21,
};
constexpr FrameType kLastFrameType = FrameType::kFlagFailed;

// Access bits advertised for a region (independent of ibv_access_flags values).
enum RegionAccess : uint32_t { kRemoteRead = 1, kRemoteWrite = 2 };

struct Region {
  uint64_t addr = 0;
  uint64_t len = 0;
  uint32_t rkey = 0;
  uint32_t access = 0;
  uint32_t fence = UINT32_MAX;  // its slot in the owner's fence (transport/shm_fence.h); none: UINT32_MAX
  uint32_t tag = 0;             // the slot's tag while the region is registered
  bool operator==(const Region& o) const {
    return addr == o.addr && len == o.len && rkey == o.rkey && access == o.access && fence == o.fence && tag == o.tag;
  }
};

struct Hello {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  uint16_t mtu = 1024;  // bytes: 256..4096
  uint8_t port = 1;
  std::array<uint8_t, 16> gid{};
  uint32_t flags = 0;
  std::vector<Region> regions;
};

struct Header {
  uint16_t version = 0;
  FrameType type = FrameType::kHello;
  uint32_t payload_len = 0;
};

std::vector<uint8_t> encode_frame(FrameType t, const std::vector<uint8_t>& payload);  // header + payload
std::vector<uint8_t> encode_hello_payload(const Hello& h);
std::vector<uint8_t> encode_hello(const Hello& h);
std::vector<uint8_t> encode_ready();
std::vector<uint8_t> encode_reject(const std::string& reason);

// Parses and validates a 16-byte header. Throws hixl::Error naming what is wrong.
Header parse_header(const uint8_t* data, size_t len);
// Refuses (hixl::Error) a header whose payload_len exceeds max_payload, a reader's own bound (at
// most kMaxPayload, which parse_header() enforces): called before anything is allocated for it.
void check_payload_len(const Header& h, uint32_t max_payload);
// "Notify", "Ping", ...: for messages ("?" for a value outside FrameType).
const char* frame_type_name(FrameType t);
// Parses a Hello payload (header already stripped). Throws hixl::Error on any inconsistency.
Hello parse_hello(const uint8_t* data, size_t len);
// Parses a whole frame (header + payload) that must be a Hello.
Hello parse_hello_frame(const uint8_t* data, size_t len);

}  // namespace hixl::wire
