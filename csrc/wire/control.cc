#include "wire/control.h"

#include "verbs/error.h"
#include "wire/codec.h"

namespace hixl::wire {

using detail::Reader;
using detail::Writer;

namespace {

void put_str(Writer& w, const std::string& s) {
  w.u32(uint32_t(s.size()));
  w.bytes(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

std::string get_str(Reader& r, size_t max, const char* field) {
  uint32_t n = r.u32(field);
  if (n > max)
    throw Error(std::string("wire: control: ") + field + " of " + std::to_string(n) + " bytes exceeds the " +
                std::to_string(max) + "-byte limit");
  r.need(n, field);
  std::string s(n, '\0');
  r.bytes(reinterpret_cast<uint8_t*>(s.data()), n, field);
  return s;
}

void put_extents(Writer& w, const std::vector<Extent>& v) {
  w.u32(uint32_t(v.size()));
  for (const auto& e : v) {
    w.u64(e.addr);
    w.u64(e.len);
    w.u64(e.offset);
    w.u32(e.fd);
    w.u32(0);
  }
}

std::vector<Extent> get_extents(Reader& r) {
  uint32_t n = r.u32("extent_count");
  if (n > kMaxExtents || uint64_t(n) * 32 > r.remaining())
    throw Error("wire: control: extent_count " + std::to_string(n) + " does not fit the frame");
  std::vector<Extent> v(n);
  for (auto& e : v) {
    e.addr = r.u64("extent.addr");
    e.len = r.u64("extent.len");
    e.offset = r.u64("extent.offset");
    e.fd = r.u32("extent.fd");
    if (r.u32("extent.reserved") != 0) throw Error("wire: control: extent reserved field is not zero");
    if (e.len == 0 || e.addr + e.len < e.addr) throw Error("wire: control: empty or wrapping extent");
  }
  return v;
}

bool is_control(FrameType t) { return uint16_t(t) >= uint16_t(FrameType::kConnect) && t <= kLastFrameType; }

}  // namespace

const char* transport_name(Transport t) {
  switch (t) {
    case Transport::kNone: return "none";
    case Transport::kRdma: return "rdma";
    case Transport::kShm: return "shm";
    case Transport::kTcp: return "tcp";
  }
  return "unknown";
}

std::vector<uint8_t> encode_control(const Control& c) {
  if (!is_control(c.type)) throw Error("wire: encode_control: frame type " + std::to_string(int(c.type)) +
                                       " is not a control frame");
  if (c.name.size() > kMaxName || c.text.size() > kMaxText)
    throw Error("wire: encode_control: name (" + std::to_string(c.name.size()) + " bytes) or text (" +
                std::to_string(c.text.size()) + " bytes) too long");
  Writer w;
  switch (c.type) {
    case FrameType::kConnect:
    case FrameType::kAccept: {
      w.u32(uint32_t(c.transport));
      w.u32(c.offers);
      w.u64(c.instance);
      w.u64(c.version);
      put_str(w, c.name);
      put_str(w, c.boot_id);
      w.u32(c.pid);
      w.u64(c.probe_addr);
      w.u64(c.probe_value);
      std::vector<uint8_t> hello;
      if (c.hello) hello = encode_hello_payload(*c.hello);
      w.u32(uint32_t(hello.size()));
      w.bytes(hello.data(), hello.size());
      put_extents(w, c.extents);
      detail::write_regions(w, c.regions);
      w.u64(c.link);
      w.u32(c.fence_fd);
      if (c.more_qps.size() > kMaxMoreQps) throw Error("wire: control: " + std::to_string(c.more_qps.size()) + " further queue pairs (at most " + std::to_string(kMaxMoreQps) + ")");
      w.u32(uint32_t(c.more_qps.size()));
      for (const auto& [qpn, psn] : c.more_qps) {
        w.u32(qpn);
        w.u32(psn);
      }
      break;
    }
    case FrameType::kRefuse: w.u32(c.status); put_str(w, c.text); break;
    case FrameType::kNotify: w.u64(c.seq); put_str(w, c.name); put_str(w, c.text); break;
    case FrameType::kNotifyAck: w.u64(c.seq); w.u32(c.status); break;
    case FrameType::kRegions:
      w.u64(c.seq);
      w.u64(c.version);
      detail::write_regions(w, c.regions);
      put_extents(w, c.extents);
      break;
    case FrameType::kRegionsReq:
    case FrameType::kAbortAck: w.u64(c.seq); break;
    case FrameType::kAbort: w.u64(c.seq); put_str(w, c.text); break;
    case FrameType::kBye: put_str(w, c.text); break;
    case FrameType::kAttach: w.u64(c.instance); put_str(w, c.name); w.u32(c.direction); w.u64(c.link); break;
    case FrameType::kFlag: w.u32(c.status); break;
    case FrameType::kFlagFailed: w.u32(c.status); put_str(w, c.text); break;
    case FrameType::kAuthHello: w.u32(c.scheme); w.bytes(c.nonce.data(), c.nonce.size()); break;
    case FrameType::kAuthChallenge: w.bytes(c.nonce.data(), c.nonce.size()); break;
    case FrameType::kAuthProof: w.bytes(c.proof.data(), c.proof.size()); break;
    case FrameType::kPing:
    case FrameType::kPong: break;  // empty
    default: break;
  }
  return encode_frame(c.type, w.buf());
}

Control parse_control(FrameType type, const uint8_t* payload, size_t len) {
  if (!is_control(type)) throw Error("wire: control: unexpected frame type " + std::to_string(int(type)));
  Reader r(payload, len, "control frame");
  Control c;
  c.type = type;
  switch (type) {
    case FrameType::kConnect:
    case FrameType::kAccept: {
      uint32_t t = r.u32("transport");
      if (t > uint32_t(kLastTransport)) throw Error("wire: control: unknown transport " + std::to_string(t));
      c.transport = Transport(t);
      c.offers = r.u32("offers");
      c.instance = r.u64("instance");
      c.version = r.u64("version");
      c.name = get_str(r, kMaxName, "name");
      c.boot_id = get_str(r, 64, "boot_id");
      c.pid = r.u32("pid");
      c.probe_addr = r.u64("probe_addr");
      c.probe_value = r.u64("probe_value");
      uint32_t n = r.u32("hello_len");
      r.need(n, "hello");
      if (n) {
        std::vector<uint8_t> h(n);
        r.bytes(h.data(), n, "hello");
        c.hello = parse_hello(h.data(), n);
      }
      c.extents = get_extents(r);
      c.regions = detail::read_regions(r, "connect regions");
      c.link = r.u64("link");
      c.fence_fd = r.u32("fence_fd");
      const uint32_t m = r.u32("more_qps");
      if (m > kMaxMoreQps || (m && !c.hello))
        throw Error("wire: control: " + std::to_string(m) + " further queue pairs" +
                    (c.hello ? " (at most " + std::to_string(kMaxMoreQps) + ")" : " without a first one"));
      for (uint32_t i = 0; i < m; ++i) {
        const uint32_t qpn = r.u32("more_qps qpn");
        c.more_qps.emplace_back(qpn, r.u32("more_qps psn"));
      }
      break;
    }
    case FrameType::kRefuse: c.status = r.u32("status"); c.text = get_str(r, kMaxText, "reason"); break;
    case FrameType::kNotify:
      c.seq = r.u64("seq");
      c.name = get_str(r, kMaxName, "notify name");
      c.text = get_str(r, kMaxText, "notify message");
      break;
    case FrameType::kNotifyAck: c.seq = r.u64("seq"); c.status = r.u32("status"); break;
    case FrameType::kRegions:
      c.seq = r.u64("seq");
      c.version = r.u64("version");
      c.regions = detail::read_regions(r, "regions");
      c.extents = get_extents(r);
      break;
    case FrameType::kRegionsReq:
    case FrameType::kAbortAck: c.seq = r.u64("seq"); break;
    case FrameType::kAbort: c.seq = r.u64("seq"); c.text = get_str(r, kMaxText, "reason"); break;
    case FrameType::kBye: c.text = get_str(r, kMaxText, "reason"); break;
    case FrameType::kAttach:
      c.instance = r.u64("instance");
      c.name = get_str(r, kMaxName, "name");
      c.direction = r.u32("direction");
      if (c.direction > 1) throw Error("wire: control: attach direction " + std::to_string(c.direction));
      c.link = r.u64("link");
      break;
    case FrameType::kFlag: c.status = r.u32("flag"); break;
    case FrameType::kFlagFailed: c.status = r.u32("flag"); c.text = get_str(r, kMaxText, "reason"); break;
    case FrameType::kAuthHello:
      c.scheme = r.u32("scheme");
      r.bytes(c.nonce.data(), c.nonce.size(), "nonce");
      break;
    case FrameType::kAuthChallenge: r.bytes(c.nonce.data(), c.nonce.size(), "nonce"); break;
    case FrameType::kAuthProof: r.bytes(c.proof.data(), c.proof.size(), "proof"); break;
    default: break;
  }
  if (r.remaining() != 0)
    throw Error("wire: control: " + std::to_string(r.remaining()) + " trailing bytes in frame type " +
                std::to_string(int(type)));
  return c;
}

Control parse_control_frame(const uint8_t* data, size_t len) {
  Header h = parse_header(data, len);
  if (len - kHeaderSize != h.payload_len)
    throw Error("wire: frame is " + std::to_string(len) + " bytes but its header announces " +
                std::to_string(kHeaderSize + h.payload_len));
  return parse_control(h.type, data + kHeaderSize, h.payload_len);
}

}  // namespace hixl::wire
