// SHA-256 (FIPS 180-4) and HMAC-SHA-256 (RFC 2104), small and dependency-free: the engine's
// shared-secret handshake (auth/handshake.h) needs nothing more. Checked against the FIPS 180-4 and
// RFC 4231 vectors in csrc/tests/test_sha256.cc.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace hixl::auth {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const uint8_t* data, size_t len);
  void update(const std::string& s) { update(reinterpret_cast<const uint8_t*>(s.data()), s.size()); }
  Digest finish();  // the object is spent afterwards

 private:
  void block(const uint8_t* p);
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buf_{};
  size_t buf_len_ = 0;
  uint64_t total_ = 0;  // bytes
};

Digest sha256(const uint8_t* data, size_t len);

// HMAC-SHA-256 over the concatenation of `parts` (each a pointer + length).
struct Bytes {
  const uint8_t* data;
  size_t len;
};
Digest hmac_sha256(const uint8_t* key, size_t key_len, std::initializer_list<Bytes> parts);

// Compares in time independent of where the inputs differ.
bool equal_ct(const uint8_t* a, const uint8_t* b, size_t n);

// n bytes from the kernel's CSPRNG (getrandom(2)); throws hixl::Error when it fails.
void random_bytes(uint8_t* out, size_t n);

}  // namespace hixl::auth
