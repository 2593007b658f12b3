// Revocation for same-host peers. A same-host peer moves bytes itself (a copy into our memfd that it
// mapped, or cross-memory attach), so nothing on our side is in its way once it has checked a range.
// The fence puts one in its way: a memfd of slots that both sides map, one slot per registration.
//   - a peer's copy into a region: slot.inflight += 1, then it checks slot.tag against the tag it was
//     given for the region; a different tag (0: revoked) refuses the copy; else it copies, then
//     slot.inflight -= 1;
//   - deregistration: slot.tag = 0, then it waits until slot.inflight is 0.
// Both orders are sequentially consistent, so either the copy sees the revocation or the
// deregistration sees the copy and waits for it: once it returns, no byte of any peer lands there.
// A tag is never reused for a slot before it was drained, so a peer's stale tag never matches.
// The fence binds every peer running this library; a hostile same-host process that maps our memory
// itself is outside what shm can stop (README: security).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace hixl::transport {

struct FenceSlot {
  std::atomic<uint32_t> tag;       // the registration's tag while it is registered; 0 when revoked
  std::atomic<uint32_t> inflight;  // peers' copies in progress
};
static_assert(sizeof(FenceSlot) == 8 && std::atomic<uint32_t>::is_always_lock_free, "shared layout");
constexpr uint32_t kFenceSlots = 1u << 16;
constexpr size_t kFenceBytes = size_t(kFenceSlots) * sizeof(FenceSlot);
constexpr uint32_t kNoFence = UINT32_MAX;  // a region without a slot; a link without a fence fd

// The owner's side: the memfd, its slots, and which are free. Thread-safe (its own leaf lock).
class FenceOwner {
 public:
  FenceOwner();  // throws hixl::Error naming the call that failed
  ~FenceOwner();
  FenceOwner(const FenceOwner&) = delete;
  FenceOwner& operator=(const FenceOwner&) = delete;
  int fd() const { return fd_; }
  // A slot for a new registration, open with a fresh tag: {slot, tag}; {kNoFence, 0} when every slot
  // is in use.
  std::pair<uint32_t, uint32_t> open();
  // Revokes the slot (no copy starts afterwards) and waits up to `bound` for the copies in progress.
  // True: drained, the slot is free again. False: a copy did not end (its peer is stopped or died
  // inside it); the slot stays out of use.
  bool close(uint32_t slot, std::chrono::milliseconds bound);

 private:
  int fd_ = -1;
  FenceSlot* slots_ = nullptr;
  std::mutex mu_;
  std::vector<uint32_t> free_;  // slots drained and free again
  uint32_t fresh_ = 0;          // slots never used: [fresh_, kFenceSlots)
  uint32_t next_tag_ = 0;
};

}  // namespace hixl::transport
