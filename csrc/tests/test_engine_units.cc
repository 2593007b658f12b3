// Engine building blocks that need no device: the region table (local/remote range lookup that
// gates every transfer), the control-channel frames, and the progress thread's incremental reader
// of them (wire::FrameReader).
#include <algorithm>
#include <random>

#include "check.h"
#include "engine/region_table.h"
#include "verbs/async_events.h"
#include "verbs/error.h"
#include "wire/control.h"
#include "wire/frame_reader.h"

using namespace hixl;
using engine::RegionEntry;
using engine::RegionTable;

namespace {

constexpr uint32_t kRW = wire::kRemoteRead | wire::kRemoteWrite;

void region_table() {
  RegionTable t;
  CHECK(t.find(0x1000, 1, 0) == nullptr);  // empty
  t.insert({0x1000, 0x1000, 11, kRW, 1});
  t.insert({0x4000, 0x100, 22, wire::kRemoteRead, 2});
  // Inside, exact bounds, one byte over either end.
  CHECK(t.find(0x1000, 0x1000, 0) && t.find(0x1000, 0x1000, 0)->key == 11);
  CHECK(t.find(0x1fff, 1, kRW) && t.find(0x1fff, 1, kRW)->id == 1);
  CHECK(t.find(0x1fff, 2, 0) == nullptr);
  CHECK(t.find(0xfff, 2, 0) == nullptr);
  CHECK(t.find(0x2000, 1, 0) == nullptr);
  CHECK(t.find(0x1000, 0, 0) == nullptr);                  // empty range never matches
  CHECK(t.find(~0ull - 1, 4, 0) == nullptr);               // wrapping range never matches
  // Access bits: region 2 is read-only.
  CHECK(t.find(0x4000, 0x100, wire::kRemoteRead) && t.find(0x4000, 0x100, wire::kRemoteRead)->key == 22);
  CHECK(t.find(0x4000, 0x100, wire::kRemoteWrite) == nullptr);
  // Overlapping regions: a big one starting earlier still covers a range past a small later one.
  t.insert({0x0, 0x100000, 33, kRW, 3});
  CHECK(t.find(0x3000, 0x1000, 0) && t.find(0x3000, 0x1000, 0)->key == 33);
  CHECK(t.find(0x4000, 0x100, wire::kRemoteWrite) && t.find(0x4000, 0x100, wire::kRemoteWrite)->key == 33);
  CHECK(t.erase(3));
  CHECK(!t.erase(3));
  CHECK(t.find(0x3000, 0x1000, 0) == nullptr);  // max_len recomputed after erase
  CHECK_EQ(t.size(), size_t(2));
  // assign() sorts; lookups against a brute-force oracle on random tables.
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<RegionEntry> v;
    int n = int(rng() % 20);
    for (int i = 0; i < n; ++i)
      v.push_back({rng() % 100000, 1 + rng() % 5000, uint32_t(i), uint32_t(rng() % 4), uint64_t(i)});
    t.assign(v);
    for (int q = 0; q < 200; ++q) {
      uint64_t a = rng() % 110000, len = rng() % 3000;
      uint32_t need = uint32_t(rng() % 4);
      bool oracle = false;
      for (auto& e : v)
        if (len && a >= e.addr && a + len <= e.addr + e.len && (e.access & need) == need) oracle = true;
      const RegionEntry* got = t.find(a, len, need);
      CHECK_EQ(got != nullptr, oracle);
      if (got) CHECK(a >= got->addr && a + len <= got->addr + got->len && (got->access & need) == need);
    }
  }
}

wire::Hello hello_with(size_t regions) {
  wire::Hello h;
  h.qpn = 0x1234;
  h.psn = 77;
  h.mtu = 1024;
  h.gid[15] = 1;
  for (size_t i = 0; i < regions; ++i) h.regions.push_back({0x1000 * (i + 1), 4096, uint32_t(i + 5), kRW});
  return h;
}

