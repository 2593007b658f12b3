#include "auth/handshake.h"

#include "verbs/error.h"

namespace hixl::auth {
namespace {

const std::string kClientLabel = "hixl-auth-v1 client";
const std::string kServerLabel = "hixl-auth-v1 server";

const uint8_t* u8(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

wire::Control recv_control(const oob::Socket& s, oob::Clock::time_point deadline, uint32_t max_payload) {
  auto [h, payload] = oob::recv_frame(s, deadline, max_payload);
  return wire::parse_control(h.type, payload.data(), payload.size());
}

}  // namespace

Digest proof(const std::string& token, bool server, const Nonce& client_nonce, const Nonce& server_nonce) {
  const std::string& label = server ? kServerLabel : kClientLabel;
  return hmac_sha256(u8(token), token.size(),
                     {{u8(label), label.size()},
                      {client_nonce.data(), client_nonce.size()},
                      {server_nonce.data(), server_nonce.size()}});
}

void client_handshake(const oob::Socket& s, const std::string& token, oob::Clock::time_point deadline) {
  wire::Control hello;
  hello.type = wire::FrameType::kAuthHello;
  hello.scheme = kSchemeHmacSha256;
  random_bytes(hello.nonce.data(), hello.nonce.size());
  oob::send_all(s, wire::encode_control(hello), deadline);
  // A Refuse may carry a reason of up to kMaxText bytes; anything else here is tiny.
  const uint32_t max_reply = uint32_t(wire::kMaxText + 64);
  wire::Control ch = recv_control(s, deadline, max_reply);
  if (ch.type == wire::FrameType::kRefuse && ch.status == kStatusNoAuth)
    throw Error("authentication: the peer does not authenticate its peers (its answer: \"" + ch.text +
                "\"); this engine has a HixlAuthToken and talks only to peers that prove they know it");
  if (ch.type == wire::FrameType::kRefuse)  // at its handshake limit, an older hixl, ...
    throw Refused("authentication: refused by the peer: " + ch.text, ch.status);
  if (ch.type != wire::FrameType::kAuthChallenge)
    throw Error("authentication: the peer answered with frame type " + std::to_string(int(ch.type)) +
                " instead of an auth challenge");
  wire::Control mine;
  mine.type = wire::FrameType::kAuthProof;
  mine.proof = proof(token, false, hello.nonce, ch.nonce);
  oob::send_all(s, wire::encode_control(mine), deadline);
  wire::Control theirs = recv_control(s, deadline, max_reply);
  if (theirs.type == wire::FrameType::kRefuse)
    throw Refused("authentication: refused by the peer: " + theirs.text, theirs.status);
  if (theirs.type != wire::FrameType::kAuthProof)
    throw Error("authentication: the peer answered with frame type " + std::to_string(int(theirs.type)) +
                " instead of its proof");
  Digest want = proof(token, true, hello.nonce, ch.nonce);
  if (!equal_ct(want.data(), theirs.proof.data(), want.size()))
    throw Error("authentication: the peer did not prove it knows our HixlAuthToken (another token, or not the "
                "engine meant); refusing to talk to it");
}

std::string server_handshake(const oob::Socket& s, const std::string& token, const wire::Control& hello,
                             oob::Clock::time_point deadline, const std::function<void()>& proved) {
  if (hello.type != wire::FrameType::kAuthHello) return "authentication required";
  if (hello.scheme != kSchemeHmacSha256)
    return "authentication failed: unknown scheme " + std::to_string(hello.scheme);
  wire::Control ch;
  ch.type = wire::FrameType::kAuthChallenge;
  random_bytes(ch.nonce.data(), ch.nonce.size());
  oob::send_all(s, wire::encode_control(ch), deadline);
  auto [h, payload] = oob::recv_frame(s, deadline, kMaxPreAuthPayload);
  if (h.type != wire::FrameType::kAuthProof) return "authentication failed: expected the peer's proof";
  wire::Control theirs = wire::parse_control(h.type, payload.data(), payload.size());
  Digest want = proof(token, false, hello.nonce, ch.nonce);
  if (!equal_ct(want.data(), theirs.proof.data(), want.size()))
    return "authentication failed: wrong HixlAuthToken";
  if (proved) proved();
  wire::Control mine;
  mine.type = wire::FrameType::kAuthProof;
  mine.proof = proof(token, true, hello.nonce, ch.nonce);
  oob::send_all(s, wire::encode_control(mine), deadline);
  return "";
}

}  // namespace hixl::auth
