// Same-host data path: the initiator's CPU moves bytes straight into (or out of) the peer's
// registered memory; the peer's CPU does nothing. Regions backed by a memfd (the hixl.acl shim)
// are mapped from /proc/<pid>/fd/<fd> and copied with memcpy; any other registered memory is
// reached with cross-memory attach (process_vm_writev / process_vm_readv). Both need the same
// permission as ptrace attach (same uid, Yama ptrace_scope 0, or 1 with a ptracer grant); shm_probe()
// tells at connect time whether it works. Every copy into or out of a peer region holds that region's
// slot of the peer's fence (shm_fence.h), so that the peer's deregistration is a fence here too.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "transport/data_path.h"
#include "transport/shm_fence.h"
#include "wire/control.h"

namespace hixl::transport {

// Reads 8 bytes at `addr` in process `pid` with process_vm_readv; "" if that gives `expect`,
// else why not (errno and a hint).
std::string shm_probe(pid_t pid, uint64_t addr, uint64_t expect);
// This boot's id (/proc/sys/kernel/random/boot_id): equal on both ends = same host (same kernel).
std::string boot_id();

class ShmPath final : public QueuedPath {
 public:
  ShmPath(pid_t peer_pid, std::string peer);
  ~ShmPath() override;
  const char* name() const override { return "shm"; }
  // The peer's memfd-backed regions (its fd numbers, opened as /proc/<pid>/fd/<fd>). Replaces the
  // previous list; mappings are made on first use.
  void set_extents(const std::vector<wire::Extent>& extents);
  // The peer's regions (their fence slots and tags), whole; replaces the previous list unless that
  // came with a newer registry version.
  void set_regions(const std::vector<wire::Region>& regions, uint64_t version);
  // Maps the peer's fence memfd (its fd number there). Throws hixl::Error naming the call that
  // failed: a peer whose revocations we cannot see gets no shm path.
  void set_fence(uint32_t fd);
  bool peer_alive() const;

 protected:
  Result execute(Op op, const std::vector<Desc>& descs, Clock::time_point deadline) override;
  Result copy(Op op, const std::vector<Desc>& descs, Clock::time_point deadline, std::vector<iovec>* liov,
              std::vector<iovec>* riov, std::vector<uint32_t>* held);
  // Up to 64 KiB, an async request costs less copied here than handed to the worker thread.
  uint64_t inline_bytes() const override { return kInlineBytes; }

 public:
  static constexpr uint64_t kInlineBytes = 64u << 10;

 private:
  struct View {  // one mmap of a peer memfd; unmapped when the last user lets go
    uint8_t* base = nullptr;
    size_t len = 0;
    uint8_t* at = nullptr;  // where the extent's addr lands in our address space
    ~View();
  };
  struct Mapping {
    wire::Extent ext;
    std::shared_ptr<View> view;  // null until first use
    bool failed = false;         // mapping impossible: use cross-memory attach for this extent
  };
  // The mapping holding [addr, addr+len) and a pointer to addr in it; null: not memfd-backed (or not
  // mappable). The shared_ptr keeps the mapping alive while a copy uses it, even if a region update
  // drops the extent meanwhile.
  std::shared_ptr<View> mapped_locked(uint64_t addr, uint64_t len, uint8_t** at);
  // The peer region holding [addr, addr+len): its fence slot and tag (false: none, it was deregistered)
  // and, when it is memfd-backed, the mapping and a pointer to addr in it (as mapped_locked).
  bool locate(uint64_t addr, uint64_t len, uint32_t* slot, uint32_t* tag, std::shared_ptr<View>* view, uint8_t** at);
  // The fence slots a request holds; leave_all() lets go of them.
  bool enter(uint32_t slot, uint32_t tag, std::vector<uint32_t>* held);
  void leave_all(std::vector<uint32_t>* held);

  pid_t pid_;
  std::string peer_;
  int pidfd_ = -1;
  std::mutex map_mu_;
  std::map<uint64_t, Mapping> maps_;  // by extent addr
  std::vector<wire::Region> regions_;  // the peer's, sorted by addr (under map_mu_)
  uint64_t regions_version_ = 0;
  size_t hint_ = 0;                    // the last region found
  FenceSlot* fence_ = nullptr;         // the peer's fence, mapped
};

}  // namespace hixl::transport
