// Handshakes in progress: the sockets in one (so that finalize can shut them down instead of waiting
// for their deadlines), and the limits on the incoming ones served at once (kMaxHandshakes in all,
// kMaxHandshakesPerHost from one address), over which a new connection is refused at once.
//
// Lock: `mu_`, a leaf.
#pragma once

#include <chrono>
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

  // A slot to serve an incoming connection from `host`; false (and *refusal set to a log line, at
  // most once a second) when over a limit. Every taken slot is given back with release().
  bool acquire(const std::string& host, const std::string& from, const std::string& owner, std::string* refusal);
  void release(const std::string& host);
  int serving() const;

  void close();  // shuts down every socket in a handshake now and any that registers later

 private:
  mutable std::mutex mu_;
  bool closed_ = false;
  std::set<oob::Socket*> sockets_;
  int serving_ = 0;                        // incoming connections being served (kMaxHandshakes)
  std::map<std::string, int> by_host_;     // ... by peer IP (kMaxHandshakesPerHost)
  std::chrono::steady_clock::time_point last_limit_log_{};  // refusals over the limits: one warning a second
  size_t limit_refusals_ = 0;
};

}  // namespace hixl::engine
