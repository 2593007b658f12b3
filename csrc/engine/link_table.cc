#include "engine/link_table.h"

namespace hixl::engine {

namespace {
std::atomic<uint64_t> g_next_table_id{1};
}  // namespace

LinkTable::LinkTable() : id_(g_next_table_id.fetch_add(1, std::memory_order_relaxed)) {}

std::shared_ptr<Link> LinkTable::find(const std::string& key, LinkLookup* last) const {
  // The last answer was the table's at generation `gen`; while gen_ still reads `gen`, no link was
  // added or taken out since, so it is still the answer (a change in progress ends with the bump).
  if (last && last->table == id_ && last->gen == gen_.load(std::memory_order_acquire) && last->key == key)
    if (auto link = last->link.lock()) return link;
  std::lock_guard<util::Mutex> g(mu_);
  auto it = links_.find(key);
  std::shared_ptr<Link> found = it == links_.end() ? nullptr : it->second;
  if (found && last) {
    last->table = id_;
    last->gen = gen_.load(std::memory_order_relaxed);
    last->key = key;
    last->link = found;
  }
  return found;
}

std::vector<std::shared_ptr<Link>> LinkTable::all() const {
  std::lock_guard<util::Mutex> g(mu_);
  std::vector<std::shared_ptr<Link>> out;
  out.reserve(links_.size());
  for (auto& [k, l] : links_) out.push_back(l);
  return out;
}

std::vector<std::string> LinkTable::keys() const {
  std::lock_guard<util::Mutex> g(mu_);
  std::vector<std::string> out;
  for (auto& [k, l] : links_) out.push_back(k);
  return out;
}

bool LinkTable::empty() const {
  std::lock_guard<util::Mutex> g(mu_);
  return links_.empty();
}

int LinkTable::claim_outgoing(const std::string& key, bool* busy) {
  std::lock_guard<util::Mutex> g(mu_);
  if (closed_) return detail::fail(kFailed, "connect: engine is not initialized");
  if (links_.count(key)) return detail::fail(kAlreadyConnected, "connect: already connected to " + key);
  if (connecting_.count(key) || incoming_.count(key)) {
    if (busy) *busy = true;
    return detail::fail(kAlreadyConnected, "connect: a handshake with " + key + " is in progress");
  }
  connecting_.insert(key);
  return kSuccess;
}

void LinkTable::release_outgoing(const std::string& key) {
  std::lock_guard<util::Mutex> g(mu_);
  connecting_.erase(key);
  changed_.notify_all();
}

bool LinkTable::wait_link(const std::string& key, std::chrono::steady_clock::time_point deadline, bool settle_only) {
  std::unique_lock<util::Mutex> lk(mu_);
  changed_.wait_until(lk, deadline, [&] {
    if (closed_ || links_.count(key)) return true;
    const bool in_progress = connecting_.count(key) || incoming_.count(key);
    return settle_only && !in_progress;
  });
  return !closed_ && links_.count(key) > 0;
}

std::string LinkTable::claim_incoming(const std::string& key, const std::string& self, bool peer_listens,
                                      uint64_t peer_instance, int* code, const std::string& source,
                                      std::shared_ptr<Link>* current) {
  std::lock_guard<util::Mutex> g(mu_);
  *code = kFailed;
  if (closed_) return self + " is finalizing";
  *code = kParamInvalid;
  if (key == self) return "peer claims this engine's own name " + self;
  *code = kAlreadyConnected;
  auto it = links_.find(key);
  // A Connect from a peer we have a link to means that peer dropped its end (a disconnect whose
  // goodbye is still in flight, or a restart) or is an impostor: the caller lets the new connection
  // supersede the old one only once the old link is proven dead (*current; connector.cc). A second
  // client-only engine from the same IP (same name, another instance) is refused here.
  if (it != links_.end() && !peer_listens && it->second->peer_instance != peer_instance)
    return "another client-only engine from " + key + " is connected to " + self +
           "; give each client a port to tell them apart";
  // The same peer connecting while our own connect to it made the link: both ends connected at
  // once and ours won (the smaller name's outgoing connect wins, as below); the peer's connect
  // finds that link on its side. A peer that dropped its end retries until ours is gone.
  if (it != links_.end() && it->second->initiator && it->second->peer_instance == peer_instance && self < key)
    return self + " already has a link to " + key + " (both ends connected at once; " + self + "'s stands)";
  if (incoming_.count(key)) return "a handshake from " + key + " is in progress";
  // Both ends connecting to each other at once: the smaller name's outgoing connect wins.
  if (connecting_.count(key) && self < key) return self + " is connecting to " + key + " itself";
  if (!source.empty()) {
    size_t from_source = 0;  // links and claims from there, but the one this claim may replace
    for (const auto* m : {&sources_, &incoming_})
      for (const auto& [k, src] : *m) from_source += k != key && src == source;
    if (from_source >= kMaxLinksPerHost) {
      *code = kResourceExhausted;
      return std::to_string(from_source) + " links from " + source + " already, the most one address may open (" +
             std::to_string(kMaxLinksPerHost) + ")";
    }
  }
  incoming_[key] = source;
  if (current) *current = it == links_.end() ? nullptr : it->second;
  *code = kSuccess;
  return "";
}

void LinkTable::release_incoming(const std::string& key) {
  std::lock_guard<util::Mutex> g(mu_);
  incoming_.erase(key);
  changed_.notify_all();
}

bool LinkTable::publish(const std::shared_ptr<Link>& link, std::shared_ptr<Link>* superseded) {
  std::lock_guard<util::Mutex> g(mu_);
  if (closed_) return false;
  auto it = links_.find(link->key);
  if (it != links_.end()) {
    if (!superseded) return false;
    *superseded = it->second;  // the caller retires it (outside mu_)
  }
  links_[link->key] = link;
  gen_.fetch_add(1, std::memory_order_release);
  sources_.erase(link->key);
  if (!link->initiator) {  // the incoming handshake's claim ends with the publication
    auto c = incoming_.find(link->key);
    if (c != incoming_.end() && !c->second.empty()) sources_[link->key] = c->second;
    if (c != incoming_.end()) incoming_.erase(c);
  }
  closed_links_.erase(link->key);
  changed_.notify_all();
  return true;
}

void LinkTable::unpublish(const std::shared_ptr<Link>& link, const std::string& why, bool by_disconnect) {
  std::lock_guard<util::Mutex> g(mu_);
  auto it = links_.find(link->key);
  if (it != links_.end() && it->second == link) {
    links_.erase(it);
    sources_.erase(link->key);
    gen_.fetch_add(1, std::memory_order_release);
    changed_.notify_all();
    if (!by_disconnect) {
      if (closed_links_.size() >= kMaxClosedRecords && !closed_links_.count(link->key))
        closed_links_.erase(closed_links_.begin());
      closed_links_[link->key] = {link->id, why};
    }
  }
  if (by_disconnect) {  // also when the peer's goodbye got here first: this link is disconnected now
    auto c = closed_links_.find(link->key);
    if (c != closed_links_.end() && c->second.first == link->id) closed_links_.erase(c);
  }
}

bool LinkTable::take_closed(const std::string& key, std::string* why) {
  std::lock_guard<util::Mutex> g(mu_);
  auto c = closed_links_.find(key);
  if (c == closed_links_.end()) return false;
  *why = std::move(c->second.second);
  closed_links_.erase(c);
  return true;
}

std::map<std::string, std::shared_ptr<Link>> LinkTable::close() {
  std::lock_guard<util::Mutex> g(mu_);
  closed_ = true;
  std::map<std::string, std::shared_ptr<Link>> out;
  out.swap(links_);
  sources_.clear();
  gen_.fetch_add(1, std::memory_order_release);
  changed_.notify_all();
  return out;
}

}  // namespace hixl::engine
