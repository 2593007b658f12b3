#include "wire/wire.h"

#include <cstdio>
#include <cstring>

#include "verbs/error.h"
#include "wire/codec.h"

namespace hixl::wire {

using detail::Reader;
using detail::Writer;

namespace {

int log2_mtu(uint16_t mtu) {
  for (int k = 8; k <= 12; ++k) if (mtu == (1u << k)) return k;
  return -1;
}

}  // namespace

namespace detail {

void write_regions(Writer& w, const std::vector<Region>& regions) {
  w.u32(uint32_t(regions.size()));
  for (const Region& r : regions) {
    w.u64(r.addr);
    w.u64(r.len);
    w.u32(r.rkey);
    w.u32(r.access);
    w.u32(r.fence);
    w.u32(r.tag);
  }
}

std::vector<Region> read_regions(Reader& r, const char* what) {
  uint32_t n = r.u32("region_count");
  // Validate the count against the bytes actually present before allocating anything.
  if (uint64_t(n) * kRegionSize > r.remaining())
    throw Error(std::string("wire: ") + what + ": region_count " + std::to_string(n) + " needs " +
                std::to_string(uint64_t(n) * kRegionSize) + " bytes, " + std::to_string(r.remaining()) +
                " present");
  std::vector<Region> out;
  out.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    Region g;
    g.addr = r.u64("region.addr");
    g.len = r.u64("region.len");
    g.rkey = r.u32("region.rkey");
    g.access = r.u32("region.access");
    g.fence = r.u32("region.fence");
    g.tag = r.u32("region.tag");
    const std::string at = std::string("wire: ") + what + ": region " + std::to_string(i);
    if (g.len == 0) throw Error(at + " has length 0");
    if (g.addr + g.len < g.addr) throw Error(at + " wraps the address space");
    if (g.access & ~uint32_t(kRemoteRead | kRemoteWrite)) throw Error(at + " has unknown access bits");
    out.push_back(g);
  }
  return out;
}

}  // namespace detail

std::vector<uint8_t> encode_frame(FrameType t, const std::vector<uint8_t>& payload) {
  if (payload.size() > kMaxPayload)
    throw Error("wire: payload of " + std::to_string(payload.size()) + " bytes exceeds the " +
                std::to_string(kMaxPayload) + "-byte limit (too many regions?)");
  Writer w;
  w.u32(kMagic);
  w.u16(kVersion);
  w.u16(uint16_t(t));
  w.u32(uint32_t(payload.size()));
  w.u32(0);
  w.bytes(payload.data(), payload.size());
  return std::move(w.buf());
}

std::vector<uint8_t> encode_hello_payload(const Hello& h) {
  int lg = log2_mtu(h.mtu);
  if (lg < 0) throw Error("wire: encode_hello: mtu=" + std::to_string(h.mtu) + " is not 256..4096 power of two");
  Writer w;
  w.u32(h.qpn);
  w.u32(h.psn);
  w.u16(h.lid);
  w.u8(uint8_t(lg));
  w.u8(h.port);
  w.bytes(h.gid.data(), 16);
  w.u32(h.flags);
  detail::write_regions(w, h.regions);
  return std::move(w.buf());
}

std::vector<uint8_t> encode_hello(const Hello& h) { return encode_frame(FrameType::kHello, encode_hello_payload(h)); }

std::vector<uint8_t> encode_ready() { return encode_frame(FrameType::kReady, {}); }

std::vector<uint8_t> encode_reject(const std::string& reason) {
  std::string r = reason.substr(0, 4096);
  return encode_frame(FrameType::kReject, std::vector<uint8_t>(r.begin(), r.end()));
}

