// Incremental reader of wire frames (header + payload) from a byte stream, for a reader that must
// never wait on a peer (the engine's progress thread serves every link's control connection): feed()
// it whatever arrived, take() each frame once it is complete.
//
// Validation is the blocking readers' (oob::recv_header / recv_payload): parse_header() as soon as
// the 16 header bytes are there, then check_payload_len() against the reader's bound, both before a
// byte of the payload is stored. The payload buffer grows with the bytes that arrive (never beyond
// payload_len, at most twice what arrived), so a peer announcing a large frame and sending little of
// it costs little memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "wire/wire.h"

namespace hixl::wire {

struct Frame {
  Header header;
  std::vector<uint8_t> payload;
};

class FrameReader {
 public:
  explicit FrameReader(uint32_t max_payload = kMaxPayload) : max_payload_(max_payload) {}

  // Takes bytes of data[0, len) up to the end of the frame in progress, never beyond it, and returns
  // how many it took (none while a complete frame waits for take()). Throws hixl::Error naming what
  // is wrong once the header is complete and invalid; the reader is failed then, and every later
  // feed() throws the same.
  size_t feed(const uint8_t* data, size_t len);
  bool has_frame() const { return complete_; }
  // The complete frame (throws hixl::Error without one); the reader is between frames again.
  Frame take();

  // The frame in progress (or complete and not taken): its bytes held so far, header included (0
  // between frames); its header once that is complete and valid; the memory held for its payload.
  size_t pending_bytes() const { return hdr_len_ + payload_.size(); }
  const std::optional<Header>& pending_header() const { return header_; }
  size_t held_bytes() const { return payload_.capacity(); }
  // For messages: "7 of the 16 header bytes", "5 of the 18 payload bytes of a Notify frame (type 7)".
  std::string describe_pending() const;

 private:
  uint32_t max_payload_;
  uint8_t hdr_[kHeaderSize] = {};
  size_t hdr_len_ = 0;
  std::optional<Header> header_;
  std::vector<uint8_t> payload_;
  bool complete_ = false;
  std::string failed_;  // the error, once a header was refused
};

}  // namespace hixl::wire