std::vector<wire::Control> samples() {
  std::vector<wire::Control> v;
  wire::Control c;
  c.type = wire::FrameType::kConnect; c.transport = wire::Transport::kRdma; c.name = "10.0.0.1:26000";
  c.instance = 0x0123456789abcdefull; c.version = 7; c.offers = 0xe; c.boot_id = "d47c590a-d893";
  c.pid = 4242; c.probe_addr = 0x7fff0000; c.probe_value = 99; c.link = 0xfeedface12345678ull; c.extents = {{0x1000, 4096, 8192, 17}};
  c.regions = hello_with(2).regions; c.hello = hello_with(3); v.push_back(c);
  c.type = wire::FrameType::kAccept; c.more_qps = {{0x11, 7}, {0xffffff, 0xabcdef}}; v.push_back(c);  // striped
  c.more_qps = {};
  c = {}; c.type = wire::FrameType::kAccept; c.transport = wire::Transport::kNone; c.name = "[::1]:5"; v.push_back(c);
  c = {}; c.type = wire::FrameType::kRefuse; c.status = 103903; c.text = "already connected"; v.push_back(c);
  c = {}; c.type = wire::FrameType::kNotify; c.seq = 9; c.name = "layer"; c.text = std::string(1024, 'x'); v.push_back(c);
  c = {}; c.type = wire::FrameType::kNotifyAck; c.seq = 9; c.status = 203900; v.push_back(c);
  c = {}; c.type = wire::FrameType::kRegions; c.seq = 0; c.version = 42; c.regions = hello_with(4).regions;
  c.extents = {{0x2000, 4096, 0, 5}, {0x9000, 100, 4096, 6}}; v.push_back(c);
  c = {}; c.type = wire::FrameType::kAttach; c.instance = 5; c.name = "1.2.3.4:5"; c.direction = 1; c.link = 0x5eed; v.push_back(c);
  c = {}; c.type = wire::FrameType::kFlag; c.status = 0xdeadbeef; v.push_back(c);
  c = {}; c.type = wire::FrameType::kRegionsReq; c.seq = 3; v.push_back(c);
  c = {}; c.type = wire::FrameType::kAbort; c.seq = 4; c.text = "timeout"; v.push_back(c);
  c = {}; c.type = wire::FrameType::kAbortAck; c.seq = 4; v.push_back(c);
  c = {}; c.type = wire::FrameType::kBye; c.text = "bye"; v.push_back(c);
  c = {}; c.type = wire::FrameType::kAuthHello; c.scheme = 1;
  for (size_t i = 0; i < c.nonce.size(); ++i) c.nonce[i] = uint8_t(i + 1);
  v.push_back(c);
  c = {}; c.type = wire::FrameType::kAuthChallenge; c.nonce.fill(0xa5); v.push_back(c);
  c = {}; c.type = wire::FrameType::kAuthProof; c.proof.fill(0x5a); c.proof[0] = 1; v.push_back(c);
  c = {}; c.type = wire::FrameType::kPing; v.push_back(c);
  c = {}; c.type = wire::FrameType::kPong; v.push_back(c);
  c = {}; c.type = wire::FrameType::kFlagFailed; c.status = 42; c.text = "push failed: WR_FLUSH_ERR"; v.push_back(c);
  return v;
}

