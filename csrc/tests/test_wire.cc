// Wire format and address parsing: round trips and every class of malformed input.
#include <cstring>
#include <random>

#include "tests/check.h"
#include "transport/oob.h"
#include "verbs/error.h"
#include "wire/wire.h"

using namespace hixl;

static wire::Hello sample(size_t regions) {
  wire::Hello h;
  h.qpn = 0x1234;
  h.psn = 0xabcdef;
  h.lid = 7;
  h.mtu = 4096;
  h.port = 1;
  for (int i = 0; i < 16; ++i) h.gid[size_t(i)] = uint8_t(i * 3);
  for (size_t i = 0; i < regions; ++i)
    h.regions.push_back({0x7f0000000000ull + i * 4096, 4096 + i, uint32_t(100 + i), wire::kRemoteRead | wire::kRemoteWrite});
  return h;
}

static void put_u32(std::vector<uint8_t>& f, size_t off, uint32_t v) {
  for (int i = 0; i < 4; ++i) f[off + size_t(i)] = uint8_t(v >> (8 * i));
}

int main() {
  // Round trip.
  for (size_t n : {0u, 1u, 17u}) {
    auto h = sample(n);
    auto f = wire::encode_hello(h);
    CHECK(f.size() == wire::kHeaderSize + wire::kHelloFixed + n * wire::kRegionSize);
    auto g = wire::parse_hello_frame(f.data(), f.size());
    CHECK(g.qpn == h.qpn && g.psn == h.psn && g.lid == h.lid && g.mtu == h.mtu && g.port == h.port);
    CHECK(g.gid == h.gid);
    CHECK(g.regions == h.regions);
  }
  // Every truncation of a valid frame is refused with an error, never a crash.
  auto good = wire::encode_hello(sample(3));
  for (size_t len = 0; len < good.size(); ++len) {
    bool threw = false;
    try { wire::parse_hello_frame(good.data(), len); } catch (const std::exception&) { threw = true; }
    CHECK(threw);
  }
  CHECK_THROWS_WITH(wire::parse_hello_frame(good.data(), 10), "truncated");
  {
    auto f = good; f[0] ^= 0xff;
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "bad magic");
  }
  {
    auto f = good; f[4] = 9;
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "unsupported protocol version 9");
  }
  {
    auto f = good; f[6] = 77;
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "unknown frame type 77");
  }
  {
    auto f = good; put_u32(f, 8, wire::kMaxPayload + 1);
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "exceeds the limit");
  }
  {
    auto f = good; put_u32(f, 8, uint32_t(f.size()));  // header announces more than present
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "announces");
  }
  {
    auto f = good; put_u32(f, 12, 1);
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "reserved");
  }
  // Region count inconsistent with the payload (the classic unbounded-allocation bug).
  {
    auto f = good; put_u32(f, wire::kHeaderSize + wire::kHelloFixed - 4, 0xffffffffu);
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "region_count 4294967295");
  }
  {
    auto f = good; f[wire::kHeaderSize + 10] = 3;  // mtu log2
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "mtu log2 3");
  }
  {
    auto f = good; put_u32(f, wire::kHeaderSize, 0);  // qpn 0
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "qpn 0 out of range");
  }
  {
    auto h = sample(1); h.regions[0].len = 0;
    auto f = wire::encode_hello(h);
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "length 0");
  }
  {
    auto h = sample(1); h.regions[0].addr = ~0ull - 10; h.regions[0].len = 100;
    auto f = wire::encode_hello(h);
    CHECK_THROWS_WITH(wire::parse_hello_frame(f.data(), f.size()), "wraps");
  }
  {
    auto h = sample(0); h.mtu = 1000;
    CHECK_THROWS_WITH(wire::encode_hello(h), "mtu=1000");
  }
  // Random garbage: bounded time, no crash, every outcome either parses or throws hixl::Error.
  std::mt19937 rng(1234);
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> f = good;
    int flips = 1 + int(rng() % 8);
    for (int k = 0; k < flips; ++k) f[rng() % f.size()] = uint8_t(rng());
    f.resize(rng() % (f.size() + 8), uint8_t(rng()));
    try { wire::parse_hello_frame(f.data(), f.size()); } catch (const hixl::Error&) {}
  }
  // Address parsing.
  CHECK((oob::split_host_port("10.0.0.1:26000") == std::pair<std::string, int>{"10.0.0.1", 26000}));
  CHECK((oob::split_host_port("[::1]:5") == std::pair<std::string, int>{"::1", 5}));
  CHECK((oob::split_host_port("10.0.0.1") == std::pair<std::string, int>{"10.0.0.1", -1}));
  CHECK((oob::split_host_port("fe80::1") == std::pair<std::string, int>{"fe80::1", -1}));
  CHECK((oob::split_host_port("[fe80::1]") == std::pair<std::string, int>{"fe80::1", -1}));
  CHECK_THROWS_WITH(oob::split_host_port(""), "empty");
  CHECK_THROWS_WITH(oob::split_host_port("1.2.3.4:"), "empty port");
  CHECK_THROWS_WITH(oob::split_host_port("1.2.3.4:99999"), "beyond 65535");
  CHECK_THROWS_WITH(oob::split_host_port("1.2.3.4:ab"), "not a number");
  CHECK_THROWS_WITH(oob::split_host_port("[::1"), "missing ']'");
  CHECK_THROWS_WITH(oob::split_host_port(":80"), "empty host");
  return report("test_wire");
}
