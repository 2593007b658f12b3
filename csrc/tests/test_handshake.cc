// auth/handshake.h over a socketpair: matching tokens pass both ways, a wrong token is refused by
// the server (reason only) and never reaches the client's Connect, and a server that cannot prove
// the token is refused by the client.
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "auth/handshake.h"
#include "check.h"
#include "verbs/error.h"

using namespace hixl;
using oob::Clock;

namespace {

std::pair<oob::Socket, oob::Socket> pair_of_sockets() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) throw_errno("socketpair", errno);
  return {oob::Socket(fds[0]), oob::Socket(fds[1])};
}

// Runs the client with `ctoken` against a server with `stoken`; returns the server's verdict and
// the client's error ("" = success). *proved_first: whether the server's `proved` hook had run by
// the time the client held the server's proof (it must have, whenever the client succeeded).
std::pair<std::string, std::string> run(const std::string& ctoken, const std::string& stoken,
                                        bool* proved_first = nullptr) {
  auto [c, s] = pair_of_sockets();
  auto deadline = Clock::now() + std::chrono::seconds(5);
  std::string verdict = "(not reached)";
  std::atomic<bool> proved{false};
  std::thread server([&, s = std::move(s)]() mutable {
    try {
      auto [h, payload] = oob::recv_frame(s, deadline, auth::kMaxPreAuthPayload);
      verdict = auth::server_handshake(s, stoken, wire::parse_control(h.type, payload.data(), payload.size()),
                                       deadline, [&] {
                                         std::this_thread::sleep_for(std::chrono::milliseconds(50));
                                         proved = true;
                                       });
      if (!verdict.empty()) {
        wire::Control r;
        r.type = wire::FrameType::kRefuse;
        r.status = 503900;
        r.text = verdict;
        oob::send_all(s, wire::encode_control(r), deadline);
      }
    } catch (const std::exception& e) {
      verdict = std::string("threw: ") + e.what();
    }
  });
  std::string err;
  try {
    auth::client_handshake(c, ctoken, deadline);
    if (proved_first) *proved_first = proved.load();
  } catch (const std::exception& e) {
    err = e.what();
  }
  server.join();
  return {verdict, err};
}

}  // namespace

int main() {
  {
    bool proved_first = false;
    auto [verdict, err] = run("s3cret", "s3cret", &proved_first);
    CHECK_EQ(verdict, "");
    CHECK_EQ(err, "");
    CHECK(proved_first);  // what the hook records (an engine's settled slot) holds once the client is through
  }
  {
    auto [verdict, err] = run("wrong", "s3cret");
    CHECK_EQ(verdict, "authentication failed: wrong HixlAuthToken");
    CHECK(err.find("refused by the peer: authentication failed: wrong HixlAuthToken") != std::string::npos);
  }
  // Proofs depend on the direction, both nonces and the token.
  auth::Nonce a{}, b{};
  b[0] = 1;
  CHECK(auth::proof("t", false, a, b) != auth::proof("t", true, a, b));
  CHECK(auth::proof("t", false, a, b) != auth::proof("t", false, b, a));
  CHECK(auth::proof("t", false, a, b) != auth::proof("u", false, a, b));
  CHECK(auth::proof("t", false, a, b) == auth::proof("t", false, a, b));
  // A server that plays along without knowing the token: the client refuses it.
  {
    auto [c, s] = pair_of_sockets();
    auto deadline = Clock::now() + std::chrono::seconds(5);
    std::thread fake([&, s = std::move(s)]() mutable {
      try {
        oob::recv_frame(s, deadline);
        wire::Control ch;
        ch.type = wire::FrameType::kAuthChallenge;
        oob::send_all(s, wire::encode_control(ch), deadline);
        oob::recv_frame(s, deadline);
        wire::Control p;
        p.type = wire::FrameType::kAuthProof;  // all zeros: not the proof
        oob::send_all(s, wire::encode_control(p), deadline);
      } catch (const std::exception&) {
      }
    });
    CHECK_THROWS_WITH(auth::client_handshake(c, "s3cret", deadline), "did not prove it knows our HixlAuthToken");
    fake.join();
  }
  // A server without a token refuses the AuthHello: the client says so.
  {
    auto [c, s] = pair_of_sockets();
    auto deadline = Clock::now() + std::chrono::seconds(5);
    std::thread plain([&, s = std::move(s)]() mutable {
      try {
        oob::recv_frame(s, deadline);
        wire::Control r;
        r.type = wire::FrameType::kRefuse;
        r.status = auth::kStatusNoAuth;
        r.text = "no token here";
        oob::send_all(s, wire::encode_control(r), deadline);
      } catch (const std::exception&) {
      }
    });
    CHECK_THROWS_WITH(auth::client_handshake(c, "s3cret", deadline), "does not authenticate its peers");
    plain.join();
  }
  // An oversized frame before authentication is refused by its header.
  {
    auto [c, s] = pair_of_sockets();
    wire::Control n;
    n.type = wire::FrameType::kNotify;
    n.text = std::string(100, 'x');
    oob::send_all(c, wire::encode_control(n), Clock::now() + std::chrono::seconds(1));
    CHECK_THROWS_WITH(oob::recv_frame(s, Clock::now() + std::chrono::seconds(1), auth::kMaxPreAuthPayload),
                      "at most 64 bytes are accepted here");
  }
  return report("test_handshake");
}