void control_frames() {
  for (const auto& c : samples()) {
    auto f = wire::encode_control(c);
    wire::Control d = wire::parse_control_frame(f.data(), f.size());
    CHECK(d.type == c.type);
    CHECK_EQ(d.seq, c.seq);
    CHECK_EQ(d.instance, c.instance);
    CHECK_EQ(d.version, c.version);
    CHECK_EQ(d.status, c.status);
    CHECK(d.transport == c.transport);
    CHECK_EQ(d.name, c.name);
    CHECK_EQ(d.text, c.text);
    CHECK_EQ(d.hello.has_value(), c.hello.has_value());
    if (c.hello) CHECK(d.hello->regions == c.hello->regions && d.hello->qpn == c.hello->qpn);
    CHECK(d.regions == c.regions);
    CHECK(d.extents == c.extents);
    CHECK_EQ(d.offers, c.offers);
    CHECK_EQ(d.boot_id, c.boot_id);
    CHECK_EQ(d.pid, c.pid);
    CHECK_EQ(d.probe_addr, c.probe_addr);
    CHECK_EQ(d.probe_value, c.probe_value);
    CHECK_EQ(d.direction, c.direction);
    CHECK_EQ(d.link, c.link);
    CHECK(d.more_qps == c.more_qps);
    CHECK_EQ(d.scheme, c.scheme);
    CHECK(d.nonce == c.nonce && d.proof == c.proof);
    // Every truncation of the payload is refused with an error, never a crash or a short read.
    const size_t payload = f.size() - wire::kHeaderSize;
    for (size_t cut = 0; cut < payload; ++cut) {
      bool threw = false;
      try {
        wire::parse_control(c.type, f.data() + wire::kHeaderSize, cut);
      } catch (const Error&) {
        threw = true;
      }
      CHECK(threw);
    }
    // Trailing bytes are refused too.
    std::vector<uint8_t> longer(f.begin() + wire::kHeaderSize, f.end());
    longer.push_back(0);
    CHECK_THROWS_WITH(wire::parse_control(c.type, longer.data(), longer.size()), "trailing");
  }
  // A string length larger than the limit is refused before anything is allocated.
  {
    wire::Control c;
    c.type = wire::FrameType::kBye;
    auto f = wire::encode_control(c);
    f[wire::kHeaderSize + 3] = 0x7f;  // reason length ~2 GiB
    CHECK_THROWS_WITH(wire::parse_control(c.type, f.data() + wire::kHeaderSize, f.size() - wire::kHeaderSize),
                      "exceeds the");
  }
  {
    wire::Control c;
    c.type = wire::FrameType::kNotify;
    c.name = std::string(wire::kMaxName + 1, 'n');
    CHECK_THROWS_WITH(wire::encode_control(c), "too long");
  }
  // Unknown transport, non-control types.
  {
    auto f = wire::encode_control(samples()[0]);
    f[wire::kHeaderSize] = 9;
    CHECK_THROWS_WITH(wire::parse_control_frame(f.data(), f.size()), "unknown transport 9");
    wire::Control att;
    att.type = wire::FrameType::kAttach;
    att.name = "1.2.3.4:5";
    auto a = wire::encode_control(att);
    a[a.size() - 12] = 2;  // the direction: u32 before the trailing u64 link
    CHECK_THROWS_WITH(wire::parse_control_frame(a.data(), a.size()), "attach direction 2");
    // Further queue pairs: at most kMaxMoreQps, and only beside a first one.
    wire::Control q = samples()[0];
    q.more_qps.assign(wire::kMaxMoreQps + 1, {1, 1});
    CHECK_THROWS_WITH(wire::encode_control(q), "at most 15");
    q.more_qps.assign(1, {1, 1});
    q.hello.reset();
    auto qf = wire::encode_control(q);
    CHECK_THROWS_WITH(wire::parse_control_frame(qf.data(), qf.size()), "without a first one");
    q = samples()[0];
    q.more_qps.assign(1, {1, 1});
    qf = wire::encode_control(q);
    qf[qf.size() - 12] = uint8_t(wire::kMaxMoreQps + 1);  // the count, before the one {qpn, psn}
    CHECK_THROWS_WITH(wire::parse_control_frame(qf.data(), qf.size()), "16 further queue pairs");
    wire::Control h;
    h.type = wire::FrameType::kHello;
    CHECK_THROWS_WITH(wire::encode_control(h), "not a control frame");
    CHECK_THROWS_WITH(wire::parse_control(wire::FrameType::kReady, nullptr, 0), "unexpected frame type");
  }
  // Bounded mutation fuzz: parses or throws hixl::Error, nothing else.
  std::mt19937 rng(99);
  auto all = samples();
  for (int i = 0; i < 20000; ++i) {
    auto f = wire::encode_control(all[rng() % all.size()]);
    int flips = 1 + int(rng() % 6);
    for (int k = 0; k < flips; ++k) f[rng() % f.size()] = uint8_t(rng());
    f.resize(rng() % (f.size() + 8), uint8_t(rng()));
    try {
      wire::parse_control_frame(f.data(), f.size());
    } catch (const Error&) {
    }
  }
}

// Feeds `stream` to r in chunks of the given sizes (cycled); returns the frames that came out.
std::vector<wire::Frame> feed_all(wire::FrameReader& r, const std::vector<uint8_t>& stream,
                                  const std::vector<size_t>& chunks) {
  std::vector<wire::Frame> out;
  size_t off = 0, i = 0;
  while (off < stream.size()) {
    const size_t n = std::min(chunks[i++ % chunks.size()], stream.size() - off);
    size_t used = 0;
    while (used < n) {  // as the engine does: every frame of one read, in order
      used += r.feed(stream.data() + off + used, n - used);
      if (r.has_frame()) out.push_back(r.take());
    }
    off += n;
  }
  return out;
}

