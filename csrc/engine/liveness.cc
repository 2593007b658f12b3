#include "engine/liveness.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace hixl::engine {

char process_state(uint32_t pid) {
  if (pid == 0) return 0;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return 0;
  // "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return 0;
  return line[close + 2];
}

std::string peer_alive_evidence(bool same_host, uint32_t pid, int ctrl_fd, int ping_ms) {
  if (same_host) {
    const char st = process_state(pid);
    if (st == 0 || std::strchr("TtZXx", st)) return "";
    return "its process " + std::to_string(pid) + " on this host is running (state " + std::string(1, st) + ")";
  }
  tcp_info ti{};
  socklen_t len = sizeof ti;
  if (::getsockopt(ctrl_fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return "";
  // A ping goes out every ping_ms: a host that is up acknowledges each within a round trip. Nothing
  // acknowledged for two intervals: the host is frozen or unreachable, or our own link is down (then
  // nothing is even in flight: the segments wait in the send queue, unacknowledged or not).
  if (ti.tcpi_last_ack_recv > uint32_t(2 * ping_ms)) return "";
  return "its host acknowledges our pings (last TCP acknowledgement " + std::to_string(ti.tcpi_last_ack_recv) +
         " ms ago)";
}

}  // namespace hixl::engine
