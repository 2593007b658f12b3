#include "transport/oob.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "verbs/error.h"

namespace hixl::oob {
namespace {

int remaining_ms(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms < 0 ? 0 : int(ms > 1 << 30 ? 1 << 30 : ms);
}

// Waits for events on fd until deadline. Returns false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) throw_errno(CallDesc("poll").arg("fd", fd).arg("for", what).str(), errno);
  }
}

struct AddrInfo {
  addrinfo* res = nullptr;
  AddrInfo(const std::string& host, uint16_t port, bool passive) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
    std::string p = std::to_string(port);
    int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), p.c_str(), &hints, &res);
    if (rc != 0)
      throw Error(CallDesc("getaddrinfo").arg("host", host).arg("port", port).str() + " failed: " + gai_strerror(rc));
  }
  ~AddrInfo() { if (res) freeaddrinfo(res); }
};

}  // namespace

Socket::~Socket() { close(); }

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

void Socket::shutdown() noexcept {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void Socket::close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::pair<std::string, int> split_host_port(const std::string& s) {
  auto bad = [&](const char* why) { return Error("address \"" + s + "\": " + why + " (want ip, ip:port or [ipv6]:port)"); };
  if (s.empty()) throw bad("empty");
  std::string host, port;
  if (s[0] == '[') {
    auto close = s.find(']');
    if (close == std::string::npos) throw bad("missing ']'");
    host = s.substr(1, close - 1);
    if (close + 1 < s.size()) {
      if (s[close + 1] != ':') throw bad("expected ':' after ']'");
      port = s.substr(close + 2);
      if (port.empty()) throw bad("empty port");
    }
  } else {
    auto colon = s.find(':');
    if (colon != std::string::npos && s.find(':', colon + 1) != std::string::npos) {
      host = s;  // bare IPv6 without a port
    } else if (colon != std::string::npos) {
      host = s.substr(0, colon);
      port = s.substr(colon + 1);
      if (port.empty()) throw bad("empty port");
    } else {
      host = s;
    }
  }
  if (host.empty()) throw bad("empty host");
  if (port.empty()) return {host, -1};
  for (char c : port) if (c < '0' || c > '9') throw bad("port is not a number");
  if (port.size() > 5 || std::stoi(port) > 65535) throw bad("port beyond 65535");
  return {host, std::stoi(port)};
}

std::pair<Socket, uint16_t> listen_tcp(const std::string& host, uint16_t port, int backlog) {
  AddrInfo ai(host, port, true);
  int last = 0;
  for (addrinfo* a = ai.res; a; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (!s.valid()) { last = errno; continue; }
    int one = 1;
    setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.fd(), backlog) != 0) { last = errno; continue; }
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    getsockname(s.fd(), reinterpret_cast<sockaddr*>(&ss), &len);
    uint16_t bound = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                              : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    return {std::move(s), bound};
  }
  throw_errno(CallDesc("bind/listen").arg("host", host).arg("port", port).str(), last ? last : EADDRNOTAVAIL);
}

Socket accept_tcp(const Socket& listener, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  for (;;) {
    if (!wait_fd(listener.fd(), POLLIN, deadline, "accept")) return Socket();
    int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return Socket(fd);
    }
    if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED)
      throw_errno(CallDesc("accept4").arg("fd", listener.fd()).str(), errno);
  }
}

namespace {
// Binds s to the address `from` (its port chosen at connect(), per destination, as without bind())
// when `from` is an address of `family` other than the wildcard. False: s stays unbound.
bool bind_source(const Socket& s, int family, const std::string& from) {
  if (from.empty() || from == "0.0.0.0" || from == "::") return false;
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    if (inet_pton(AF_INET, from.c_str(), &a->sin_addr) != 1) return false;
    a->sin_family = AF_INET;
    len = sizeof *a;
  } else if (family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    if (inet_pton(AF_INET6, from.c_str(), &a->sin6_addr) != 1) return false;
    a->sin6_family = AF_INET6;
    len = sizeof *a;
  } else {
    return false;
  }
#ifdef IP_BIND_ADDRESS_NO_PORT
  int no_port = 1;
  ::setsockopt(s.fd(), IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &no_port, sizeof no_port);
#endif
  return ::bind(s.fd(), reinterpret_cast<sockaddr*>(&ss), len) == 0;  // e.g. EADDRNOTAVAIL: unbound
}
}  // namespace

