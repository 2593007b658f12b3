#include "engine/handshakes.h"

#include "engine/types.h"

namespace hixl::engine {

Handshakes::Guard::Guard(Handshakes& h, oob::Socket* s) : h_(h), s_(s) {
  std::lock_guard<std::mutex> g(h_.mu_);
  if (h_.closed_) s_->shutdown();
  h_.sockets_.insert(s_);
}

Handshakes::Guard::~Guard() {
  std::lock_guard<std::mutex> g(h_.mu_);
  h_.sockets_.erase(s_);
}

bool Handshakes::acquire(const std::string& host, const std::string& from, const std::string& owner,
                         std::string* refusal) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = by_host_.find(host);
  const int mine = it == by_host_.end() ? 0 : it->second;
  if (serving_ < kMaxHandshakes && mine < kMaxHandshakesPerHost) {
    ++serving_;
    ++by_host_[host];
    return true;
  }
  ++limit_refusals_;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_limit_log_ >= std::chrono::seconds(1)) {
    last_limit_log_ = now;
    *refusal = "engine " + owner + ": refusing the peer at " + from + ": too many handshakes in progress (" +
               std::to_string(serving_) + " in all, at most " + std::to_string(kMaxHandshakes) + "; " +
               std::to_string(mine) + " from " + host + ", at most " + std::to_string(kMaxHandshakesPerHost) + "); " +
               std::to_string(limit_refusals_) + " such refusals so far";
  }
  return false;
}

void Handshakes::release(const std::string& host) {
  std::lock_guard<std::mutex> g(mu_);
  --serving_;
  auto it = by_host_.find(host);
  if (it != by_host_.end() && --it->second <= 0) by_host_.erase(it);
}

int Handshakes::serving() const {
  std::lock_guard<std::mutex> g(mu_);
  return serving_;
}

void Handshakes::close() {
  std::lock_guard<std::mutex> g(mu_);
  closed_ = true;
  for (oob::Socket* s : sockets_) s->shutdown();  // handshakes in flight fail now, not at their deadline
}

}  // namespace hixl::engine
