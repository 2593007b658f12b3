#include "transport/shm_fence.h"

#include <sys/mman.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "verbs/error.h"

namespace hixl::transport {

FenceOwner::FenceOwner() {
  fd_ = ::memfd_create("hixl-fence", MFD_CLOEXEC);
  if (fd_ < 0) {
    int err = errno;
    throw Error("memfd_create(name=hixl-fence): " + errno_str(err), err);
  }
  if (::ftruncate(fd_, off_t(kFenceBytes)) != 0) {
    int err = errno;
    ::close(fd_);
    throw Error(CallDesc("ftruncate").arg("fd", fd_).arg("len", kFenceBytes).str() + ": " + errno_str(err), err);
  }
  void* p = ::mmap(nullptr, kFenceBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd_);
    throw Error(CallDesc("mmap").arg("fd", fd_).arg("len", kFenceBytes).str() + ": " + errno_str(err), err);
  }
  slots_ = static_cast<FenceSlot*>(p);  // zero-filled: every tag 0, nothing in flight
  next_tag_ = std::random_device{}();   // tags of two engine objects in one process differ too
}

FenceOwner::~FenceOwner() {
  if (slots_) ::munmap(slots_, kFenceBytes);
  if (fd_ >= 0) ::close(fd_);
}

std::pair<uint32_t, uint32_t> FenceOwner::open() {
  std::lock_guard<std::mutex> g(mu_);
  uint32_t slot;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else if (fresh_ < kFenceSlots) {
    slot = fresh_++;
  } else {
    return {kNoFence, 0};
  }
  if (++next_tag_ == 0) ++next_tag_;
  slots_[slot].tag.store(next_tag_, std::memory_order_seq_cst);
  return {slot, next_tag_};
}

bool FenceOwner::close(uint32_t slot, std::chrono::milliseconds bound) {
  if (slot >= kFenceSlots) return true;
  FenceSlot& s = slots_[slot];
  s.tag.store(0, std::memory_order_seq_cst);
  const auto deadline = std::chrono::steady_clock::now() + bound;
  for (int spins = 0; s.inflight.load(std::memory_order_seq_cst) != 0; ++spins) {
    // A copy holds its slot for one request, or one 16 MiB chunk of a bigger one: yield first, then
    // sleep a little.
    if (std::chrono::steady_clock::now() >= deadline) return false;
    if (spins < 100)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::lock_guard<std::mutex> g(mu_);
  free_.push_back(slot);
  return true;
}

}  // namespace hixl::transport
