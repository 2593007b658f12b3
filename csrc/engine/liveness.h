// The heartbeat's verdict on a peer that has been silent past the bound: dead, or alive but slow.
//
// A silent control connection alone cannot tell a stopped or vanished peer from one that is alive
// but starved of CPU (a host whose cores all run spinning compute threads). Before closing a link,
// the watchdog looks for evidence of life that does not need the peer's engine to run:
//  * a peer on this host (same boot id): its process (the pid from its handshake) exists and is not
//    stopped (SIGSTOP, a debugger), traced-stopped, a zombie or dead (/proc/PID/stat);
//  * a peer on another host: its kernel acknowledges what we send on the control connection (our
//    pings): an acknowledgement within the last two ping intervals (TCP_INFO). A frozen or
//    unreachable host, or a link down on our side, acknowledges nothing.
// Alive peers keep their link up to kSlowPeerFactor times the bound; a process stopped on another
// host (its kernel still acknowledging) is found at that later bound.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace hixl::engine {

constexpr int kSlowPeerFactor = 6;

// "" when nothing shows the peer alive; else what does (for the log). ctrl_fd: the link's control
// socket; ping_ms: the heartbeat interval.
std::string peer_alive_evidence(bool same_host, uint32_t pid, int ctrl_fd, int ping_ms);

// /proc/PID/stat's state letter, or 0 when there is no such process (tests).
char process_state(uint32_t pid);

}  // namespace hixl::engine
