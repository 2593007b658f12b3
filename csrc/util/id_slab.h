// IdSlab<T>: the table of live requests (engine requests, endpoint requests, queued-path jobs)
// without a heap allocation or a tree insert per request. Slots live in chunks of kChunk, allocated
// as the table grows and kept (a reference to a live value stays valid while others are added, so a
// caller may drop its lock and use it again; finding slot i is a shift and a mask, where a
// std::deque of a request-sized T divides by its few-element node size on every access), and are
// reused through a free list; an id is (sequence << kIndexBits) | slot index, so
//   - lookup is one index and one compare (a stale id, whose slot was reused, does not match),
//   - ids grow with issue order (sorting live ids gives "oldest first"),
//   - an id is never handed out twice (the sequence only grows; 2^40 ids per table).
// At most kMaxLive slots are live at once; add() returns 0 beyond that (callers report
// RESOURCE_EXHAUSTED). Not thread-safe: its owner's lock guards it.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace hixl::util {

template <class T>
class IdSlab {
 public:
  static constexpr unsigned kIndexBits = 24;
  static constexpr uint64_t kMaxLive = uint64_t(1) << kIndexBits;
  static constexpr uint64_t kIndexMask = kMaxLive - 1;

  // A new live slot holding value; its id (never 0), or 0 when kMaxLive slots are live.
  uint64_t add(T value) {
    auto [id, v] = emplace();
    if (id) *v = std::move(value);
    return id;
  }
  // A new live slot, filled by the caller in place: {its id, its value}, or {0, null} when kMaxLive
  // slots are live. The value is a new T, or what erase() left of a reused slot's (on_erase() or T()):
  // the caller sets every field it reads later.
  std::pair<uint64_t, T*> emplace() {
    uint64_t index;
    if (!free_.empty()) {
      index = free_.back();
      free_.pop_back();
    } else {
      if (count_ >= kMaxLive) return {0, nullptr};
      index = count_;
      if ((index & kChunkMask) == 0) chunks_.push_back(std::make_unique<Slot[]>(kChunk));
      ++count_;
    }
    const uint64_t id = (next_seq_++ << kIndexBits) | index;
    Slot& s = slot(index);
    s.id = id;
    ++live_;
    return {id, &s.value};
  }
  // The live value with this id, or null (never issued, or erased).
  T* find(uint64_t id) {
    const uint64_t index = id & kIndexMask;
    if (index >= count_) return nullptr;
    Slot& s = slot(index);
    return s.id == id && id != 0 ? &s.value : nullptr;
  }
  const T* find(uint64_t id) const { return const_cast<IdSlab*>(this)->find(id); }
  // Frees the slot (no-op for an id not live). The value is reset (T::on_erase() when T has one,
  // else T()), so what it held (a shared_ptr, a string) goes now, not when the slot is reused.
  void erase(uint64_t id) {
    T* v = find(id);
    if (!v) return;
    const uint64_t index = id & kIndexMask;
    slot(index).id = 0;
    if constexpr (has_on_erase<T>::value)
      v->on_erase();  // the type drops what it holds itself (cheaper than building a T())
    else
      *v = T();
    free_.push_back(index);
    --live_;
  }
  // fn(id, value) for every live slot, in slot order (not issue order: sort ids for that).
  template <class Fn>
  void for_each(Fn fn) {
    for (uint64_t i = 0; i < count_; ++i) {
      Slot& s = slot(i);
      if (s.id) fn(s.id, s.value);
    }
  }
  size_t size() const { return live_; }
  void clear() {
    chunks_.clear();
    free_.clear();
    count_ = 0;
    live_ = 0;
  }

 private:
  template <class U, class = void>
  struct has_on_erase : std::false_type {};
  template <class U>
  struct has_on_erase<U, std::void_t<decltype(std::declval<U&>().on_erase())>> : std::true_type {};
  struct Slot {
    uint64_t id = 0;  // 0: free
    T value{};
  };
  static constexpr unsigned kChunkBits = 6;
  static constexpr uint64_t kChunk = uint64_t(1) << kChunkBits;
  static constexpr uint64_t kChunkMask = kChunk - 1;
  Slot& slot(uint64_t index) { return chunks_[size_t(index >> kChunkBits)][size_t(index & kChunkMask)]; }

  std::vector<std::unique_ptr<Slot[]>> chunks_;  // slot i: chunks_[i / kChunk][i % kChunk]
  uint64_t count_ = 0;                           // slots made so far (live or on the free list)
  std::vector<uint64_t> free_;
  uint64_t next_seq_ = 1;
  size_t live_ = 0;
};

}  // namespace hixl::util
