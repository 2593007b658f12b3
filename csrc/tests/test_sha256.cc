// SHA-256 against the FIPS 180-4 examples (and the NIST long-message vector), HMAC-SHA-256 against
// all seven RFC 4231 test cases; split updates must give the one-shot digest.
#include <string>
#include <vector>

#include "auth/sha256.h"
#include "check.h"

using namespace hixl;

namespace {

std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += d[p[i] >> 4];
    s += d[p[i] & 15];
  }
  return s;
}
std::string hex(const auth::Digest& d) { return hex(d.data(), d.size()); }

const uint8_t* u8(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

std::string sha(const std::string& m) { return hex(auth::sha256(u8(m), m.size())); }

std::string hmac(const std::string& key, const std::string& msg) {
  return hex(auth::hmac_sha256(u8(key), key.size(), {{u8(msg), msg.size()}}));
}

}  // namespace

int main() {
  // FIPS 180-4 / NIST CSRC examples.
  CHECK_EQ(sha(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK_EQ(sha("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK_EQ(sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
           "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK_EQ(sha("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu"),
           "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  CHECK_EQ(sha(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");

  // Padding edges (55, 56, 63, 64, 65 bytes) and split updates at every offset give the one-shot digest.
  std::string m;
  for (int i = 0; i < 200; ++i) m += char('a' + i % 26);
  for (size_t len : {55u, 56u, 63u, 64u, 65u, 119u, 120u, 128u, 200u}) {
    std::string part = m.substr(0, len);
    auto want = auth::sha256(u8(part), part.size());
    for (size_t cut = 0; cut <= len; ++cut) {
      auth::Sha256 s;
      s.update(u8(part), cut);
      s.update(u8(part) + cut, len - cut);
      CHECK(s.finish() == want);
    }
  }

  // RFC 4231, test cases 1-7.
  CHECK_EQ(hmac(std::string(20, '\x0b'), "Hi There"),
           "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK_EQ(hmac("Jefe", "what do ya want for nothing?"),
           "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  CHECK_EQ(hmac(std::string(20, '\xaa'), std::string(50, '\xdd')),
           "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4 += char(i);
  CHECK_EQ(hmac(key4, std::string(50, '\xcd')), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  CHECK_EQ(hmac(std::string(20, '\x0c'), "Test With Truncation").substr(0, 32), "a3b6167473100ee06e0c796c2955552b");
  CHECK_EQ(hmac(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First"),
           "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  CHECK_EQ(hmac(std::string(131, '\xaa'),
                "This is a test using a larger than block-size key and a larger than block-size data. The key needs "
                "to be hashed before being used by the HMAC algorithm."),
           "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
  // The message may come in parts.
  {
    std::string a = "what do ya ", b = "want for nothing?";
    CHECK_EQ(hex(auth::hmac_sha256(u8(std::string("Jefe")), 4, {{u8(a), a.size()}, {u8(b), b.size()}})),
             "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  }

  // Constant-time compare and the random source.
  uint8_t x[32] = {}, y[32] = {};
  CHECK(auth::equal_ct(x, y, 32));
  y[31] = 1;
  CHECK(!auth::equal_ct(x, y, 32));
  auth::random_bytes(x, sizeof x);
  auth::random_bytes(y, sizeof y);
  CHECK(!auth::equal_ct(x, y, 32));
  return report("test_sha256");
}
