#include "engine/handshakes.h"

#include <poll.h>
#include <sys/socket.h>

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

uint64_t Handshakes::admit(const std::string& host, const std::string& from, const std::string& owner,
                           std::string* note) {
  std::lock_guard<std::mutex> g(mu_);
  return take_locked(host, from, owner, true, note);
}

bool Handshakes::acquire(const std::string& host, const std::string& from, const std::string& owner,
                         std::string* refusal) {
  std::lock_guard<std::mutex> g(mu_);
  return take_locked(host, from, owner, false, refusal) != 0;
}

uint64_t Handshakes::take_locked(const std::string& host, const std::string& from, const std::string& owner,
                                 bool may_drop, std::string* note) {
  auto it = by_host_.find(host);
  const int mine = it == by_host_.end() ? 0 : it->second;
  std::string victim;
  bool room = true;
  if (mine >= kMaxHandshakesPerHost) room = may_drop && drop_oldest_locked(&host, &victim);
  if (room && serving_ >= kMaxHandshakes) room = may_drop && drop_oldest_locked(nullptr, &victim);
  if (!room) {
    ++limit_refusals_;
    if (note_due_locked())
      *note = "engine " + owner + ": refusing the peer at " + from + ": too many handshakes in progress (" +
              std::to_string(serving_) + " in all, at most " + std::to_string(kMaxHandshakes) + "; " +
              std::to_string(mine) + " from " + host + ", at most " + std::to_string(kMaxHandshakesPerHost) +
              "; none of those in the way is unauthenticated); " + std::to_string(limit_refusals_) +
              " such refusals so far";
    return 0;
  }
  if (!victim.empty() && note_due_locked())
    *note = "engine " + owner + ": too many handshakes in progress: dropped the oldest unauthenticated one (from " +
            victim + ") for the peer at " + from + "; " + std::to_string(drops_) + " dropped so far";
  const uint64_t id = next_id_++;
  slots_[id].host = host;
  ++serving_;
  ++by_host_[host];
  return id;
}

namespace {
// Nothing has come on s yet (its thread may not have looked): a poll that does not wait.
bool quiet(const oob::Socket* s) {
  if (!s || !s->valid()) return false;
  pollfd p{s->fd(), POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}
}  // namespace

bool Handshakes::drop_oldest_locked(const std::string* host, std::string* victim) {
  // First the slots known to be idle: their thread watches the socket and nothing came on it. A slot
  // whose bytes came before its thread looked (e.g. a peer's tcp data connection, whose Attach the
  // peer does not wait to see answered) is not idle; nor is one whose thread has not started.
  // Then any unsettled one.
  for (bool idle_only : {true, false}) {
    for (auto& [id, slot] : slots_) {
      (void)id;
      if (slot.dropped || slot.stage == Stage::kSettled || (host && slot.host != *host)) continue;
      if (idle_only && (slot.stage != Stage::kIdle || !quiet(slot.socket))) continue;
      slot.dropped = true;
      --serving_;
      auto it = by_host_.find(slot.host);
      if (it != by_host_.end() && --it->second <= 0) by_host_.erase(it);
      // Wakes its handshake thread (a read returns the end); the write side stays for its answer.
      if (slot.socket && slot.socket->valid()) ::shutdown(slot.socket->fd(), SHUT_RD);
      ++drops_;
      *victim = slot.host;
      return true;
    }
  }
  return false;
}

bool Handshakes::note_due_locked() {
  const auto now = std::chrono::steady_clock::now();
  if (now - last_note_ < std::chrono::seconds(1)) return false;
  last_note_ = now;
  return true;
}

void Handshakes::attach(uint64_t id, oob::Socket* s) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = slots_.find(id);
  if (it == slots_.end()) return;
  it->second.socket = s;
  if (it->second.dropped && s->valid()) ::shutdown(s->fd(), SHUT_RD);
}

void Handshakes::detach(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = slots_.find(id);
  if (it != slots_.end()) it->second.socket = nullptr;
}

bool Handshakes::advance(uint64_t id, Stage stage) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = slots_.find(id);
  if (it == slots_.end()) return true;  // not an admitted slot (nothing can drop it)
  if (it->second.dropped) return false;
  if (stage > it->second.stage) it->second.stage = stage;
  if (stage == Stage::kSettled) it->second.socket = nullptr;  // never shut down from here any more
  return true;
}

bool Handshakes::dropped(uint64_t id) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = slots_.find(id);
  return it != slots_.end() && it->second.dropped;
}

void Handshakes::release(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = slots_.find(id);
  if (it == slots_.end()) return;
  if (!it->second.dropped) {
    --serving_;
    auto h = by_host_.find(it->second.host);
    if (h != by_host_.end() && --h->second <= 0) by_host_.erase(h);
  }
  slots_.erase(it);
}

void Handshakes::release(const std::string& host) {
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [i, slot] : slots_)
      if (slot.host == host && !slot.dropped) {
        id = i;
        break;
      }
  }
  if (id) release(id);
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