Socket connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout,
                   const std::string& from) {
  auto deadline = Clock::now() + timeout;
  AddrInfo ai(host, port, false);
  int last = ETIMEDOUT;
  for (addrinfo* a = ai.res; a; a = a->ai_next) {
    for (bool bind_it = !from.empty();; bind_it = false) {
      Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
      if (!s.valid()) { last = errno; break; }
      const bool bound = bind_it && bind_source(s, a->ai_family, from);
      int rc = ::connect(s.fd(), a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno != EINPROGRESS) {
        last = errno;
        if (bound) continue;  // not routable from there (a loopback name, a remote peer): as the kernel chooses
        break;
      }
      if (rc != 0) {
        if (!wait_fd(s.fd(), POLLOUT, deadline, "connect")) { last = ETIMEDOUT; break; }
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) { last = err; break; }
      }
      int one = 1;
      setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return s;
    }
  }
  CallDesc d("connect");
  d.arg("host", host).arg("port", port);
  if (!from.empty()) d.arg("from", from);
  throw_errno(d.arg("timeout_ms", timeout.count()).str(), last);
}

void send_all(const Socket& s, const std::vector<uint8_t>& data, Clock::time_point deadline) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(s.fd(), data.data() + off, data.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) { off += size_t(n); continue; }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_fd(s.fd(), POLLOUT, deadline, "send"))
        throw Error(CallDesc("send").arg("fd", s.fd()).arg("bytes", data.size()).str() + ": timed out", ETIMEDOUT);
      continue;
    }
    throw_errno(CallDesc("send").arg("fd", s.fd()).arg("bytes", data.size()).str(), errno);
  }
}

namespace {
void recv_exact(const Socket& s, uint8_t* out, size_t len, Clock::time_point deadline) {
  size_t off = 0;
  while (off < len) {
    ssize_t n = ::recv(s.fd(), out + off, len - off, MSG_DONTWAIT);
    if (n > 0) { off += size_t(n); continue; }
    if (n == 0) throw Error(CallDesc("recv").arg("fd", s.fd()).arg("want", len).arg("got", off).str() +
                            ": peer closed the connection", ECONNRESET);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_fd(s.fd(), POLLIN, deadline, "recv"))
        throw Error(CallDesc("recv").arg("fd", s.fd()).arg("want", len).arg("got", off).str() + ": timed out",
                    ETIMEDOUT);
      continue;
    }
    throw_errno(CallDesc("recv").arg("fd", s.fd()).arg("want", len).str(), errno);
  }
}
}  // namespace

wire::Header recv_header(const Socket& s, Clock::time_point deadline) {
  uint8_t hdr[wire::kHeaderSize];
  recv_exact(s, hdr, sizeof hdr, deadline);
  return wire::parse_header(hdr, sizeof hdr);  // bounds payload_len by wire::kMaxPayload
}

std::vector<uint8_t> recv_payload(const Socket& s, const wire::Header& h, Clock::time_point deadline,
                                  uint32_t max_payload) {
  wire::check_payload_len(h, max_payload);
  constexpr size_t kStep = 64 * 1024;
  std::vector<uint8_t> payload;
  while (payload.size() < h.payload_len) {
    size_t off = payload.size();
    payload.resize(off + std::min(kStep, h.payload_len - off));
    recv_exact(s, payload.data() + off, payload.size() - off, deadline);
  }
  return payload;
}

std::pair<wire::Header, std::vector<uint8_t>> recv_frame(const Socket& s, Clock::time_point deadline,
                                                        uint32_t max_payload) {
  wire::Header h = recv_header(s, deadline);
  return {h, recv_payload(s, h, deadline, max_payload)};
}

void drain(const Socket& s, Clock::time_point deadline, size_t max_bytes) {
  if (!s.valid()) return;
  ::shutdown(s.fd(), SHUT_WR);
  uint8_t buf[4096];
  size_t total = 0;
  while (total < max_bytes) {
    ssize_t n = ::recv(s.fd(), buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) { total += size_t(n); continue; }
    if (n == 0) break;  // the peer closed too
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) break;
    try {
      if (!wait_fd(s.fd(), POLLIN, deadline, "drain")) break;
    } catch (const Error&) {
      break;
    }
  }
}

std::string peer_address(const Socket& s) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(s.fd(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    return std::string(host) + ":" + std::to_string(ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  return "?";
}

}  // namespace hixl::oob
