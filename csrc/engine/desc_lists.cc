#include "engine/desc_lists.h"

namespace hixl::engine {

size_t DescList::resolve_remote_locked(const Link& l) {
  key.assign(size(), 0);
  wkey.assign(size(), 0);
  flags.assign(size(), 0);
  size_t first_bad = size();
  const RegionEntry* r_last = nullptr;
  const RegionEntry* w_last = nullptr;
  for (size_t i = 0; i < size(); ++i) {
    const uint64_t a = addr[i], n = len[i];
    if (!(r_last && r_last->contains(a, n))) r_last = l.remote.find(a, n, wire::kRemoteRead);
    if (!(w_last && w_last->contains(a, n))) w_last = l.remote.find(a, n, wire::kRemoteWrite);
    if (r_last) key[i] = r_last->key, flags[i] |= wire::kRemoteRead;
    if (w_last) wkey[i] = w_last->key, flags[i] |= wire::kRemoteWrite;
    if (!flags[i] && first_bad == size()) first_bad = i;
  }
  version = l.remote_version;
  return first_bad;
}

uint64_t DescLists::add(std::shared_ptr<DescList> list) {
  std::lock_guard<std::mutex> g(mu_);
  return lists_.add(std::move(list));
}

std::shared_ptr<DescList> DescLists::get(uint64_t handle) const {
  std::lock_guard<std::mutex> g(mu_);
  const auto* p = lists_.find(handle);
  return p ? *p : nullptr;
}

bool DescLists::remove(uint64_t handle) {
  std::lock_guard<std::mutex> g(mu_);
  if (!lists_.find(handle)) return false;
  lists_.erase(handle);
  return true;
}

size_t DescLists::size() const {
  std::lock_guard<std::mutex> g(mu_);
  return lists_.size();
}

void DescLists::clear() {
  std::lock_guard<std::mutex> g(mu_);
  lists_.clear();
}

}  // namespace hixl::engine
