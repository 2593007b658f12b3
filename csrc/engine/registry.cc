#include "engine/registry.h"

#include <algorithm>
#include <chrono>

#include "acl/allocator.h"
#include "engine/internal.h"
#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::engine {

using detail::fail;
using detail::ok;

namespace {
constexpr std::chrono::milliseconds kFenceDrain{5000};  // a copy holds a slot for 16 MiB at most
}  // namespace

std::pair<int, uint64_t> Registry::same_range(uint64_t handle, uint64_t addr, uint64_t len, uint32_t access) const {
  const LocalRegion& r = regions_.at(handle);
  if (r.access != access)
    return {fail(kParamInvalid, CallDesc("register_mem").hex("addr", addr).arg("len", len).hex("access", access).str() +
                                    ": already registered with access " + std::to_string(r.access) +
                                    " (deregister it first)"),
            0};
  return {ok(), handle};
}

std::pair<int, uint64_t> Registry::add(uint64_t addr, uint64_t len, MemType type, uint32_t access, bool* added) {
  *added = false;
  if (addr == 0 || len == 0 || addr + len < addr)
    return {fail(kParamInvalid, CallDesc("register_mem").hex("addr", addr).arg("len", len).str() +
                                    ": need a non-null address, length > 0, no wrap-around"),
            0};
  if (type != MemType::kDevice && type != MemType::kHost)
    return {fail(kParamInvalid, "register_mem: unknown mem type " + std::to_string(int(type))), 0};
  if (access & ~uint32_t(wire::kRemoteRead | wire::kRemoteWrite))
    return {fail(kParamInvalid, CallDesc("register_mem").hex("access", access).str() +
                                    ": access must combine REMOTE_READ (1) and REMOTE_WRITE (2) only"),
            0};
  {
    std::lock_guard<util::Mutex> g(mu_);  // the same range again: the same handle
    auto it = by_range_.find({addr, len});
    if (it != by_range_.end()) return same_range(it->second, addr, len, access);
  }
  std::shared_ptr<verbs::MemoryRegion> mr;  // made outside mu_: ibv_reg_mr pins pages, which takes time
  if (pd_) {
    try {
      // LOCAL_WRITE always: a region is also the destination of our own READs.
      int flags = IBV_ACCESS_LOCAL_WRITE | (access & wire::kRemoteWrite ? IBV_ACCESS_REMOTE_WRITE : 0) |
                  (access & wire::kRemoteRead ? IBV_ACCESS_REMOTE_READ : 0);
      mr = std::make_shared<verbs::MemoryRegion>(pd_, reinterpret_cast<void*>(addr), size_t(len), flags);
    } catch (const Error& e) {
      int code = (e.err() == EFAULT || e.err() == EINVAL) ? kParamInvalid : kFailed;
      return {fail(code, e.what()), 0};
    }
  }
  if (!fence_) return {fail(kFailed, "register_mem: the engine is not initialized"), 0};
  auto [slot, tag] = fence_->open();  // before mu_: the fence has a lock of its own
  if (slot == transport::kNoFence)
    return {fail(kResourceExhausted, CallDesc("register_mem").hex("addr", addr).arg("len", len).str() + ": " +
                                         std::to_string(transport::kFenceSlots) + " regions are registered"),
            0};
  std::unique_lock<util::Mutex> g(mu_);
  auto refuse = [&](std::pair<int, uint64_t> r) {
    g.unlock();
    fence_->close(slot, std::chrono::milliseconds(0));  // never offered to a peer: nothing to wait for
    return r;
  };
  if (closed_) return refuse({fail(kFailed, "register_mem: the engine was finalized meanwhile"), 0});
  auto it = by_range_.find({addr, len});
  if (it != by_range_.end()) return refuse(same_range(it->second, addr, len, access));  // another thread won
  const uint64_t handle = next_handle_++;
  ++version_;
  LocalRegion lr{addr, len, type, access, mr};
  lr.fence = slot;
  lr.tag = tag;
  if (auto info = acl::lookup(reinterpret_cast<const void*>(addr));
      info && info->fd >= 0 && addr + len <= info->base + info->size) {
    lr.fd = info->fd;  // the shim's memfd: same-host peers map it instead of cross-memory attach
    lr.fd_offset = info->offset;
  }
  regions_[handle] = lr;
  by_range_[{addr, len}] = handle;
  table_.insert({addr, len, mr ? mr->lkey() : 0, access, handle});
  *added = true;
  return {ok(), handle};
}

int Registry::remove(uint64_t handle, bool* removed) {
  *removed = false;
  std::shared_ptr<verbs::MemoryRegion> mr;  // released after mu_ (ibv_dereg_mr can be slow)
  std::unique_lock<util::Mutex> lk(mu_);
  if (handle == 0 || handle >= next_handle_)
    return fail(kParamInvalid, "deregister_mem(handle=" + std::to_string(handle) + "): never issued");
  auto it = regions_.find(handle);
  if (it == regions_.end()) return ok();  // already deregistered: idempotent
  mr = std::move(it->second.mr);
  const uint32_t fence = it->second.fence;
  ++version_;
  by_range_.erase({it->second.addr, it->second.len});
  table_.erase(handle);  // from here no new request is let in
  regions_.erase(it);
  *removed = true;
  // A tcp request already moving bytes of this region is cut (shutdown(2) of its connection, which
  // ends its socket I/O at once): we wait for it to let go, never for the peer.
  auto holds = [handle](const Use* u) {
    return std::find(u->regions.begin(), u->regions.end(), handle) != u->regions.end();
  };
  for (Use* u : uses_)
    if (holds(u) && !u->was_cut) {
      u->was_cut = true;
      u->cut();
    }
  if (!uses_cv_.wait_for(lk, std::chrono::seconds(30), [&] { return std::none_of(uses_.begin(), uses_.end(), holds); }))
    return fail(kFailed, "deregister_mem(handle=" + std::to_string(handle) + "): a tcp request into the region did "
                         "not end within 30 s of being cut; it may still write there");
  lk.unlock();
  // Same-host peers: no copy starts after this; one in progress is waited for (memory, not network).
  if (!fence_->close(fence, kFenceDrain))
    return fail(kFailed, "deregister_mem(handle=" + std::to_string(handle) + "): a same-host peer's copy into the "
                         "region did not end within " + std::to_string(kFenceDrain.count()) + " ms (the peer is "
                         "stopped or died inside it); its bytes may still land there: do not reuse that memory");
  return ok();
}

