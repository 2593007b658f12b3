#include "engine/region_table.h"

#include <algorithm>

namespace hixl::engine {

namespace {
bool by_addr(const RegionEntry& a, const RegionEntry& b) { return a.addr < b.addr; }
}  // namespace

void RegionTable::recompute_max() {
  max_len_ = 0;
  for (const auto& e : v_) max_len_ = std::max(max_len_, e.len);
}

void RegionTable::assign(std::vector<RegionEntry> entries) {
  v_ = std::move(entries);
  std::stable_sort(v_.begin(), v_.end(), by_addr);
  recompute_max();
}

void RegionTable::insert(const RegionEntry& e) {
  v_.insert(std::upper_bound(v_.begin(), v_.end(), e, by_addr), e);
  max_len_ = std::max(max_len_, e.len);
}

bool RegionTable::erase(uint64_t id) {
  auto it = std::find_if(v_.begin(), v_.end(), [&](const RegionEntry& e) { return e.id == id; });
  if (it == v_.end()) return false;
  v_.erase(it);
  recompute_max();
  return true;
}

const RegionEntry* RegionTable::find(uint64_t addr, uint64_t len, uint32_t need_access) const {
  if (len == 0 || addr + len < addr) return nullptr;
  // The region of the previous hit first: transfers mostly stay in one region. Any region that
  // holds the range with the access is a right answer.
  if (hint_ < v_.size()) {
    const RegionEntry& h = v_[hint_];
    if (h.contains(addr, len) && (h.access & need_access) == need_access) return &h;
  }
  // Candidates start at or before addr; walk back from the last of them. A region starting more
  // than max_len_ before addr cannot reach it, which ends the walk.
  auto it = std::upper_bound(v_.begin(), v_.end(), addr,
                             [](uint64_t a, const RegionEntry& e) { return a < e.addr; });
  while (it != v_.begin()) {
    --it;
    if (addr - it->addr >= max_len_) break;
    if (it->contains(addr, len) && (it->access & need_access) == need_access) {
      hint_ = size_t(it - v_.begin());
      return &*it;
    }
  }
  return nullptr;
}

}  // namespace hixl::engine
