// Engine control channel: the frames an engine exchanges with a peer over its TCP control
// connection (connection setup, notifies, region-list updates, link abort, goodbye).
// Data never travels here on the RDMA transport.
//
// Every frame = wire header (wire.h) + one payload below (little endian; str = u32 len + bytes):
//   Connect    u32 transport, u64 instance, u64 version, str name, u32 hello_len, hello payload
//              (wire.h; hello_len 0 = none; version = the sender's region registry version)
//   Accept     same as Connect (the server's side)
//   Refuse     u32 status (hixl status code), str reason
//   Notify     u64 seq, str name, str message
//   NotifyAck  u64 seq, u32 status
//   Regions    u64 seq (0 = unsolicited push), u64 version, regions (wire.h layout)
//   RegionsReq u64 seq
//   Abort      u64 seq, str reason      AbortAck  u64 seq
//   Bye        str reason
// A payload must be consumed exactly; strings are bounded (kMaxName / kMaxText) before copying.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "wire/wire.h"

namespace hixl::wire {

enum class Transport : uint32_t { kNone = 0, kRdma = 1 };
const char* transport_name(Transport t);

constexpr size_t kMaxName = 4096;       // engine names, notify names (1024 chars of UTF-8 fit)
constexpr size_t kMaxText = 64 * 1024;  // notify messages, reasons

struct Control {
  FrameType type = FrameType::kBye;
  uint64_t seq = 0;
  uint32_t status = 0;                  // Refuse, NotifyAck
  Transport transport = Transport::kNone;  // Connect, Accept
  uint64_t instance = 0;                // Connect/Accept: random per engine object (tells restarts apart)
  uint64_t version = 0;                 // Connect/Accept/Regions: region registry version (newer wins)
  std::string name;                     // Connect/Accept: engine name; Notify: notify name
  std::string text;                     // Notify: message; Refuse/Abort/Bye: reason
  std::optional<Hello> hello;           // Connect/Accept (RDMA queue pair + regions)
  std::vector<Region> regions;          // Regions
};

std::vector<uint8_t> encode_control(const Control& c);                        // whole frame
Control parse_control(FrameType type, const uint8_t* payload, size_t len);    // throws hixl::Error
Control parse_control_frame(const uint8_t* data, size_t len);                 // header + payload

}  // namespace hixl::wire
