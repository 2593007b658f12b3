#include "wire/frame_reader.h"

#include <algorithm>
#include <cstring>

#include "verbs/error.h"

namespace hixl::wire {

size_t FrameReader::feed(const uint8_t* data, size_t len) {
  if (!failed_.empty()) throw Error(failed_);
  if (complete_ || len == 0) return 0;
  size_t used = 0;
  if (!header_) {
    const size_t k = std::min(kHeaderSize - hdr_len_, len);
    std::memcpy(hdr_ + hdr_len_, data, k);
    hdr_len_ += k;
    used += k;
    if (hdr_len_ < kHeaderSize) return used;
    try {
      Header h = parse_header(hdr_, kHeaderSize);
      check_payload_len(h, max_payload_);
      header_ = h;
    } catch (const Error& e) {
      failed_ = e.what();
      throw;
    }
  }
  const size_t total = header_->payload_len;
  const size_t k = std::min(total - payload_.size(), len - used);
  if (k) {
    const size_t need = payload_.size() + k;
    if (need > payload_.capacity()) payload_.reserve(std::min(total, std::max(need, 2 * payload_.capacity())));
    payload_.insert(payload_.end(), data + used, data + used + k);
    used += k;
  }
  complete_ = payload_.size() == total;
  return used;
}

Frame FrameReader::take() {
  if (!complete_) throw Error("wire: FrameReader::take() without a complete frame");
  Frame f{*header_, std::move(payload_)};
  payload_ = {};
  header_.reset();
  hdr_len_ = 0;
  complete_ = false;
  return f;
}

std::string FrameReader::describe_pending() const {
  if (!header_) return std::to_string(hdr_len_) + " of the " + std::to_string(kHeaderSize) + " header bytes";
  return std::to_string(payload_.size()) + " of the " + std::to_string(header_->payload_len) +
         " payload bytes of a " + frame_type_name(header_->type) + " frame (type " +
         std::to_string(int(header_->type)) + ")";
}

}  // namespace hixl::wire
