// What the engine's parts share and the public API does not show: the per-thread last error and the
// status helpers that set it, peer-name canonicalisation, and small time helpers.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "engine/types.h"
#include "transport/oob.h"

namespace hixl::engine::detail {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The reason behind this thread's last non-SUCCESS status (Engine::last_error()).
std::string& last_error();
// Records why a call returns `code` and logs it: refusals of bad input at info level (the caller gets
// the code), everything else at warn. Returns code.
int fail(int code, const std::string& why);
int ok();  // clears last_error(); kSuccess
bool known_code(uint32_t c);
// "ip:port" / "[v6]:port" / "ip" in canonical form; nullopt when it is not an IP address.
std::optional<std::string> canonical(const std::string& s, int* port_out = nullptr);
std::string offers_string(uint32_t offers);  // "rdma,shm,tcp" for wire::transport_bit()s; "none"
// The canonical IP of "ip:port", "[v6]:port" or "ip" (an IPv4-mapped IPv6 address as IPv4); "" when
// it is none.
std::string host_of(const std::string& address);
milliseconds left_until(Clock::time_point deadline);  // >= 0
uint64_t random_u64();

}  // namespace hixl::engine::detail
