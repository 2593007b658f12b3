// Prepared descriptor lists (NIXL's prep_xfer_dlist, CANN's block lists): a list of blocks, ours or
// a peer's, validated and resolved to their keys once, so that a transfer is a pair of index arrays
// into two lists and costs no region lookup per descriptor.
//
// Safety is kept, not skipped: a list remembers the version of the table it was resolved against
// (our registry's version for a local list; for a remote one, the link and the version of the
// peer's region list it sent). A transfer that finds a newer version (a (de)registration here or
// there, a new link) resolves the list again first, and refuses it (PARAM_INVALID naming the block)
// when a block is no longer inside a region. Every index is bounds-checked, the two blocks of a
// pair must have the same length, and a remote block must lie in a region the peer opened for the
// operation (remote write for WRITE, remote read for READ).
//
// Locks: DescLists::mu_ (the table of lists; a leaf). Each list's own `mu` guards its keys and
// version while a transfer reads or re-resolves them; a transfer takes its local list's, then its
// remote list's, then (to re-resolve) Registry::mu_ or the link's `mu`.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/link.h"
#include "util/id_slab.h"

namespace hixl::engine {

struct DescList {
  static constexpr uint8_t kLocalOk = 4;  // flags of a local block: inside a registered region

  bool remote = false;
  std::string peer;  // remote: the peer's canonical name
  std::vector<uint64_t> addr, len;

  std::mutex mu;  // below
  // Local: lkeys, flags kLocalOk. Remote: the rkey of a region allowing remote read (key) and one
  // allowing remote write (wkey), flags wire::kRemoteRead / kRemoteWrite for those found. A block
  // that lost its region has no flag: transfers that use it are refused, others go on.
  std::vector<uint32_t> key, wkey;
  std::vector<uint8_t> flags;
  uint64_t version = 0;      // of the table the keys came from
  std::weak_ptr<Link> link;  // remote: the link they came from (a new link: resolve again)

  size_t size() const { return addr.size(); }
  // Remote: fills key / wkey / flags from the link's copy of the peer's regions (its `mu` held by
  // the caller) and takes its version. Returns the first block no region holds, or size().
  size_t resolve_remote_locked(const Link& link);
};

class DescLists {
 public:
  // A handle (never 0), or 0 when too many lists are live.
  uint64_t add(std::shared_ptr<DescList> list);
  std::shared_ptr<DescList> get(uint64_t handle) const;  // null: unknown (never issued or released)
  bool remove(uint64_t handle);                           // false: unknown
  size_t size() const;
  void clear();

 private:
  mutable std::mutex mu_;
  util::IdSlab<std::shared_ptr<DescList>> lists_;
};

}  // namespace hixl::engine
