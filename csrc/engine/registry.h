// The registry: this engine's local regions. It owns the registrations (their MRs on the shared
// protection domain, the memfds same-host peers map), the range table every transfer is checked
// against, the version peers use to keep the newest list, and the data lock.
//
// Locks: `mu_` guards everything here and is a leaf (nothing else is taken while it is held). A tcp
// peer's request holds the regions it touches (transport::ServedMemory) without a lock while its
// bytes move; remove() cuts such a request and waits only for it to let go, so that once remove()
// returns nothing of a tcp peer lands in the region any more. Same-host peers check the region's fence
// slot before each copy (transport/shm_fence.h): remove() revokes the slot and waits for their copies
// in progress, so the same holds for them. (rdma: ibv_dereg_mr is the fence.)
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/region_table.h"
#include "engine/types.h"
#include "transport/served_memory.h"
#include "transport/shm_fence.h"
#include "util/mutex.h"
#include "verbs/resources.h"
#include "wire/control.h"

namespace hixl::engine {

class Registry final : public transport::ServedMemory {
 public:
  // The protection domain MRs go on (null: no RDMA device; regions then have no MR). Set once, at
  // the engine's initialize(), before any add().
  void set_pd(std::shared_ptr<verbs::ProtectionDomain> pd) { pd_ = std::move(pd); }
  // The fence same-host peers check before each copy (transport/shm_fence.h). Made once, at the
  // engine's initialize(), before any add(); throws hixl::Error naming the call that failed.
  void open_fence();
  int fence_fd() const { return fence_ ? fence_->fd() : -1; }

  // A handle for [addr, addr+len): the same one for the same range with the same access; kParamInvalid
  // for bad arguments or the same range with other access. Status codes as Engine::register_mem.
  // *added: a new registration (peers must learn it), not an existing handle.
  std::pair<int, uint64_t> add(uint64_t addr, uint64_t len, MemType type, uint32_t access, bool* added);
  // kSuccess (also for a handle already removed), kParamInvalid for one never issued.
  // *removed: a registration went (peers must learn it).
  int remove(uint64_t handle, bool* removed);

  std::vector<wire::Region> regions(uint64_t* version = nullptr) const;  // for peers: addr, len, rkey, access
  std::vector<wire::Extent> extents() const;                            // memfd-backed ones (same-host peers)
  // Fills each descriptor's local half (address, length, lkey) from descs; kParamInvalid naming the
  // first descriptor that is empty, wraps, or lies outside every registered region.
  // Each descriptor is read once: what is checked is what the caller posts (*out).
  int resolve_local(const OpDesc* descs, size_t n, std::vector<rdma::Desc>* out) const;
  // A prepared list's blocks: keys[i] = the lkey of the region holding [addr[i], addr[i]+len[i])
  // and flags[i] = ok_flag, or flags[i] = 0 when none does (empty, wrapping or unregistered);
  // *version = the registry's version they were resolved at. Returns the first block without a
  // region, or n.
  size_t resolve_blocks(const uint64_t* addr, const uint64_t* len, size_t n, uint32_t* keys, uint8_t* flags,
                        uint8_t ok_flag, uint64_t* version) const;
  // Bumped by every (de)registration: a prepared list resolved at an older version is resolved again.
  uint64_t version() const { return version_.load(std::memory_order_acquire); }
  // A tcp peer's request (ServedMemory): every range inside one region that allows the access; the
  // regions are then held until end(). remove() of a held region cuts the request and waits for end().
  bool begin(Use* use, const transport::Range* ranges, size_t n, bool write) override;
  void end(Use* use) override;

  // The engine finalized (after every queue pair is gone): every registration is dropped (each fence
  // slot revoked and drained, as remove() does) and add() refuses from now on.
  void close();
  size_t size() const;

 private:
  struct LocalRegion {
    uint64_t addr = 0, len = 0;
    MemType type = MemType::kHost;
    uint32_t access = wire::kRemoteRead | wire::kRemoteWrite;  // what peers may do (wire::RegionAccess)
    std::shared_ptr<verbs::MemoryRegion> mr;  // null without an RDMA device
    int fd = -1;              // memfd behind it (hixl.acl memory): same-host peers map it
    uint64_t fd_offset = 0;
    uint32_t fence = transport::kNoFence, tag = 0;  // its slot in fence_ and the slot's tag
  };
  std::pair<int, uint64_t> same_range(uint64_t handle, uint64_t addr, uint64_t len, uint32_t access) const;

  std::shared_ptr<verbs::ProtectionDomain> pd_;
  std::unique_ptr<transport::FenceOwner> fence_;  // set once by open_fence(), kept to the end
  mutable util::Mutex mu_;
  std::map<uint64_t, LocalRegion> regions_;
  std::map<std::pair<uint64_t, uint64_t>, uint64_t> by_range_;
  RegionTable table_;
  uint64_t next_handle_ = 1;
  std::atomic<uint64_t> version_{1};  // bumped on every (de)registration (under mu_); peers keep the newest list
  bool closed_ = false;
  std::vector<Use*> uses_;                 // tcp requests being served, and the regions each holds
  std::condition_variable_any uses_cv_;    // an end(): remove() waits for the uses it cut
};

}  // namespace hixl::engine
