// What a data path that serves a peer's requests (tcp) needs from the owner of the memory: each
// request's ranges checked against the registrations, and those registrations held while the
// request's bytes move. A deregistration never waits on the network for them: it cuts the requests
// that touch its region (their connection is shut down, so their socket I/O ends at once) and waits
// only for them to let go. No lock is held while a request's bytes move.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace hixl::transport {

struct Range {
  uint64_t addr = 0, len = 0;
};

class ServedMemory {
 public:
  // One request being served. Owned by the serving thread; the memory owner reads and writes it
  // only between begin() and end(), under its own lock.
  struct Use {
    std::function<void()> cut;      // ends the request's socket I/O now (set once by the path)
    std::vector<uint64_t> regions;  // what the request touches (filled by begin)
    bool was_cut = false;           // a deregistration cut it
  };
  virtual ~ServedMemory() = default;
  // True when every range lies inside one region that allows the access; then the regions are held
  // until end(use). False: nothing is held.
  virtual bool begin(Use* use, const Range* ranges, size_t n, bool write) = 0;
  virtual void end(Use* use) = 0;
};

}  // namespace hixl::transport
