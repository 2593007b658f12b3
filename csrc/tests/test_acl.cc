// Plain ctest executable for the aclrtMalloc shim (no device, no gtest). Exit status != 0 on failure.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "acl/allocator.h"
#include "tests/check.h"

using namespace hixl::acl;



static bool contains(const std::string& s, const char* needle) { return s.find(needle) != std::string::npos; }
static long read_long(const char* path) {
  std::ifstream in(path);
  long v = 0;
  in >> v;
  return v;
}
static long free_hugepages_2m() { return read_long("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages"); }
static std::uintptr_t u(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
static const std::size_t kPage = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));

static void test_constants() {
  CHECK_EQ(ACL_SUCCESS, 0);
  CHECK_EQ(ACL_ERROR_INVALID_PARAM, 100000);
  CHECK_EQ(ACL_ERROR_BAD_ALLOC, 200000);
  CHECK_EQ(ACL_ERROR_MEMORY_ADDRESS_UNALIGNED, 200003);
  CHECK_EQ(ACL_MEM_MALLOC_HUGE_FIRST, 0);
  CHECK_EQ(ACL_MEM_MALLOC_HUGE_ONLY, 1);
  CHECK_EQ(ACL_MEM_MALLOC_NORMAL_ONLY, 2);
  CHECK_EQ(ACL_MEMCPY_HOST_TO_HOST, 0);
  CHECK_EQ(ACL_MEMCPY_HOST_TO_DEVICE, 1);
  CHECK_EQ(ACL_MEMCPY_DEVICE_TO_HOST, 2);
  CHECK_EQ(ACL_MEMCPY_DEVICE_TO_DEVICE, 3);
}

