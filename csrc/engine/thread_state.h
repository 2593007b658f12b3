// What the engine keeps per calling thread, in one thread_local: in a shared object (the Python
// module) every access to a thread_local is a call to __tls_get_addr (~30 instructions), so a
// transfer looks its thread's state up once and passes it on, instead of once per piece.
#pragma once

#include <string>
#include <vector>

#include "engine/link_table.h"
#include "transport/rdma_endpoint.h"
#include "util/recent_clock.h"

namespace hixl::engine {

struct ThreadState {
  std::string last_error;           // detail::last_error(): why this thread's last call did not succeed
  std::vector<rdma::Desc> scratch;  // a transfer's checked descriptors (reused: no allocation per transfer)
  LinkLookup last_link;             // LinkTable::find's answer to this thread's last lookup
  util::RecentClock clock;          // an async transfer's start: its deadline's base
};

ThreadState& thread_state();

}  // namespace hixl::engine
