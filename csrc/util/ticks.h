// The CPU's cycle counter, for timing on hot paths (as perftest's get_cycles()): a steady_clock read
// is a clock_gettime() that costs ~20 ns on real hardware but ~1.7 us in a QEMU TCG guest, whose
// clocksource is the emulated HPET. ns_per_tick() converts: measured once per process against
// steady_clock over 2 ms (the counter is invariant on the CPUs this runs on; where there is none,
// ticks are steady_clock nanoseconds and the rate is 1).
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

namespace hixl::util {

inline uint64_t ticks() {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#elif defined(__aarch64__)
  uint64_t v;
  asm volatile("isb; mrs %0, cntvct_el0" : "=r"(v));
  return v;
#else
  return uint64_t(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
#endif
}

inline double ns_per_tick() {
  static const double rate = [] {
    using Clock = std::chrono::steady_clock;
    const auto c0 = Clock::now();
    const uint64_t t0 = ticks();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const uint64_t dt = ticks() - t0;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - c0).count();
    return dt && ns > 0 ? double(ns) / double(dt) : 1.0;
  }();
  return rate;
}

}  // namespace hixl::util
