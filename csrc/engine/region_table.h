// Address ranges with a key (lkey/rkey) and access bits, searchable for "which region contains
// [addr, addr+len)". Used for the engine's local registrations and its cache of each peer's regions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace hixl::engine {

struct RegionEntry {
  uint64_t addr = 0;
  uint64_t len = 0;
  uint32_t key = 0;     // lkey for local regions, rkey for remote ones
  uint32_t access = 0;  // wire::RegionAccess bits
  uint64_t id = 0;      // registration handle (local) or position (remote)
  // All of [a, a+n) inside this region (n > 0; written so that nothing overflows).
  bool contains(uint64_t a, uint64_t n) const { return n && n <= len && a >= addr && a - addr <= len - n; }
};

class RegionTable {
 public:
  void assign(std::vector<RegionEntry> entries);  // replaces everything
  void insert(const RegionEntry& e);
  bool erase(uint64_t id);
  void clear() { v_.clear(); max_len_ = 0; }
  // The region holding all of [addr, addr+len) with every bit of need_access, or nullptr.
  // len 0 or a range that wraps never matches. Overlapping regions are allowed. Not thread-safe
  // (it remembers its last hit): the owner's lock guards every call, as it guards the table.
  const RegionEntry* find(uint64_t addr, uint64_t len, uint32_t need_access) const;
  size_t size() const { return v_.size(); }
  const std::vector<RegionEntry>& entries() const { return v_; }

 private:
  void recompute_max();
  std::vector<RegionEntry> v_;  // sorted by addr
  uint64_t max_len_ = 0;        // bounds the backward walk in find()
  mutable size_t hint_ = SIZE_MAX;  // the last hit (checked before the search)
};

}  // namespace hixl::engine
