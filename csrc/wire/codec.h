// Little-endian writer and bounds-checked reader shared by the wire encoders (internal header).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "verbs/error.h"
#include "wire/wire.h"

namespace hixl::wire::detail {

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

// u32 count + count * {u64 addr, u64 len, u32 rkey, u32 access}; the count is checked against the bytes left.
void write_regions(Writer& w, const std::vector<Region>& regions);
std::vector<Region> read_regions(Reader& r, const char* what);

}  // namespace hixl::wire::detail