Header parse_header(const uint8_t* data, size_t len) {
  Reader r(data, len, "frame header");
  uint32_t magic = r.u32("magic");
  if (magic != kMagic) throw Error("wire: bad magic 0x" + [&] {
      char b[16]; std::snprintf(b, sizeof b, "%08x", magic); return std::string(b); }() +
      " (expected 0x4c584948 'HIXL'): not a hixl peer");
  Header h;
  h.version = r.u16("version");
  if (h.version != kVersion)
    throw Error("wire: unsupported protocol version " + std::to_string(h.version) + " (this build speaks " +
                std::to_string(kVersion) + ")");
  uint16_t t = r.u16("type");
  if (t < uint16_t(FrameType::kHello) || t > uint16_t(kLastFrameType))
    throw Error("wire: unknown frame type " + std::to_string(t));
  h.type = FrameType(t);
  h.payload_len = r.u32("payload_len");
  if (h.payload_len > kMaxPayload)
    throw Error("wire: payload_len " + std::to_string(h.payload_len) + " exceeds the limit of " +
                std::to_string(kMaxPayload));
  if (r.u32("reserved") != 0) throw Error("wire: reserved header field is not zero");
  return h;
}

void check_payload_len(const Header& h, uint32_t max_payload) {
  if (h.payload_len > max_payload)
    throw Error("wire: frame type " + std::to_string(int(h.type)) + " announces a " + std::to_string(h.payload_len) +
                "-byte payload; at most " + std::to_string(max_payload) + " bytes are accepted here");
}

const char* frame_type_name(FrameType t) {
  switch (t) {
    case FrameType::kHello: return "Hello";
    case FrameType::kReady: return "Ready";
    case FrameType::kReject: return "Reject";
    case FrameType::kConnect: return "Connect";
    case FrameType::kAccept: return "Accept";
    case FrameType::kRefuse: return "Refuse";
    case FrameType::kNotify: return "Notify";
    case FrameType::kNotifyAck: return "NotifyAck";
    case FrameType::kRegions: return "Regions";
    case FrameType::kRegionsReq: return "RegionsReq";
    case FrameType::kAbort: return "Abort";
    case FrameType::kAbortAck: return "AbortAck";
    case FrameType::kBye: return "Bye";
    case FrameType::kAttach: return "Attach";
    case FrameType::kFlag: return "Flag";
    case FrameType::kAuthHello: return "AuthHello";
    case FrameType::kAuthChallenge: return "AuthChallenge";
    case FrameType::kAuthProof: return "AuthProof";
    case FrameType::kPing: return "Ping";
    case FrameType::kPong: return "Pong";
    case FrameType::kFlagFailed: return "FlagFailed";
  }
  return "?";
}

Hello parse_hello(const uint8_t* data, size_t len) {
  Reader r(data, len, "hello");
  Hello h;
  h.qpn = r.u32("qpn");
  if (h.qpn == 0 || h.qpn > 0xffffff) throw Error("wire: hello: qpn " + std::to_string(h.qpn) + " out of range");
  h.psn = r.u32("psn");
  if (h.psn > 0xffffff) throw Error("wire: hello: psn " + std::to_string(h.psn) + " exceeds 24 bits");
  h.lid = r.u16("lid");
  uint8_t lg = r.u8("mtu");
  if (lg < 8 || lg > 12) throw Error("wire: hello: mtu log2 " + std::to_string(lg) + " not in 8..12");
  h.mtu = uint16_t(1u << lg);
  h.port = r.u8("port");
  if (h.port == 0) throw Error("wire: hello: port 0 is invalid");
  r.bytes(h.gid.data(), 16, "gid");
  h.flags = r.u32("flags");
  h.regions = detail::read_regions(r, "hello");
  if (r.remaining() != 0)
    throw Error("wire: hello: " + std::to_string(r.remaining()) + " trailing bytes after " +
                std::to_string(h.regions.size()) + " regions");
  return h;
}

Hello parse_hello_frame(const uint8_t* data, size_t len) {
  Header h = parse_header(data, len);
  if (h.type != FrameType::kHello) throw Error("wire: expected a hello frame, got type " + std::to_string(int(h.type)));
  if (len - kHeaderSize != h.payload_len)
    throw Error("wire: frame is " + std::to_string(len) + " bytes but its header announces " +
                std::to_string(kHeaderSize + h.payload_len));
  return parse_hello(data + kHeaderSize, h.payload_len);
}

}  // namespace hixl::wire