std::vector<uint8_t> header_bytes(uint32_t magic, uint16_t type, uint32_t payload_len) {
  std::vector<uint8_t> h(wire::kHeaderSize, 0);
  auto put = [&](size_t at, uint64_t v, int n) { for (int i = 0; i < n; ++i) h[at + i] = uint8_t(v >> (8 * i)); };
  put(0, magic, 4);
  put(4, wire::kVersion, 2);
  put(6, type, 2);
  put(8, payload_len, 4);
  return h;
}

void frame_reader() {
  // Every control frame type, back to back, as one stream.
  std::vector<std::vector<uint8_t>> frames;
  std::vector<uint8_t> stream;
  for (const auto& c : samples()) {
    frames.push_back(wire::encode_control(c));
    stream.insert(stream.end(), frames.back().begin(), frames.back().end());
  }
  auto same = [&](const std::vector<wire::Frame>& got) {
    CHECK_EQ(got.size(), frames.size());
    for (size_t i = 0; i < got.size() && i < frames.size(); ++i) {
      CHECK(got[i].header.type == wire::FrameType(frames[i][6] | frames[i][7] << 8));
      CHECK_EQ(got[i].header.payload_len, frames[i].size() - wire::kHeaderSize);
      CHECK(std::equal(got[i].payload.begin(), got[i].payload.end(), frames[i].begin() + wire::kHeaderSize,
                       frames[i].end()));
    }
  };
  // Byte by byte: nothing comes out before a frame's last byte, and the pending count follows.
  {
    wire::FrameReader r;
    std::vector<wire::Frame> got;
    size_t in_frame = 0, f = 0;
    for (size_t off = 0; off < stream.size(); ++off) {
      CHECK_EQ(r.feed(&stream[off], 1), size_t(1));
      ++in_frame;
      const bool last = in_frame == frames[f].size();
      CHECK_EQ(r.has_frame(), last);
      CHECK_EQ(r.pending_bytes(), in_frame);
      CHECK_EQ(r.pending_header().has_value(), in_frame >= wire::kHeaderSize);
      if (last) {
        CHECK_EQ(r.feed(&stream[off], 1), size_t(0));  // a complete frame takes nothing more until taken
        got.push_back(r.take());
        CHECK_EQ(r.pending_bytes(), size_t(0));
        in_frame = 0;
        ++f;
      }
    }
    same(got);
  }
  // The whole stream in one read: every frame of it comes out, in order.
  {
    wire::FrameReader r;
    same(feed_all(r, stream, {stream.size()}));
    CHECK_EQ(r.pending_bytes(), size_t(0));
  }
  // Chunks that cut headers and payloads anywhere.
  for (auto chunks : std::vector<std::vector<size_t>>{{3}, {7, 1}, {15, 17, 2}, {16}, {100, 5}, {4096}}) {
    wire::FrameReader r;
    same(feed_all(r, stream, chunks));
  }
  // A frame left incomplete says what is pending.
  {
    wire::Control n;
    n.type = wire::FrameType::kNotify;
    n.seq = 1;
    n.name = "n";
    n.text = "m";
    auto f = wire::encode_control(n);
    wire::FrameReader r;
    r.feed(f.data(), 7);
    CHECK_EQ(r.describe_pending(), std::string("7 of the 16 header bytes"));
    r.feed(f.data() + 7, wire::kHeaderSize - 7 + 5);
    CHECK_EQ(r.describe_pending(), "5 of the " + std::to_string(f.size() - wire::kHeaderSize) +
                                       " payload bytes of a Notify frame (type 7)");
    CHECK(!r.has_frame());
    CHECK_THROWS_WITH(r.take(), "without a complete frame");
  }
  // Oversized: refused as soon as the header is complete, before anything is allocated for it.
  {
    wire::FrameReader r;
    auto h = header_bytes(wire::kMagic, uint16_t(wire::FrameType::kRegions), wire::kMaxPayload + 1);
    CHECK_EQ(r.feed(h.data(), wire::kHeaderSize - 1), wire::kHeaderSize - 1);  // not yet complete
    CHECK_THROWS_WITH(r.feed(&h[wire::kHeaderSize - 1], 1), "exceeds the limit");
    CHECK_EQ(r.held_bytes(), size_t(0));
    CHECK_THROWS_WITH(r.feed(h.data(), 1), "exceeds the limit");  // failed for good
  }
  {
    wire::FrameReader r(64);  // a reader's own, smaller bound (as recv_payload's max_payload)
    auto h = header_bytes(wire::kMagic, uint16_t(wire::FrameType::kNotify), 65);
    CHECK_THROWS_WITH(r.feed(h.data(), h.size()), "at most 64 bytes");
    CHECK_EQ(r.held_bytes(), size_t(0));
  }
  // A large frame announced, little of it sent: the memory held follows what arrived.
  {
    wire::FrameReader r;
    auto h = header_bytes(wire::kMagic, uint16_t(wire::FrameType::kRegions), wire::kMaxPayload);
    std::vector<uint8_t> bytes(h);
    bytes.resize(bytes.size() + 10, 0xab);
    CHECK_EQ(r.feed(bytes.data(), bytes.size()), bytes.size());
    CHECK(r.held_bytes() <= 10);
    std::vector<uint8_t> more(100000, 0xcd);
    CHECK_EQ(r.feed(more.data(), more.size()), more.size());
    CHECK(r.held_bytes() <= 2 * (10 + more.size()));
    CHECK(!r.has_frame());
  }
  // Bad magic, version, type, reserved field: refused at the header's last byte, for good.
  {
    auto good = header_bytes(wire::kMagic, uint16_t(wire::FrameType::kPing), 0);
    wire::FrameReader ok;
    CHECK_EQ(ok.feed(good.data(), good.size()), good.size());
    CHECK(ok.has_frame());  // an empty payload: complete with its header
    CHECK(ok.take().payload.empty());

    auto bad = header_bytes(0x50545448, uint16_t(wire::FrameType::kPing), 0);  // "HTTP"
    wire::FrameReader r;
    for (size_t i = 0; i + 1 < bad.size(); ++i) CHECK_EQ(r.feed(&bad[i], 1), size_t(1));
    CHECK_THROWS_WITH(r.feed(&bad[bad.size() - 1], 1), "bad magic");
    CHECK_THROWS_WITH(r.feed(good.data(), good.size()), "bad magic");
    auto v = good;
    v[4] = 9;
    wire::FrameReader rv;
    CHECK_THROWS_WITH(rv.feed(v.data(), v.size()), "unsupported protocol version 9");
    auto t = header_bytes(wire::kMagic, 999, 0);
    wire::FrameReader rt;
    CHECK_THROWS_WITH(rt.feed(t.data(), t.size()), "unknown frame type 999");
    auto z = good;
    z[12] = 1;
    wire::FrameReader rz;
    CHECK_THROWS_WITH(rz.feed(z.data(), z.size()), "reserved");
  }
}

}  // namespace

// What the engine acts on, and how the event is named in the reason it gives.
void async_event_names() {
  using hixl::verbs::AsyncEvent;
  AsyncEvent port{IBV_EVENT_PORT_ERR, 0, 1};
  CHECK(port.is_port_error() && !port.is_qp_error());
  CHECK(port.describe().rfind("IBV_EVENT_PORT_ERR", 0) == 0 && port.describe().find("on port 1") != std::string::npos);
  AsyncEvent qp{IBV_EVENT_QP_FATAL, 0x2a, 0};
  CHECK(qp.is_qp_error() && !qp.is_port_error());
  CHECK(qp.describe().rfind("IBV_EVENT_QP_FATAL", 0) == 0 && qp.describe().find("on QP 0x2a") != std::string::npos);
  AsyncEvent est{IBV_EVENT_COMM_EST, 7, 0};
  CHECK(!est.is_qp_error() && !est.is_port_error());
  AsyncEvent dev{IBV_EVENT_DEVICE_FATAL, 0, 0};
  CHECK(dev.is_port_error());
}

int main() {
  region_table();
  async_event_names();
  control_frames();
  frame_reader();
  return report("test_engine_units");
}
