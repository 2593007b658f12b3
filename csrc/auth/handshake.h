// Shared-secret peer authentication (engine option HixlAuthToken / env HIXL_AUTH_TOKEN; for the
// low-level rdma::Endpoint handshake, EndpointOptions::auth_token: hixl.Endpoint(auth_token=...)).
//
// When the client has a token, every TCP connection it opens to a listener (the control connection
// before its Connect, each tcp data connection before its Attach) starts with this exchange, and
// nothing of either engine (regions, rkeys, addresses, pid, boot id, QPN, instance) travels before
// it succeeded:
//   client -> AuthHello     {scheme 1, Nc}        Nc, Ns: 32 bytes from getrandom(2), fresh per connection
//   server -> AuthChallenge {Ns}
//   client -> AuthProof     {HMAC-SHA-256(token, "hixl-auth-v1 client" | Nc | Ns)}
//   server: wrong proof -> Refuse (the reason only) and close; else
//   server -> AuthProof     {HMAC-SHA-256(token, "hixl-auth-v1 server" | Nc | Ns)}
//   client: wrong proof -> close, sending nothing more; else its Connect / Attach follows.
// A listener with a token refuses any first frame other than AuthHello ("authentication required");
// a listener without one refuses an AuthHello, so a client with a token never talks to a server
// that cannot prove it knows the token.
//
// Replay: Ns is new on every connection, so a recorded AuthProof (or a whole recorded session
// replayed byte for byte) does not fit another one; Nc does the same for the client's side. No
// replay cache is needed. The listener proves nothing to a peer that has not proved first, so a
// port scanner gets no material for an offline guess of the token (a fake server that a client is
// pointed at does: use a random token, e.g. 32 random bytes in hex).
// Not covered: secrecy or integrity of what follows (no encryption: an active man in the middle can
// relay an authenticated connection). Use a trusted network, or a tunnel, for that.
//
// Names: the engine name a peer claims in its Connect is not part of the proof. Every holder of the
// token can compute a proof for any name, and what follows the proof is not integrity-protected, so
// an HMAC over the name would stop neither a token holder nor a man in the middle. The token makes
// a peer a member; the engine still never lets a claim replace a live link (engine/connector.cc).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include "auth/sha256.h"
#include "transport/oob.h"
#include "verbs/error.h"
#include "wire/control.h"

namespace hixl::auth {

constexpr uint32_t kSchemeHmacSha256 = 1;
// The status a listener without a token refuses an AuthHello with (engine::kUnsupported).
constexpr uint32_t kStatusNoAuth = 103905;
// The status of any other refusal by a listener with a token (engine::kFailed).
constexpr uint32_t kStatusRefused = 503900;
// Payload bound for the frames read before a peer proved the token (AuthHello is 36 bytes).
constexpr uint32_t kMaxPreAuthPayload = 64;
using Nonce = std::array<uint8_t, wire::kAuthBytes>;

Digest proof(const std::string& token, bool server, const Nonce& client_nonce, const Nonce& server_nonce);

// The listener refused us (its Refuse frame): its status (a hixl status code) and reason.
class Refused : public Error {
 public:
  Refused(const std::string& what, uint32_t status) : Error(what), status_(status) {}
  uint32_t status() const noexcept { return status_; }

 private:
  uint32_t status_;
};

// Client side, on a fresh connection. Returns once the server proved it knows `token`; otherwise
// throws hixl::Error saying why (the server refused us: Refused, with its status; has no token; or
// failed to prove it).
// Socket errors and timeouts propagate as they are (ETIMEDOUT for the deadline).
void client_handshake(const oob::Socket& s, const std::string& token, oob::Clock::time_point deadline);

// Server side, once the peer's first frame `hello` (an AuthHello) was read. Returns "" when the peer
// proved it knows `token` (and our proof is sent); otherwise the reason to refuse it with (nothing
// was sent but our random nonce). `proved`, when given, runs once the peer's proof checked out and
// before ours is sent, so whatever it records holds by the time the peer reads our proof. Throws
// hixl::Error on socket errors and timeouts.
std::string server_handshake(const oob::Socket& s, const std::string& token, const wire::Control& hello,
                             oob::Clock::time_point deadline, const std::function<void()>& proved = {});

}  // namespace hixl::auth
