// What one operation on the request path costs on this machine: a plain add, an atomic add, a
// std::mutex lock + unlock, a shared_ptr copy, rdtsc, clock_gettime. Run it on the host and in the
// rxe VM to see what QEMU TCG charges for each (bench/README.md, "Where the engine's time goes in
// the VM"):
//
//   g++ -O2 -o /tmp/op_costs bench/op_costs.cc && /tmp/op_costs
//   bash ci/rxe-vm.sh /tmp/op_costs
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>

int main() {
  using Clock = std::chrono::steady_clock;
  const long n = 2000000;
  std::atomic<long> a{0};
  volatile long plain = 0;
  std::mutex m;
  auto sp = std::make_shared<int>(1);
  auto time = [&](const char* what, long iters, auto fn) {
    const auto t0 = Clock::now();
    for (long i = 0; i < iters; ++i) fn();
    std::printf("%-28s %8.1f ns\n", what, std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / iters);
  };
  std::printf("%-28s %11s\n", "operation", "per op");
  time("plain add", n, [&] { plain = plain + 1; });
  time("atomic fetch_add", n, [&] { a.fetch_add(1); });
  time("std::mutex lock + unlock", n, [&] { m.lock(); m.unlock(); });
  time("shared_ptr copy", n, [&] { auto c = sp; (void)c; });
#if defined(__x86_64__) || defined(__i386__)
  time("rdtsc", n, [&] { plain = long(__builtin_ia32_rdtsc()); });
#endif
  time("clock_gettime(MONOTONIC)", n / 20, [&] {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    plain = ts.tv_nsec;
  });
  return 0;
}
