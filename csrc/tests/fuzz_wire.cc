// libFuzzer target for the parsers of everything a peer sends, during a handshake and on a link:
// frame headers, endpoint Hello frames, engine control frames (Connect/Accept/Refuse/.../Auth*),
// and engine addresses. Built and run by ci/fuzz.sh (clang, -fsanitize=fuzzer,address,undefined).
//
// Each input is tried as (1) a whole control frame, (2) a whole Hello frame, (3) a control payload
// whose type the first byte picks, (4) an "ip:port" string, (5) a control stream read by
// wire::FrameReader (the engine's progress thread), fed whole and in chunks the input sizes: both
// readings must give the same frames, each the very bytes of the stream, and the same refusal.
// A parser may accept or throw
// hixl::Error; anything else (another exception, a sanitizer report, an allocation over
// -malloc_limit_mb) is a finding. What parses must encode back to the very same bytes: the format
// has one encoding per value, so a difference means a field was dropped or misread.
//
// Built with -DHIXL_FUZZ_SEEDS instead, main(dir) writes the seed corpus: valid frames of every type.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "transport/oob.h"
#include "verbs/error.h"
#include "wire/control.h"
#include "wire/frame_reader.h"
#include "wire/wire.h"

using namespace hixl;

namespace {

constexpr uint16_t kFirstControl = uint16_t(wire::FrameType::kConnect);
constexpr uint16_t kControlTypes = uint16_t(wire::kLastFrameType) - kFirstControl + 1;

void same_or_trap(const std::vector<uint8_t>& again, const uint8_t* data, size_t size, const char* what) {
  if (again.size() != size || (size && std::memcmp(again.data(), data, size) != 0)) {
    std::fprintf(stderr, "fuzz_wire: %s: %zu bytes parsed but encode back to %zu different bytes\n", what, size,
                 again.size());
    __builtin_trap();
  }
}

struct Reading {
  std::vector<wire::Frame> frames;
  std::string error;  // the refusal, if any
  size_t pending = 0;  // bytes of a frame left incomplete at the end
  size_t consumed = 0;
};

// Feeds data to a FrameReader in chunks (0: all at once; else sizes 1..64 drawn from the data) and
// takes every frame, as the engine does.
Reading read_stream(const uint8_t* data, size_t size, bool chunked) {
  Reading out;
  wire::FrameReader r;
  size_t i = 0;
  try {
    while (out.consumed < size) {
      size_t n = chunked ? 1 + data[i++ % size] % 64 : size;
      n = std::min(n, size - out.consumed);
      size_t used = 0;
      while (used < n) {
        used += r.feed(data + out.consumed + used, n - used);
        if (r.has_frame()) out.frames.push_back(r.take());
      }
      out.consumed += n;
    }
  } catch (const Error& e) {
    out.error = e.what();
  }
  out.pending = r.pending_bytes();
  return out;
}

void check_frame_reader(const uint8_t* data, size_t size) {
  const Reading whole = read_stream(data, size, false);
  const Reading chunks = read_stream(data, size, true);
  bool same = whole.frames.size() == chunks.frames.size() && whole.error == chunks.error;
  std::vector<uint8_t> again;
  for (size_t i = 0; same && i < whole.frames.size(); ++i) {
    const auto& a = whole.frames[i];
    const auto& b = chunks.frames[i];
    same = a.header.type == b.header.type && a.payload == b.payload;
    auto f = wire::encode_frame(a.header.type, a.payload);
    again.insert(again.end(), f.begin(), f.end());
  }
  if (!same) {
    std::fprintf(stderr, "fuzz_wire: FrameReader: %zu bytes read whole and in chunks differ (%zu vs %zu frames)\n",
                 size, whole.frames.size(), chunks.frames.size());
    __builtin_trap();
  }
  if (whole.error.empty()) {
    if (again.size() + whole.pending != size) __builtin_trap();  // every byte is in a frame or pending
    same_or_trap(again, data, again.size(), "FrameReader frames");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    wire::Control c = wire::parse_control_frame(data, size);
    same_or_trap(wire::encode_control(c), data, size, "control frame");
  } catch (const Error&) {
  }
  try {
    wire::Hello h = wire::parse_hello_frame(data, size);
    same_or_trap(wire::encode_hello(h), data, size, "hello frame");
  } catch (const Error&) {
  }
  if (size >= 1) {
    auto type = wire::FrameType(kFirstControl + data[0] % kControlTypes);
    try {
      wire::Control c = wire::parse_control(type, data + 1, size - 1);
      auto frame = wire::encode_control(c);
      std::vector<uint8_t> payload(frame.begin() + wire::kHeaderSize, frame.end());
      same_or_trap(payload, data + 1, size - 1, "control payload");
    } catch (const Error&) {
    }
  }
  try {
    oob::split_host_port(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const Error&) {
  }
  check_frame_reader(data, size);
  return 0;
}

#ifdef HIXL_FUZZ_SEEDS
namespace {

wire::Hello hello(size_t regions) {
  wire::Hello h;
  h.qpn = 0x11;
  h.psn = 0x22;
  h.mtu = 4096;
  h.gid[10] = h.gid[11] = 0xff;
  h.gid[12] = 192;
  for (size_t i = 0; i < regions; ++i)
    h.regions.push_back({0x7f0000001000ull * (i + 1), 4096, uint32_t(7 + i), wire::kRemoteRead | wire::kRemoteWrite});
  return h;
}

std::vector<wire::Control> controls() {
  std::vector<wire::Control> v;
  wire::Control c;
  c.type = wire::FrameType::kConnect;
  c.transport = wire::Transport::kRdma;
  c.offers = 0xe;
  c.instance = 0x0123456789abcdefull;
  c.version = 3;
  c.name = "10.0.0.1:26000";
  c.boot_id = "d47c590a-d893-4b53-b6b4-2f1a0a0c1d2e";
  c.pid = 4242;
  c.probe_addr = 0x7ffd0000;
  c.probe_value = 99;
  c.link = 0xfeedface12345678ull;
  c.hello = hello(1);
  c.extents = {{0x1000, 4096, 0, 17}};
  c.regions = hello(2).regions;
  v.push_back(c);
  c.type = wire::FrameType::kAccept;  // a striped rdma link: three further queue pairs
  c.more_qps = {{0x21, 5}, {0x22, 6}, {0xffffff, 0xffffff}};
  v.push_back(c);
  c.more_qps.clear();
  c.hello.reset();
  c.transport = wire::Transport::kTcp;
  v.push_back(c);
  c = {}; c.type = wire::FrameType::kRefuse; c.status = 503900; c.text = "authentication required"; v.push_back(c);
  c = {}; c.type = wire::FrameType::kNotify; c.seq = 9; c.name = "kv_ready"; c.text = "req-17"; v.push_back(c);
  c = {}; c.type = wire::FrameType::kNotifyAck; c.seq = 9; v.push_back(c);
  c = {}; c.type = wire::FrameType::kRegions; c.seq = 1; c.version = 4; c.regions = hello(3).regions;
  c.extents = {{0x2000, 100, 4096, 5}}; v.push_back(c);
  c = {}; c.type = wire::FrameType::kRegionsReq; c.seq = 2; v.push_back(c);
  c = {}; c.type = wire::FrameType::kAbort; c.seq = 3; c.text = "timeout"; v.push_back(c);
  c = {}; c.type = wire::FrameType::kAbortAck; c.seq = 3; v.push_back(c);
  c = {}; c.type = wire::FrameType::kBye; c.text = "bye"; v.push_back(c);
  c = {}; c.type = wire::FrameType::kAttach; c.instance = 5; c.name = "[::1]:5"; c.direction = 1; c.link = 0x5eed; v.push_back(c);
  c = {}; c.type = wire::FrameType::kFlag; c.status = 7; v.push_back(c);
  c = {}; c.type = wire::FrameType::kAuthHello; c.scheme = 1; c.nonce.fill(0x11); v.push_back(c);
  c = {}; c.type = wire::FrameType::kAuthChallenge; c.nonce.fill(0x22); v.push_back(c);
  c = {}; c.type = wire::FrameType::kAuthProof; c.proof.fill(0x33); v.push_back(c);
  c = {}; c.type = wire::FrameType::kPing; v.push_back(c);
  c = {}; c.type = wire::FrameType::kPong; v.push_back(c);
  c = {}; c.type = wire::FrameType::kFlagFailed; c.status = 9; c.text = "why"; v.push_back(c);
  return v;
}

void write(const std::string& dir, const std::string& name, const std::vector<uint8_t>& bytes) {
  std::string path = dir + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
    std::perror(path.c_str());
    std::exit(1);
  }
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int n = 0;
  for (const auto& c : controls()) {
    auto f = wire::encode_control(c);
    write(dir, "control-" + std::to_string(int(c.type)), f);
    std::vector<uint8_t> p{uint8_t(uint16_t(c.type) - kFirstControl)};
    p.insert(p.end(), f.begin() + wire::kHeaderSize, f.end());
    write(dir, "payload-" + std::to_string(int(c.type)), p);
    n += 2;
  }
  {
    std::vector<uint8_t> stream;  // every control frame back to back, the last one cut short
    for (const auto& c : controls()) {
      auto f = wire::encode_control(c);
      stream.insert(stream.end(), f.begin(), f.end());
    }
    stream.resize(stream.size() - 3);
    write(dir, "stream", stream), ++n;
  }
  for (size_t r : {0u, 1u, 5u}) write(dir, "hello-" + std::to_string(r), wire::encode_hello(hello(r))), ++n;
  write(dir, "ready", wire::encode_ready()), ++n;
  write(dir, "reject", wire::encode_reject("no")), ++n;
  for (const char* a : {"10.0.0.1:26000", "[fe80::1]:5", "127.0.0.1"}) {
    std::string s(a);
    write(dir, "addr-" + std::to_string(n), std::vector<uint8_t>(s.begin(), s.end())), ++n;
  }
  // Every seed must pass the target itself.
  for (const auto& c : controls()) {
    auto f = wire::encode_control(c);
    LLVMFuzzerTestOneInput(f.data(), f.size());
  }
  std::printf("fuzz_wire seeds: %d files in %s\n", n, dir.c_str());
  return 0;
}
#endif
