#include "engine/internal.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <random>

#include "engine/thread_state.h"
#include "transport/oob.h"
#include "verbs/error.h"
#include "verbs/log.h"
#include "wire/control.h"

namespace hixl::engine {

const char* code_name(int code) {
  switch (code) {
    case kSuccess: return "SUCCESS";
    case kParamInvalid: return "PARAM_INVALID";
    case kTimeout: return "TIMEOUT";
    case kNotConnected: return "NOT_CONNECTED";
    case kAlreadyConnected: return "ALREADY_CONNECTED";
    case kNotifyFailed: return "NOTIFY_FAILED";
    case kUnsupported: return "UNSUPPORTED";
    case kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case kFailed: return "FAILED";
  }
  return "UNKNOWN";
}

ThreadState& thread_state() {
  // A thread_local with a constructor is reached through its guard and an init wrapper: in a shared
  // object that was four __tls_get_addr calls per transfer. The pointer has no constructor: one look-up
  // once the object exists (built at the thread's first call, destroyed at its exit as before).
  thread_local ThreadState* t_ptr = nullptr;
  if (__builtin_expect(t_ptr != nullptr, 1)) return *t_ptr;
  thread_local ThreadState t_state;
  t_ptr = &t_state;
  return t_state;
}

namespace detail {

std::string& last_error() { return thread_state().last_error; }

int fail(int code, const std::string& why) {
  std::string& e = last_error();
  e = std::string(code_name(code)) + ": " + why;
  if (code == kParamInvalid || code == kNotConnected || code == kAlreadyConnected)
    log::info(e);
  else
    log::warn(e);
  return code;
}

int ok() {
  last_error().clear();
  return kSuccess;
}

bool known_code(uint32_t c) {
  switch (c) {
    case kSuccess: case kParamInvalid: case kTimeout: case kNotConnected: case kAlreadyConnected:
    case kNotifyFailed: case kUnsupported: case kResourceExhausted: case kFailed: return true;
    default: return false;
  }
}

std::optional<std::string> canonical(const std::string& s, int* port_out) {
  std::pair<std::string, int> hp;
  try {
    hp = oob::split_host_port(s);
  } catch (const Error&) {
    return std::nullopt;
  }
  auto [host, port] = hp;
  char buf[INET6_ADDRSTRLEN] = {};
  in_addr a4{};
  in6_addr a6{};
  std::string h;
  bool v6 = false;
  if (s[0] != '[' && inet_pton(AF_INET, host.c_str(), &a4) == 1) {
    inet_ntop(AF_INET, &a4, buf, sizeof buf);
    h = buf;
  } else if (inet_pton(AF_INET6, host.c_str(), &a6) == 1 && (s[0] == '[' || port < 0)) {
    inet_ntop(AF_INET6, &a6, buf, sizeof buf);
    h = buf;
    v6 = true;
  } else {
    return std::nullopt;
  }
  if (port_out) *port_out = port;
  if (port < 0) return h;
  return (v6 ? "[" + h + "]" : h) + ":" + std::to_string(port);
}

std::string offers_string(uint32_t offers) {
  std::string out;
  for (auto t : {wire::Transport::kRdma, wire::Transport::kShm, wire::Transport::kTcp})
    if (offers & wire::transport_bit(t)) out += std::string(out.empty() ? "" : ",") + wire::transport_name(t);
  return out.empty() ? "none" : out;
}

std::string host_of(const std::string& address) {
  std::string h;
  try {
    h = oob::split_host_port(address).first;
  } catch (const Error&) {
    h = address;  // a bare IPv6 address (a client-only engine's name)
  }
  char buf[INET6_ADDRSTRLEN] = {};
  in_addr a4{};
  in6_addr a6{};
  if (inet_pton(AF_INET, h.c_str(), &a4) == 1) return inet_ntop(AF_INET, &a4, buf, sizeof buf);
  if (inet_pton(AF_INET6, h.c_str(), &a6) != 1) return "";
  if (IN6_IS_ADDR_V4MAPPED(&a6)) return inet_ntop(AF_INET, &a6.s6_addr[12], buf, sizeof buf);
  return inet_ntop(AF_INET6, &a6, buf, sizeof buf);
}

milliseconds left_until(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  return std::max(ms, milliseconds(0));
}

uint64_t random_u64() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(Clock::now().time_since_epoch().count());
}

}  // namespace detail
}  // namespace hixl::engine
