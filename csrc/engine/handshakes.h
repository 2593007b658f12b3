// Handshakes in progress: the sockets in one (so that finalize can shut them down instead of waiting
// for their deadlines), and the slots of the incoming ones served at once (kMaxHandshakes in all,
// kMaxHandshakesPerHost from one address).
//
// An incoming slot goes through stages: idle (accepted, nothing received yet), started (bytes came,
// the peer has not proved anything yet) and settled (it proved the token, or without one its first
// frame came whole). A new connection over a limit takes the slot of the oldest idle one (of its own
// address when that address is at its limit, else of any; idle for sure: its thread watches the
// socket and no byte is waiting there), else of the oldest unsettled one; only when
// every slot in the way is settled is it refused (RESOURCE_EXHAUSTED). The dropped slot's socket is
// shut down for reading, which wakes its handshake thread: that one answers RESOURCE_EXHAUSTED and
// ends. So connections that hold slots without finishing a handshake cannot lock a peer out: a
// legitimate peer sends its first frame at once, and the oldest unfinished slots go first.
//
// Lock: `mu_`, a leaf.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "transport/oob.h"

namespace hixl::engine {

class Handshakes {
 public:
  // Registers a socket for the length of a handshake (shut down at once when already closed).
  class Guard {
   public:
    Guard(Handshakes& h, oob::Socket* s);
    ~Guard();
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;

   private:
    Handshakes& h_;
    oob::Socket* s_;
  };

  enum class Stage { kIdle, kStarted, kSettled };

  // The slot of an incoming connection from `host` (an id > 0), dropping an unsettled one to make
  // room when over a limit; 0 when every slot in the way is settled. *note: a log line (at most one
  // a second) about a refusal or a drop.
  uint64_t admit(const std::string& host, const std::string& from, const std::string& owner, std::string* note);
  // The socket of slot `id` for as long as its handshake may still be dropped (a drop shuts it down
  // for reading; attach after a drop does so at once). Detach before the socket closes or moves.
  void attach(uint64_t id, oob::Socket* s);
  void detach(uint64_t id);
  // Moves slot `id` on to `stage`; false when it was dropped (then it must end, answering
  // RESOURCE_EXHAUSTED). A settled slot is never dropped.
  bool advance(uint64_t id, Stage stage);
  bool dropped(uint64_t id) const;
  void release(uint64_t id);  // every admitted slot is released once

  // A slot without dropping anyone (false when over a limit), given back with release(host).
  bool acquire(const std::string& host, const std::string& from, const std::string& owner, std::string* refusal);
  void release(const std::string& host);
  int serving() const;

  void close();  // shuts down every socket in a handshake now and any that registers later

 private:
  struct Slot {
    std::string host;
    Stage stage = Stage::kIdle;
    oob::Socket* socket = nullptr;
    bool dropped = false;
  };
  uint64_t take_locked(const std::string& host, const std::string& from, const std::string& owner, bool may_drop,
                       std::string* note);
  // The oldest unsettled slot (those surely idle first: nothing on the socket its thread watches), of
  // `host` when not null: dropped; false when none.
  bool drop_oldest_locked(const std::string* host, std::string* victim);
  bool note_due_locked();  // one log line a second

  mutable std::mutex mu_;
  bool closed_ = false;
  std::set<oob::Socket*> sockets_;
  std::map<uint64_t, Slot> slots_;         // by id: ids grow, so the oldest comes first
  uint64_t next_id_ = 1;
  int serving_ = 0;                        // slots not dropped (kMaxHandshakes)
  std::map<std::string, int> by_host_;     // ... by peer IP (kMaxHandshakesPerHost)
  std::chrono::steady_clock::time_point last_note_{};  // refusals and drops: one warning a second
  size_t limit_refusals_ = 0;
  size_t drops_ = 0;
};

}  // namespace hixl::engine
