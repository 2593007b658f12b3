// The link table: the current link to each peer (by canonical name), the claims of handshakes in
// progress on peer names (ours and theirs), and the records of links that ended without our
// disconnect(). Publishing a link ends its handshake's claim; a newer link from the same peer
// supersedes the old one (the caller retires it, once it proved the old one dead: connector.cc).
// It also counts the links peers opened from each source address (kMaxLinksPerHost).
//
// Lock: `mu_`, guarding everything here; nothing else is taken while it is held (a link's own locks
// neither).
// find() answers a thread's repeated lookup of one peer without it: `gen_` counts the changes of
// `links_` (bumped under mu_), and the caller's last answer (a LinkLookup, kept per thread in
// engine/thread_state.h) stands while gen_ has not moved.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/link.h"
#include "util/mutex.h"

namespace hixl::engine {

// One thread's last answer of LinkTable::find. The link is held weakly: a link taken out of the
// table is not kept alive by a thread that looked it up once (only its memory block is, until that
// thread's next lookup).
struct LinkLookup {
  uint64_t table = 0;  // LinkTable::id_ (ids are never reused, addresses can be)
  uint64_t gen = 0;
  std::string key;
  std::weak_ptr<Link> link;
};

class LinkTable {
 public:
  LinkTable();
  // The current link to key, or null. last: the calling thread's last answer, to answer from while
  // the table did not change, and updated here (null: look in the table).
  std::shared_ptr<Link> find(const std::string& key, LinkLookup* last = nullptr) const;
  std::vector<std::shared_ptr<Link>> all() const;
  std::vector<std::string> keys() const;
  bool empty() const;

  // Our connect() to `key` may start (kSuccess, and key is claimed), or why not: kAlreadyConnected
  // (a link exists, or a handshake with key is in progress: then *busy is set), kFailed (closed).
  // Messages name the call.
  int claim_outgoing(const std::string& key, bool* busy = nullptr);
  void release_outgoing(const std::string& key);
  // A peer's handshake with us may go on: "" (and key is claimed until publish()), else the reason
  // and the status to refuse it with. self: this engine's name; peer_listens: the peer has a port;
  // peer_instance: its engine instance; source: the address it connects from ("": not counted),
  // which may have at most kMaxLinksPerHost links and claims; *current (when not null): the link to
  // key now, which the claim may replace only once it is proven dead.
  std::string claim_incoming(const std::string& key, const std::string& self, bool peer_listens, uint64_t peer_instance,
                             int* code, const std::string& source = "", std::shared_ptr<Link>* current = nullptr);
  void release_incoming(const std::string& key);
  // Waits until a link to key is published (true), or until no handshake with key is in progress
  // any more and none is, the table closed, or the deadline passed (false). settle_only: return
  // as soon as no handshake is in progress (also when no link came of it).
  bool wait_link(const std::string& key, std::chrono::steady_clock::time_point deadline, bool settle_only);

  // Publishes a link whose path is built: false when the table is closed, or when a link to that
  // peer exists and superseded is null; else *superseded gets the replaced link. Ends an incoming
  // claim and forgets the peer's closed record.
  bool publish(const std::shared_ptr<Link>& link, std::shared_ptr<Link>* superseded);
  // Takes the link out if it is still the current one. by_disconnect: our own disconnect(); any
  // other end is remembered (bounded), so that the user's later disconnect() still succeeds.
  void unpublish(const std::shared_ptr<Link>& link, const std::string& why, bool by_disconnect);
  // Consumes the record of key's link that ended without our disconnect(): true (and why) if one was there.
  bool take_closed(const std::string& key, std::string* why);

  // Finalize: every link is taken out and returned; publish() and claims fail from now on.
  std::map<std::string, std::shared_ptr<Link>> close();

 private:
  static constexpr size_t kMaxClosedRecords = 4096;
  const uint64_t id_;  // unique in the process: names this table in each thread's last lookup
  mutable util::Mutex mu_;
  std::condition_variable_any changed_;  // a claim ended, a link was published or taken out, closed
  std::atomic<uint64_t> gen_{1};  // bumped whenever links_ changes
  bool closed_ = false;
  std::map<std::string, std::shared_ptr<Link>> links_;  // by canonical peer name
  std::set<std::string> connecting_;                    // our outgoing handshakes
  std::map<std::string, std::string> incoming_;         // handshakes peers started with us -> source address
  std::map<std::string, std::string> sources_;          // links peers opened -> their source address
  // peer -> (link id, why): links that ended without our disconnect() (peer's goodbye or finalize,
  // failure, abort). connect() clears it.
  std::map<std::string, std::pair<uint64_t, std::string>> closed_links_;
};

}  // namespace hixl::engine
