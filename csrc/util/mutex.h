// util::Mutex: the lock of the request path's parts (engine requests, endpoint send side, registry,
// link, link table). std::mutex is pthread_mutex_lock/unlock, out of line: ~45 instructions a pair
// (callgrind), and a request takes about eight pairs. This one is the three-state futex mutex of
// Drepper's "Futexes Are Tricky" (0 free, 1 held, 2 held with waiters): an uncontended pair is one
// compare-exchange and one exchange, inline. Contended, it spins briefly (critical sections here
// are a few hundred instructions) and then sleeps on the futex; unlock wakes one sleeper. Not
// recursive, not fair (as std::mutex on Linux). BasicLockable and Lockable: std::lock_guard and
// std::unique_lock take it; a condition variable over it is std::condition_variable_any.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace hixl::util {

class Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() {
    int c = 0;
    if (__builtin_expect(s_.compare_exchange_strong(c, 1, std::memory_order_acquire, std::memory_order_relaxed), 1))
      return;
    lock_contended(c);
  }
  bool try_lock() {
    int c = 0;
    return s_.compare_exchange_strong(c, 1, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void unlock() {
    if (__builtin_expect(s_.exchange(0, std::memory_order_release) != 1, 0)) wake_one();
  }

 private:
  static constexpr int kSpins = 100;  // compare-exchange attempts before sleeping (a few microseconds)
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the atomic's int");

  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  void lock_contended(int c) {
    // Spin while the holder may let go soon (held, nobody asleep yet).
    for (int i = 0; i < kSpins && c == 1; ++i) {
      cpu_relax();
      c = s_.load(std::memory_order_relaxed);
      if (c == 0 && s_.compare_exchange_strong(c, 1, std::memory_order_acquire, std::memory_order_relaxed)) return;
    }
    // Announce a sleeper (2), then sleep until it is free; whoever takes it from here leaves it at 2,
    // so the unlock after it wakes the next sleeper (at worst one wake-up too many, never too few).
    if (c != 2) c = s_.exchange(2, std::memory_order_acquire);
    while (c != 0) {
      syscall(SYS_futex, reinterpret_cast<int*>(&s_), FUTEX_WAIT_PRIVATE, 2, nullptr, nullptr, 0);
      c = s_.exchange(2, std::memory_order_acquire);
    }
  }
  void wake_one() { syscall(SYS_futex, reinterpret_cast<int*>(&s_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0); }

  std::atomic<int> s_{0};
};

}  // namespace hixl::util