void Registry::open_fence() {
  if (!fence_) fence_ = std::make_unique<transport::FenceOwner>();
}

bool Registry::begin(Use* use, const transport::Range* ranges, size_t n, bool write) {
  const uint32_t access = write ? wire::kRemoteWrite : wire::kRemoteRead;
  use->regions.clear();
  use->was_cut = false;
  std::lock_guard<util::Mutex> g(mu_);
  const RegionEntry* last = nullptr;
  for (size_t i = 0; i < n; ++i) {
    const transport::Range r = ranges[i];
    if (last && last->contains(r.addr, r.len)) continue;
    if (!(last = table_.find(r.addr, r.len, access))) return false;
    if (std::find(use->regions.begin(), use->regions.end(), last->id) == use->regions.end())
      use->regions.push_back(last->id);
  }
  uses_.push_back(use);
  return true;
}

void Registry::end(Use* use) {
  {
    std::lock_guard<util::Mutex> g(mu_);
    uses_.erase(std::find(uses_.begin(), uses_.end(), use));
  }
  uses_cv_.notify_all();
}

std::vector<wire::Region> Registry::regions(uint64_t* version) const {
  std::lock_guard<util::Mutex> g(mu_);
  if (version) *version = version_;
  std::vector<wire::Region> out;
  out.reserve(regions_.size());
  for (const auto& [h, r] : regions_) {
    (void)h;
    out.push_back({r.addr, r.len, r.mr ? r.mr->rkey() : 0, r.access, r.fence, r.tag});
  }
  return out;
}

std::vector<wire::Extent> Registry::extents() const {
  std::lock_guard<util::Mutex> g(mu_);
  std::vector<wire::Extent> out;
  for (const auto& [h, r] : regions_)
    if (r.fd >= 0) out.push_back({r.addr, r.len, r.fd_offset, uint32_t(r.fd)});
  return out;
}

int Registry::resolve_local(const OpDesc* descs, size_t n, std::vector<rdma::Desc>* out) const {
  out->resize(n);
  std::lock_guard<util::Mutex> g(mu_);
  const RegionEntry* last = nullptr;
  for (size_t i = 0; i < n; ++i) {
    const OpDesc d = descs[i];
    if (d.len == 0 || d.local_addr + d.len < d.local_addr || d.remote_addr + d.len < d.remote_addr)
      return fail(kParamInvalid, CallDesc("transfer").arg("desc", i).hex("local_addr", d.local_addr)
                                     .hex("remote_addr", d.remote_addr).arg("len", d.len).str() +
                                     ": empty or wrapping range");
    if (!(last && last->contains(d.local_addr, d.len))) last = table_.find(d.local_addr, d.len, 0);
    if (!last)
      return fail(kParamInvalid, CallDesc("transfer").arg("desc", i).hex("local_addr", d.local_addr)
                                     .arg("len", d.len).str() + ": local range is not inside a registered region");
    rdma::Desc& r = (*out)[i];
    r.local_addr = d.local_addr;
    r.remote_addr = d.remote_addr;
    r.length = d.len;
    r.lkey = last->key;
    r.has_lkey = true;
  }
  return kSuccess;
}

size_t Registry::resolve_blocks(const uint64_t* addr, const uint64_t* len, size_t n, uint32_t* keys, uint8_t* flags,
                                uint8_t ok_flag, uint64_t* version) const {
  std::lock_guard<util::Mutex> g(mu_);
  *version = version_;
  size_t first_bad = n;
  const RegionEntry* last = nullptr;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t a = addr[i], l = len[i];
    if (!(last && last->contains(a, l))) last = table_.find(a, l, 0);  // l == 0 or wrapping: none
    keys[i] = last ? last->key : 0;
    flags[i] = last ? ok_flag : 0;
    if (!last && first_bad == n) first_bad = i;
  }
  return first_bad;
}

void Registry::close() {
  std::vector<uint32_t> slots;
  {
    std::lock_guard<util::Mutex> g(mu_);
    closed_ = true;
    for (const auto& [h, r] : regions_) slots.push_back(r.fence);
    regions_.clear();
    by_range_.clear();
    table_.clear();
  }
  // Same-host peers that have not yet seen the links close: no copy of theirs starts from here on.
  for (uint32_t slot : slots)
    if (fence_ && !fence_->close(slot, kFenceDrain))
      log::warn("finalize: a same-host peer's copy into a registered region did not end within " +
                std::to_string(kFenceDrain.count()) + " ms (the peer is stopped or died inside it)");
}

size_t Registry::size() const {
  std::lock_guard<util::Mutex> g(mu_);
  return regions_.size();
}

}  // namespace hixl::engine