static void test_malloc_normal() {
  void* p = nullptr;
  CHECK_EQ(aclrtMalloc(&p, 10000, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
  CHECK(p != nullptr);
  CHECK_EQ(last_error(), "");
  CHECK_EQ(u(p) % kPage, 0u);
  auto info = lookup(static_cast<char*>(p) + 123);
  CHECK(info.has_value());
  if (info) {
    CHECK_EQ(info->base, u(p));
    CHECK_EQ(info->size, 10000u);
    CHECK_EQ(info->mapped_size, (10000 + kPage - 1) / kPage * kPage);
    CHECK_EQ(info->offset, 123u);
    CHECK_EQ(info->page_size, kPage);
    CHECK(info->kind == PageKind::kNormal);
    CHECK(info->space == MemSpace::kDevice);
    CHECK(info->fd >= 0);
  }
  CHECK(!lookup(static_cast<char*>(p) + 10000).has_value());  // tail padding is out of bounds
  std::memset(p, 0x5a, 10000);
  CHECK_EQ(static_cast<unsigned char*>(p)[9999], 0x5a);
  CHECK_EQ(aclrtFree(p), ACL_SUCCESS);
  CHECK(!lookup(p).has_value());
}

static void test_malloc_invalid() {
  void* p = reinterpret_cast<void*>(0x1);
  CHECK_EQ(aclrtMalloc(&p, 0, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM);
  CHECK(p == nullptr);
  CHECK(contains(last_error(), "aclrtMalloc(size=0, policy=0): size must be > 0"));
  CHECK_EQ(aclrtMalloc(&p, 4096, 99), ACL_ERROR_INVALID_PARAM);
  CHECK(contains(last_error(), "policy=99"));
  CHECK_EQ(aclrtMalloc(&p, 4096, -1), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_HUGE1G_ONLY), ACL_ERROR_FEATURE_UNSUPPORTED);
  CHECK_EQ(aclrtMalloc(&p, std::size_t{1} << 62, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_ERROR_INVALID_PARAM);
  CHECK(contains(last_error(), "exceeds the limit"));
  CHECK_EQ(aclrtMalloc(&p, ~std::size_t{0}, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMalloc(nullptr, 4096, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_ERROR_INVALID_PARAM);
  // Bandwidth bits and P2P variants fold onto the page policy.
  CHECK_EQ(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_NORMAL_ONLY | ACL_MEM_TYPE_HIGH_BAND_WIDTH), ACL_SUCCESS);
  CHECK(lookup(p) && lookup(p)->kind == PageKind::kNormal);
  CHECK_EQ(aclrtFree(p), ACL_SUCCESS);
  CHECK_EQ(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_NORMAL_ONLY_P2P), ACL_SUCCESS);
  CHECK_EQ(aclrtFree(p), ACL_SUCCESS);
}

static void test_huge_policies() {
  void* p = nullptr;
  aclError rc = aclrtMalloc(&p, 3 << 20, ACL_MEM_MALLOC_HUGE_ONLY);
  if (free_hugepages_2m() < 2) {
    CHECK_EQ(rc, ACL_ERROR_BAD_ALLOC);
    CHECK(p == nullptr);
    CHECK(contains(last_error(), "nr_hugepages="));
  } else {
    CHECK_EQ(rc, ACL_SUCCESS);
    auto info = lookup(p);
    CHECK(info && info->kind == PageKind::kHugeTlb && info->fd >= 0 && info->mapped_size == (4u << 20));
    CHECK_EQ(aclrtFree(p), ACL_SUCCESS);
  }
  // HUGE_FIRST at <= 1 MiB gets normal pages (CANN semantics).
  CHECK_EQ(aclrtMalloc(&p, 1 << 20, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
  CHECK(lookup(p) && lookup(p)->kind == PageKind::kNormal);
  CHECK_EQ(aclrtFree(p), ACL_SUCCESS);
  // HUGE_FIRST above 1 MiB: whichever kind was used, its description is consistent.
  for (bool shareable : {false, true}) {
    set_require_shareable(shareable);
    CHECK_EQ(aclrtMalloc(&p, 3 << 20, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    auto info = lookup(p);
    CHECK(info.has_value());
    if (info && info->kind != PageKind::kNormal) {
      CHECK_EQ(info->base % kHugePageSize, 0u);
      CHECK_EQ(info->page_size, kHugePageSize);
      CHECK_EQ(info->mapped_size, 4u << 20);
    }
    if (info && (info->kind != PageKind::kThp || shareable)) CHECK(info->fd >= 0);
    std::memset(p, 1, 3 << 20);
    CHECK_EQ(aclrtFree(p), ACL_SUCCESS);
  }
  set_require_shareable(false);
}

static void test_free_errors() {
  void* p = nullptr;
  CHECK_EQ(aclrtMalloc(&p, 8192, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
  CHECK_EQ(aclrtFree(static_cast<char*>(p) + 64), ACL_ERROR_INVALID_PARAM);
  CHECK(contains(last_error(), "not its base address"));
  void* h = nullptr;
  CHECK_EQ(aclrtMallocHost(&h, 100), ACL_SUCCESS);
  CHECK_EQ(u(h) % kPage, 0u);
  CHECK(lookup(h) && lookup(h)->space == MemSpace::kHost && lookup(h)->fd >= 0);
  CHECK_EQ(aclrtFree(h), ACL_ERROR_INVALID_PARAM);
  CHECK(contains(last_error(), "aclrtFreeHost"));
  CHECK_EQ(aclrtFreeHost(p), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtFreeHost(h), ACL_SUCCESS);
  CHECK_EQ(aclrtFreeHost(h), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtFree(p), ACL_SUCCESS);
  CHECK_EQ(aclrtFree(p), ACL_ERROR_INVALID_PARAM);  // double free
  CHECK(contains(last_error(), "already freed"));
  CHECK_EQ(aclrtFree(nullptr), ACL_ERROR_INVALID_PARAM);
  int local = 0;
  CHECK_EQ(aclrtFree(&local), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMallocHost(&h, 0), ACL_ERROR_INVALID_PARAM);
}

static void test_memcpy_memset() {
  const std::size_t n = 64 * 1024;
  void* d = nullptr;
  void* d2 = nullptr;
  CHECK_EQ(aclrtMalloc(&d, n, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
  CHECK_EQ(aclrtMalloc(&d2, n, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
  std::vector<unsigned char> src(n), back(n, 0);
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<unsigned char>(i * 7 + 3);
  CHECK_EQ(aclrtMemcpy(d, n, src.data(), n, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
  CHECK_EQ(aclrtMemcpy(d2, n, d, n, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_SUCCESS);
  CHECK_EQ(aclrtMemcpy(back.data(), n, d2, n, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
  CHECK(back == src);
  // Overlapping device-to-device copy behaves like memmove.
  auto* c = static_cast<unsigned char*>(d);
  CHECK_EQ(aclrtMemcpy(c + 1, n - 1, c, n - 1, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_SUCCESS);
  CHECK(c[0] == src[0] && std::memcmp(c + 1, src.data(), n - 1) == 0);
  // Refusals: count > destMax, nulls, bad kind, out-of-bounds / unknown device pointers.
  CHECK_EQ(aclrtMemcpy(d, 10, src.data(), 11, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
  CHECK(contains(last_error(), "count exceeds destMax"));
  CHECK_EQ(aclrtMemcpy(nullptr, n, src.data(), 1, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMemcpy(d, n, nullptr, 1, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMemcpy(d, n, src.data(), 1, 9), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMemcpy(c + n - 10, 20, src.data(), 20, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
  CHECK(contains(last_error(), "overruns allocation"));
  CHECK_EQ(aclrtMemcpy(back.data(), 20, c + n - 10, 20, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMemcpy(back.data(), n, src.data(), 16, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_INVALID_PARAM);
  CHECK(contains(last_error(), "not inside any live"));
  CHECK_EQ(aclrtMemcpy(reinterpret_cast<void*>(0x10), 16, src.data(), 16, ACL_MEMCPY_HOST_TO_DEVICE),
           ACL_ERROR_INVALID_PARAM);
  void* h = nullptr;
  CHECK_EQ(aclrtMallocHost(&h, 4096), ACL_SUCCESS);
  CHECK_EQ(aclrtMemcpy(h, 4096, d, 16, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_ERROR_INVALID_PARAM);  // host as device
  CHECK(contains(last_error(), "expected device memory"));
  // HOST_TO_HOST does no table check; DEFAULT infers sides and bounds-checks known ones.
  unsigned char a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {};
  CHECK_EQ(aclrtMemcpy(b, 8, a, 8, ACL_MEMCPY_HOST_TO_HOST), ACL_SUCCESS);
  CHECK(std::memcmp(a, b, 8) == 0);
  CHECK_EQ(aclrtMemcpy(d, n, a, 8, ACL_MEMCPY_DEFAULT), ACL_SUCCESS);
  CHECK_EQ(std::memcmp(d, a, 8), 0);
  CHECK_EQ(aclrtMemcpy(c + n - 4, 8, a, 8, ACL_MEMCPY_DEFAULT), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMemcpy(d, n, a, 0, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
  // Memset: inside a live allocation (device or host), bounded.
  CHECK_EQ(aclrtMemset(c + 100, n - 100, 0x1ab, n - 100), ACL_SUCCESS);
  CHECK(c[99] != 0xab || src[99] == 0xab);
  CHECK(c[100] == 0xab && c[n - 1] == 0xab);
  CHECK_EQ(aclrtMemset(h, 4096, 7, 4096), ACL_SUCCESS);
  CHECK_EQ(static_cast<unsigned char*>(h)[4095], 7);
  CHECK_EQ(aclrtMemset(c + n - 4, 8, 0, 8), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMemset(d, 4, 0, 8), ACL_ERROR_INVALID_PARAM);
  CHECK(contains(last_error(), "count exceeds maxCount"));
  CHECK_EQ(aclrtMemset(a, 8, 0, 8), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtMemset(nullptr, 8, 0, 8), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtFreeHost(h), ACL_SUCCESS);
  CHECK_EQ(aclrtFree(d), ACL_SUCCESS);
  CHECK_EQ(aclrtMemcpy(back.data(), n, d2, n, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
  CHECK_EQ(aclrtFree(d2), ACL_SUCCESS);
  CHECK_EQ(aclrtMemcpy(back.data(), 16, d2, 16, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_INVALID_PARAM);  // freed
}

static void test_meminfo_and_fd_sharing() {
  std::size_t free0 = 0, total = 0, free1 = 0, t1 = 0;
  CHECK_EQ(aclrtGetMemInfo(ACL_HBM_MEM, &free0, &total), ACL_SUCCESS);
  CHECK(total > 0 && free0 <= total);
  void* p = nullptr;
  CHECK_EQ(aclrtMalloc(&p, 5 * kPage, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
  CHECK_EQ(aclrtGetMemInfo(ACL_HBM_MEM, &free1, &t1), ACL_SUCCESS);
  CHECK_EQ(free0 - free1, 5 * kPage);
  CHECK_EQ(aclrtGetMemInfo(42, &free1, &t1), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(aclrtGetMemInfo(ACL_HBM_MEM_HUGE, &free1, &t1), ACL_SUCCESS);
  CHECK(free1 <= t1);
  auto info = lookup(p);
  CHECK(info && info->fd >= 0);
  if (info && info->fd >= 0) {
    void* q = mmap(nullptr, 5 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED, info->fd, 0);
    CHECK(q != MAP_FAILED);
    if (q != MAP_FAILED) {
      std::memset(p, 0x42, 5 * kPage);
      CHECK_EQ(static_cast<unsigned char*>(q)[5 * kPage - 1], 0x42);
      static_cast<unsigned char*>(q)[0] = 0x99;
      CHECK_EQ(static_cast<unsigned char*>(p)[0], 0x99);
      munmap(q, 5 * kPage);
    }
  }
  CHECK_EQ(aclrtFree(p), ACL_SUCCESS);
  CHECK_EQ(aclrtGetMemInfo(ACL_HBM_MEM, &free1, &t1), ACL_SUCCESS);
  CHECK_EQ(free1, free0);
}

static void test_threads() {
  const Stats before = stats();
  std::atomic<int> errors{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t) {
    ts.emplace_back([t, &errors] {
      for (int i = 0; i < 200; ++i) {
        void* p = nullptr;
        std::size_t n = kPage * static_cast<std::size_t>(1 + (i + t) % 5);
        if (aclrtMalloc(&p, n, ACL_MEM_MALLOC_NORMAL_ONLY) != ACL_SUCCESS) { ++errors; continue; }
        if (aclrtMemset(p, n, t, n) != ACL_SUCCESS) ++errors;
        if (static_cast<unsigned char*>(p)[n - 1] != t) ++errors;
        // Interior pointer while this thread still owns p (a double free here would race with
        // other threads legitimately reusing the address).
        if (aclrtFree(static_cast<char*>(p) + 1) != ACL_ERROR_INVALID_PARAM) ++errors;
        if (last_error().find("not its base address") == std::string::npos) ++errors;  // per-thread
        if (aclrtFree(p) != ACL_SUCCESS) ++errors;
        if (!last_error().empty()) ++errors;
      }
    });
  }
  for (auto& th : ts) th.join();
  CHECK_EQ(errors.load(), 0);
  const Stats after = stats();
  CHECK_EQ(after.live_allocations, before.live_allocations);
  CHECK_EQ(after.total_allocs - before.total_allocs, 1600u);
}

// A backend that counts calls and delegates to the default one: the seam for a real device.
class CountingAllocator final : public DeviceAllocator {
 public:
  std::shared_ptr<DeviceAllocator> inner = make_default_device_allocator();
  std::atomic<int> allocs{0}, releases{0}, copies{0};
  const char* name() const noexcept override { return "counting"; }
  aclError allocate(std::size_t n, int policy, Mapping* out, std::string* why) override {
    ++allocs;
    return inner->allocate(n, policy, out, why);
  }
  void release(const Mapping& m) noexcept override { ++releases; inner->release(m); }
  void copy(void* d, const void* s, std::size_t n, int kind) noexcept override { ++copies; inner->copy(d, s, n, kind); }
  void fill(void* d, int v, std::size_t n) noexcept override { inner->fill(d, v, n); }
  std::size_t capacity() const noexcept override { return std::size_t{1} << 20; }
};

static void test_backend_seam_and_logging() {
  CHECK_EQ(device_allocator_name(), "host-memfd");
  auto counting = std::make_shared<CountingAllocator>();
  install_device_allocator(counting);
  CHECK_EQ(device_allocator_name(), "counting");
  void* p = nullptr;
  CHECK_EQ(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
  char buf[16] = "hello";
  CHECK_EQ(aclrtMemcpy(p, 4096, buf, 6, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
  void* big = nullptr;
  CHECK_EQ(aclrtMalloc(&big, 2u << 20, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_ERROR_INVALID_PARAM);  // > capacity
  CHECK(contains(last_error(), "counting capacity"));
  install_device_allocator(nullptr);  // back to the default; p stays with the counting backend
  CHECK_EQ(device_allocator_name(), "host-memfd");
  CHECK_EQ(aclrtFree(p), ACL_SUCCESS);
  CHECK_EQ(counting->allocs.load(), 1);
  CHECK_EQ(counting->copies.load(), 1);
  CHECK_EQ(counting->releases.load(), 1);
  std::vector<std::string> lines;
  set_log_sink([&lines](const std::string& l) { lines.push_back(l); });
  CHECK_EQ(record_error(ACL_ERROR_INVALID_PARAM, "custom(x=1): bad"), ACL_ERROR_INVALID_PARAM);
  CHECK_EQ(last_error(), "custom(x=1): bad");
  set_log_enabled(true);
  CHECK_EQ(lines.size(), 1u);
  CHECK(!lines.empty() && contains(lines[0], "custom(x=1): bad") && contains(lines[0], "ret=100000"));
}

int main() {
  set_log_enabled(false);  // expected failures would be noisy; the log sink is tested explicitly
  test_constants();
  test_malloc_normal();
  test_malloc_invalid();
  test_huge_policies();
  test_free_errors();
  test_memcpy_memset();
  test_meminfo_and_fd_sharing();
  test_threads();
  set_log_enabled(false);
  test_backend_seam_and_logging();
  return report("test_acl");
}
