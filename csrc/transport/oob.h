// Out-of-band TCP channel used for the connection handshake (never for data on the RDMA transport).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "wire/wire.h"

namespace hixl::oob {

using Clock = std::chrono::steady_clock;

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void close() noexcept;
  void shutdown() noexcept;  // shutdown(2): wakes threads blocked on this socket, keeps the fd

 private:
  int fd_ = -1;
};

// Parses "ip:port", "[v6]:port", "ip" (port -1 then). Throws hixl::Error on malformed input.
std::pair<std::string, int> split_host_port(const std::string& s);

// Binds exactly the given address (no wildcard unless asked) and listens; returns the socket and port.
std::pair<Socket, uint16_t> listen_tcp(const std::string& host, uint16_t port, int backlog = 64);
// Waits up to timeout for a connection; returns an invalid Socket on timeout.
Socket accept_tcp(const Socket& listener, std::chrono::milliseconds timeout);
// Connects with a deadline; throws hixl::Error (naming host, port, errno) on refusal or timeout.
// `from`: the source address to connect from (so that a peer sees our name's host), when it is one of
// ours and the destination is reachable from it; otherwise the kernel chooses, as without it.
Socket connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout,
                   const std::string& from = "");

void send_all(const Socket& s, const std::vector<uint8_t>& data, Clock::time_point deadline);
// Reads one frame. A payload_len over max_payload (at most wire::kMaxPayload) is refused before
// anything is read or allocated; the buffer then grows with the bytes that actually arrive (64 KiB
// steps), so a peer announcing a large frame and sending nothing costs no memory.
std::pair<wire::Header, std::vector<uint8_t>> recv_frame(const Socket& s, Clock::time_point deadline,
                                                        uint32_t max_payload = wire::kMaxPayload);
// The two halves of recv_frame(), for a reader that decides on the frame type before the payload.
wire::Header recv_header(const Socket& s, Clock::time_point deadline);
std::vector<uint8_t> recv_payload(const Socket& s, const wire::Header& h, Clock::time_point deadline,
                                  uint32_t max_payload = wire::kMaxPayload);
// After a refusal: no more sending (shutdown SHUT_WR), then read and drop what the peer still sends
// (at most max_bytes, until the peer closes or the deadline), so that the caller's close does not
// reset the connection before the peer read our last frame (a close with unread input sends RST,
// which may discard it).
void drain(const Socket& s, Clock::time_point deadline, size_t max_bytes = 256 * 1024);
// "ip:port" of the peer of a connected socket ("?" when unknown): for logs.
std::string peer_address(const Socket& s);

}  // namespace hixl::oob
