#include "wire/wire.h"

#include <cstdio>
#include <cstring>

#include "verbs/error.h"

namespace hixl::wire {
namespace {

class Writer {
 public:
  void u8(uint8_t v) { buf_.push_back(v); }
  void u16(uint16_t v) { for (int i = 0; i < 2; ++i) buf_.push_back(uint8_t(v >> (8 * i))); }
  void u32(uint32_t v) { for (int i = 0; i < 4; ++i) buf_.push_back(uint8_t(v >> (8 * i))); }
  void u64(uint64_t v) { for (int i = 0; i < 8; ++i) buf_.push_back(uint8_t(v >> (8 * i))); }
  void bytes(const uint8_t* p, size_t n) { buf_.insert(buf_.end(), p, p + n); }
  std::vector<uint8_t>& buf() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n, const char* what) : p_(p), n_(n), what_(what) {}
  void need(size_t k, const char* field) const {
    if (n_ - off_ < k)
      throw Error(std::string("wire: truncated ") + what_ + ": field '" + field + "' needs " + std::to_string(k) +
                  " bytes at offset " + std::to_string(off_) + ", frame has " + std::to_string(n_));
  }
  uint8_t u8(const char* f) { need(1, f); return p_[off_++]; }
  uint16_t u16(const char* f) { return uint16_t(le(2, f)); }
  uint32_t u32(const char* f) { return uint32_t(le(4, f)); }
  uint64_t u64(const char* f) { return le(8, f); }
  void bytes(uint8_t* out, size_t k, const char* f) { need(k, f); std::memcpy(out, p_ + off_, k); off_ += k; }
  size_t remaining() const { return n_ - off_; }

 private:
  uint64_t le(size_t k, const char* f) {
    need(k, f);
    uint64_t v = 0;
    for (size_t i = 0; i < k; ++i) v |= uint64_t(p_[off_ + i]) << (8 * i);
    off_ += k;
    return v;
  }
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
  const char* what_;
};

std::vector<uint8_t> frame(FrameType t, const std::vector<uint8_t>& payload) {
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

int log2_mtu(uint16_t mtu) {
  for (int k = 8; k <= 12; ++k) if (mtu == (1u << k)) return k;
  return -1;
}

}  // namespace

std::vector<uint8_t> encode_hello(const Hello& h) {
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
  w.u32(uint32_t(h.regions.size()));
  for (const Region& r : h.regions) {
    w.u64(r.addr);
    w.u64(r.len);
    w.u32(r.rkey);
    w.u32(r.access);
  }
  return frame(FrameType::kHello, w.buf());
}

std::vector<uint8_t> encode_ready() { return frame(FrameType::kReady, {}); }

std::vector<uint8_t> encode_reject(const std::string& reason) {
  std::string r = reason.substr(0, 4096);
  return frame(FrameType::kReject, std::vector<uint8_t>(r.begin(), r.end()));
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
  if (t < uint16_t(FrameType::kHello) || t > uint16_t(FrameType::kReject))
    throw Error("wire: unknown frame type " + std::to_string(t));
  h.type = FrameType(t);
  h.payload_len = r.u32("payload_len");
  if (h.payload_len > kMaxPayload)
    throw Error("wire: payload_len " + std::to_string(h.payload_len) + " exceeds the limit of " +
                std::to_string(kMaxPayload));
  if (r.u32("reserved") != 0) throw Error("wire: reserved header field is not zero");
  return h;
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
  uint32_t n = r.u32("region_count");
  // Validate the count against the bytes actually present before allocating anything.
  if (uint64_t(n) * kRegionSize != r.remaining())
    throw Error("wire: hello: region_count " + std::to_string(n) + " needs " +
                std::to_string(uint64_t(n) * kRegionSize) + " bytes, " + std::to_string(r.remaining()) +
                " present");
  h.regions.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    Region g;
    g.addr = r.u64("region.addr");
    g.len = r.u64("region.len");
    g.rkey = r.u32("region.rkey");
    g.access = r.u32("region.access");
    if (g.len == 0) throw Error("wire: hello: region " + std::to_string(i) + " has length 0");
    if (g.addr + g.len < g.addr) throw Error("wire: hello: region " + std::to_string(i) + " wraps the address space");
    if (g.access & ~uint32_t(kRemoteRead | kRemoteWrite))
      throw Error("wire: hello: region " + std::to_string(i) + " has unknown access bits");
    h.regions.push_back(g);
  }
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
