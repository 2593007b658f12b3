#include "auth/sha256.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "verbs/error.h"

namespace hixl::auth {
namespace {

constexpr uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

}  // namespace

Sha256::Sha256()
    : h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Sha256::block(const uint8_t* p) {
  uint32_t w[64];
  for (int t = 0; t < 16; ++t)
    w[t] = uint32_t(p[4 * t]) << 24 | uint32_t(p[4 * t + 1]) << 16 | uint32_t(p[4 * t + 2]) << 8 | p[4 * t + 3];
  for (int t = 16; t < 64; ++t) {
    uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int t = 0; t < 64; ++t) {
    uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kK[t] + w[t];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h_[0] += a; h_[1] += b; h_[2] += c; h_[3] += d;
  h_[4] += e; h_[5] += f; h_[6] += g; h_[7] += h;
}

void Sha256::update(const uint8_t* data, size_t len) {
  total_ += len;
  if (buf_len_) {
    size_t k = std::min(len, buf_.size() - buf_len_);
    std::memcpy(buf_.data() + buf_len_, data, k);
    buf_len_ += k;
    data += k;
    len -= k;
    if (buf_len_ < buf_.size()) return;
    block(buf_.data());
    buf_len_ = 0;
  }
  for (; len >= 64; data += 64, len -= 64) block(data);
  if (len) std::memcpy(buf_.data(), data, len);
  buf_len_ = len;
}

Digest Sha256::finish() {
  const uint64_t bits = total_ * 8;
  uint8_t pad[72] = {0x80};
  size_t k = (buf_len_ < 56 ? 56 : 120) - buf_len_;  // 1 bit, zeros, then the 64-bit length
  for (int i = 0; i < 8; ++i) pad[k + size_t(i)] = uint8_t(bits >> (56 - 8 * i));
  update(pad, k + 8);
  Digest out;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[size_t(4 * i + j)] = uint8_t(h_[size_t(i)] >> (24 - 8 * j));
  return out;
}

Digest sha256(const uint8_t* data, size_t len) {
  Sha256 s;
  s.update(data, len);
  return s.finish();
}

Digest hmac_sha256(const uint8_t* key, size_t key_len, std::initializer_list<Bytes> parts) {
  std::array<uint8_t, 64> k{};
  if (key_len > k.size()) {
    Digest d = sha256(key, key_len);
    std::memcpy(k.data(), d.data(), d.size());
  } else if (key_len) {
    std::memcpy(k.data(), key, key_len);
  }
  std::array<uint8_t, 64> ipad, opad;
  for (size_t i = 0; i < k.size(); ++i) {
    ipad[i] = k[i] ^ 0x36;
    opad[i] = k[i] ^ 0x5c;
  }
  Sha256 inner;
  inner.update(ipad.data(), ipad.size());
  for (const Bytes& b : parts) inner.update(b.data, b.len);
  Digest ih = inner.finish();
  Sha256 outer;
  outer.update(opad.data(), opad.size());
  outer.update(ih.data(), ih.size());
  return outer.finish();
}

bool equal_ct(const uint8_t* a, const uint8_t* b, size_t n) {
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff = uint8_t(diff | (a[i] ^ b[i]));
  return diff == 0;
}

void random_bytes(uint8_t* out, size_t n) {
  size_t off = 0;
  while (off < n) {
    ssize_t r = ::getrandom(out + off, n - off, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_errno("getrandom", errno);
    }
    off += size_t(r);
  }
}

}  // namespace hixl::auth
