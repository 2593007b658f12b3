// RecentClock: a deadline's starting point with at most one clock read per kReuse (0.5 ms) of a
// thread's calls. steady_clock::now() is a clock_gettime(): ~20 ns through the vDSO on real
// hardware, but a syscall where the clocksource has no vDSO support (an emulated HPET, as in the
// rxe VM: the engine's one read per async transfer made read_hpet its top kernel symbol, ~8 % of
// a stream of 8 B requests; bench/README.md). One object per thread (the engine's ThreadState).
//
// now_at_least() is never earlier than now and at most kSlack (1 ms, the unit of every timeout in
// the API) later, so a deadline built on it is never early and at most kSlack late. It keeps the
// last clock read with the cycle counter's value and CPU (rdtscp) just before it; a later call on
// the same CPU whose counter moved forward by less than kReuse's worth of ticks returns that read
// + kSlack. One CPU's counter only moves forward, and kSlack is twice kReuse, so a rate measured
// off by up to half still keeps the bound. Elsewhere (another CPU, a counter that went back, a CPU
// without rdtscp): a fresh read.
#pragma once

#include <chrono>
#include <cstdint>

#include "util/ticks.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace hixl::util {

class RecentClock {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kReuse{500};
  static constexpr std::chrono::microseconds kSlack{1000};

  Clock::time_point now_at_least() {
#if defined(__x86_64__)
    if (!has_rdtscp()) return Clock::now() + kSlack;
    unsigned cpu = 0;
    const uint64_t t = __rdtscp(&cpu);
    if (cpu == cpu_ && t >= tsc_ && t - tsc_ < reuse_ticks()) return at_ + kSlack;
    cpu_ = cpu;
    tsc_ = t;  // read before the clock: the clock's value is no earlier than this counter's moment
    at_ = Clock::now();
    return at_ + kSlack;
#else
    return Clock::now() + kSlack;  // (aarch64's vDSO reads the global generic timer: cheap already)
#endif
  }

 private:
#if defined(__x86_64__)
  // Not every virtual CPU model has it (QEMU's qemu64 and kvm64 do not): executing it there is SIGILL.
  static bool has_rdtscp() {
    static const bool yes = [] {
      unsigned a = 0, b = 0, c = 0, d = 0;
      return __get_cpuid(0x80000001u, &a, &b, &c, &d) && (d & (1u << 27)) != 0;
    }();
    return yes;
  }
#endif
  static uint64_t reuse_ticks() {
    static const uint64_t n = uint64_t(double(std::chrono::nanoseconds(kReuse).count()) / ns_per_tick());
    return n;
  }
  unsigned cpu_ = ~0u;
  uint64_t tsc_ = 0;
  Clock::time_point at_{};
};

}  // namespace hixl::util
