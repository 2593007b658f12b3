// A link's frames out (engine/control_out.h) over a socketpair whose peer stops reading: no sender
// waits past its own deadline, nothing waits under a lock, and the stream stays whole.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "check.h"
#include "engine/control_out.h"
#include "verbs/error.h"

using namespace hixl;
using engine::ControlOut;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

std::pair<oob::Socket, oob::Socket> pair_of_sockets() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) throw_errno("socketpair", errno);
  int small = 4096;
  ::setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
  ::setsockopt(fds[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  return {oob::Socket(fds[0]), oob::Socket(fds[1])};
}

std::vector<uint8_t> frame(uint8_t tag, size_t n) { return std::vector<uint8_t>(n, tag); }

// Everything the peer can read now (it stops at EOF or when nothing more comes for 200 ms).
std::vector<uint8_t> read_all(const oob::Socket& s) {
  std::vector<uint8_t> out;
  uint8_t buf[65536];
  for (;;) {
    timeval tv{0, 200000};
    ::setsockopt(s.fd(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ssize_t n = ::recv(s.fd(), buf, sizeof buf, 0);
    if (n <= 0) return out;
    out.insert(out.end(), buf, buf + n);
  }
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

void frames_in_order() {
  auto [a, b] = pair_of_sockets();
  ControlOut out(a);
  CHECK(out.post(frame(1, 10)));
  out.send(frame(2, 20), Clock::now() + milliseconds(1000), "frame 2");
  CHECK(!out.wants_room());
  auto got = read_all(b);
  CHECK_EQ(got.size(), 30u);
  CHECK(got.size() == 30 && got[0] == 1 && got[9] == 1 && got[10] == 2 && got[29] == 2);
}

// The peer stopped reading: a sender whose frame has not begun gives up at its deadline and its
// frame leaves the queue (the stream stays whole); meanwhile other threads queue frames at once.
void a_stalled_peer_costs_a_sender_its_deadline_only() {
  auto [a, b] = pair_of_sockets();
  ControlOut out(a);
  std::vector<uint8_t> big = frame(7, 1 << 20);  // far more than the socket buffers hold
  CHECK(out.post(big));
  CHECK(out.wants_room());
  std::atomic<bool> sending{true};
  std::thread sender([&] {
    auto t0 = Clock::now();
    CHECK_THROWS_WITH(out.send(frame(8, 100), Clock::now() + milliseconds(1500), "a Notify frame"),
                      "timed out behind");
    const double took = ms_since(t0);
    CHECK(took >= 1490 && took < 5000);
    sending = false;
  });
  std::this_thread::sleep_for(milliseconds(50));
  auto t0 = Clock::now();
  for (int i = 0; i < 100; ++i) CHECK(out.post(frame(9, 10)));  // never waits, while the sender does
  CHECK(ms_since(t0) < 1000);
  CHECK(sending.load());
  sender.join();
  std::string why;
  CHECK(!out.stalled(Clock::now(), &why));
  CHECK(out.stalled(Clock::now() + ControlOut::kStallBound, &why));
  CHECK(why.find("the peer stopped reading") != std::string::npos);
  // The peer reads again: the big frame, then the hundred small ones; the abandoned frame is gone.
  std::thread drain([&] {
    while (out.wants_room()) {
      out.flush();
      std::this_thread::sleep_for(milliseconds(1));
    }
    a.shutdown();
  });
  auto got = read_all(b);
  drain.join();
  CHECK_EQ(got.size(), big.size() + 1000);
  size_t eights = 0;
  for (uint8_t c : got) eights += c == 8;
  CHECK_EQ(eights, 0u);
  CHECK(got.size() > big.size() && got[big.size() - 1] == 7 && got[big.size()] == 9);
}

// A frame begun cannot be taken back: at its deadline the connection is shut down, and said so.
void a_frame_left_half_sent_shuts_the_connection() {
  auto [a, b] = pair_of_sockets();
  ControlOut out(a);
  CHECK_THROWS_WITH(out.send(frame(3, 1 << 20), Clock::now() + milliseconds(200), "a Query frame"),
                    "the connection is shut down");
  CHECK(!out.post(frame(4, 10)));  // the link goes
  CHECK_THROWS_WITH(out.send(frame(5, 10), Clock::now() + milliseconds(200), "a Notify frame"),
                    "the connection failed");
}

// The handshake's frame goes first, ahead of what others queued while the link was held.
void held_until_the_first_frame() {
  auto [a, b] = pair_of_sockets();
  ControlOut out(a);
  out.hold();
  CHECK(out.post(frame(2, 10)));
  CHECK(!out.wants_room());
  std::string why;
  CHECK(!out.stalled(Clock::now() + ControlOut::kStallBound * 2, &why));
  std::thread sender([&] { out.send(frame(3, 10), Clock::now() + milliseconds(2000), "frame 3"); });
  std::this_thread::sleep_for(milliseconds(50));
  out.send_first(frame(1, 10), Clock::now() + milliseconds(1000), "the Ready frame");
  sender.join();
  auto got = read_all(b);
  CHECK_EQ(got.size(), 30u);
  CHECK(got.size() == 30 && got[0] == 1 && got[10] == 2 && got[20] == 3);
}

}  // namespace

int main() {
  frames_in_order();
  a_stalled_peer_costs_a_sender_its_deadline_only();
  a_frame_left_half_sent_shuts_the_connection();
  held_until_the_first_frame();
  return report("test_control_out");
}
