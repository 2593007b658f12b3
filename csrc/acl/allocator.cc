// aclrtMalloc-style shim: allocation table + the host memfd backend. See allocator.h.
#include "acl/allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <utility>

#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26)  // HUGETLB_FLAG_ENCODE_2MB
#endif

namespace hixl::acl {
namespace {

// ---- errors and logging -----------------------------------------------------------------------

void stderr_sink(const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); }

std::mutex g_log_mu;
std::function<void(const std::string&)> g_sink = stderr_sink;
thread_local std::string t_last_error;

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

aclError fail(aclError code, const std::string& message) {
  t_last_error = message;
  std::lock_guard<std::mutex> lk(g_log_mu);
  if (g_sink) g_sink("[hixl.acl] ERROR " + message + " (ret=" + std::to_string(code) + ")");
  return code;
}

std::string errno_str(const char* what) { return fmt("%s: %s", what, std::strerror(errno)); }

// ---- sysfs ------------------------------------------------------------------------------------

constexpr const char* kHugePool = "/sys/kernel/mm/hugepages/hugepages-2048kB";
constexpr const char* kThp = "/sys/kernel/mm/transparent_hugepage";

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

long read_long(const std::string& path) {
  std::string s = read_text(path);
  return s.empty() ? 0 : std::strtol(s.c_str(), nullptr, 10);
}

// "always [madvise] never" -> "madvise"; a file without brackets -> its text.
std::string selected(const std::string& path) {
  std::string s = read_text(path);
  auto l = s.find('['), r = s.find(']');
  return (l == std::string::npos || r == std::string::npos) ? s : s.substr(l + 1, r - l - 1);
}

// The per-size (hugepages-2048kB) THP control when present and not "inherit", else the global.
std::string thp_mode(const char* file) {
  std::string per = selected(std::string(kThp) + "/hugepages-2048kB/" + file);
  return (per.empty() || per == "inherit") ? selected(std::string(kThp) + "/" + file) : per;
}

bool thp_pmd_is_2m() { return read_long(std::string(kThp) + "/hpage_pmd_size") == 2097152; }
bool shmem_thp_usable() {
  std::string m = thp_mode("shmem_enabled");
  return thp_pmd_is_2m() && (m == "always" || m == "within_size" || m == "advise" || m == "force");
}
bool anon_thp_usable() {
  std::string m = thp_mode("enabled");
  return thp_pmd_is_2m() && (m == "always" || m == "madvise");
}

std::string huge_pool_state() {
  return fmt("nr_hugepages=%ld, free_hugepages=%ld in %s", read_long(std::string(kHugePool) + "/nr_hugepages"),
             read_long(std::string(kHugePool) + "/free_hugepages"), kHugePool);
}

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }
std::size_t base_page() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

// ---- host memfd backend -----------------------------------------------------------------------

std::atomic<bool> g_require_shareable{false};

class HostMemfdAllocator final : public DeviceAllocator {
 public:
  const char* name() const noexcept override { return "host-memfd"; }

  aclError allocate(std::size_t size, int policy, Mapping* out, std::string* why) override {
    if (policy == ACL_MEM_MALLOC_NORMAL_ONLY) return normal(size, out, why);
    if (policy == ACL_MEM_MALLOC_HUGE_ONLY) return hugetlb(size, out, why);
    // HUGE_FIRST. CANN: requests <= 1 MiB get normal pages even under HUGE_FIRST.
    if (size <= (std::size_t{1} << 20)) return normal(size, out, why);
    std::string skip;
    if (hugetlb(size, out, &skip) == ACL_SUCCESS) return ACL_SUCCESS;
    if (shmem_thp_usable()) {
      if (thp(size, true, out, why) == ACL_SUCCESS) return ACL_SUCCESS;
    } else if (anon_thp_usable() && !g_require_shareable.load()) {
      if (thp(size, false, out, why) == ACL_SUCCESS) return ACL_SUCCESS;
    }
    return normal(size, out, why);
  }

  void release(const Mapping& m) noexcept override {
    if (m.base) munmap(m.base, m.mapped_size);
    if (m.fd >= 0) close(m.fd);
  }
  void copy(void* dst, const void* src, std::size_t n, int) noexcept override { std::memmove(dst, src, n); }
  void fill(void* dst, int value, std::size_t n) noexcept override { std::memset(dst, value, n); }
  std::size_t capacity() const noexcept override {
    return static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES)) * base_page();
  }

 private:
  static int new_memfd(const char* tag, unsigned flags, std::size_t len, std::string* why) {
    int fd = memfd_create(tag, MFD_CLOEXEC | flags);
    if (fd < 0) {
      *why = errno_str("memfd_create");
      return -1;
    }
    if (ftruncate(fd, static_cast<off_t>(len)) != 0) {
      *why = errno_str(fmt("ftruncate(memfd, %zu)", len).c_str());
      close(fd);
      return -1;
    }
    return fd;
  }

  static aclError normal(std::size_t size, Mapping* out, std::string* why) {
    std::size_t ps = base_page(), len = round_up(size, ps);
    int fd = new_memfd("hixl-acl", 0, len, why);
    if (fd < 0) return ACL_ERROR_BAD_ALLOC;
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      *why = errno_str(fmt("mmap(memfd, %zu, MAP_SHARED)", len).c_str());
      close(fd);
      return ACL_ERROR_BAD_ALLOC;
    }
    *out = Mapping{p, len, fd, ps, PageKind::kNormal};
    return ACL_SUCCESS;
  }

  static aclError hugetlb(std::size_t size, Mapping* out, std::string* why) {
    std::size_t len = round_up(size, kHugePageSize);
    int fd = new_memfd("hixl-acl-hugetlb", MFD_HUGETLB | MFD_HUGE_2MB, len, why);
    if (fd < 0) {
      *why = "2 MiB hugetlb memfd unavailable (" + huge_pool_state() + "): " + *why;
      return ACL_ERROR_BAD_ALLOC;
    }
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);  // reserves the pages
    if (p == MAP_FAILED) {
      *why = fmt("not enough 2 MiB hugetlb pages for %zu bytes (", len) + huge_pool_state() +
             "; raise /proc/sys/vm/nr_hugepages): " + errno_str("mmap");
      close(fd);
      return ACL_ERROR_BAD_ALLOC;
    }
    *out = Mapping{p, len, fd, kHugePageSize, PageKind::kHugeTlb};
    return ACL_SUCCESS;
  }

  // 2 MiB-aligned mapping advised MADV_HUGEPAGE: memfd MAP_SHARED, or anonymous MAP_PRIVATE.
  static aclError thp(std::size_t size, bool shared, Mapping* out, std::string* why) {
    std::size_t len = round_up(size, kHugePageSize), span = len + kHugePageSize;
    int fd = shared ? new_memfd("hixl-acl-thp", 0, len, why) : -1;
    if (shared && fd < 0) return ACL_ERROR_BAD_ALLOC;
    int anon = MAP_PRIVATE | MAP_ANONYMOUS;
    void* r = mmap(nullptr, span, shared ? PROT_NONE : PROT_READ | PROT_WRITE, anon, -1, 0);
    if (r == MAP_FAILED) {
      *why = errno_str(fmt("mmap(anonymous, %zu)", span).c_str());
      if (fd >= 0) close(fd);
      return ACL_ERROR_BAD_ALLOC;
    }
    auto lo = reinterpret_cast<std::uintptr_t>(r), at = round_up(lo, kHugePageSize);
    void* p = reinterpret_cast<void*>(at);
    if (shared && mmap(p, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      *why = errno_str(fmt("mmap(memfd, %zu, MAP_SHARED|MAP_FIXED)", len).c_str());
      munmap(r, span);
      close(fd);
      return ACL_ERROR_BAD_ALLOC;
    }
    if (at > lo) munmap(r, at - lo);
    if (lo + span > at + len) munmap(reinterpret_cast<void*>(at + len), lo + span - at - len);
    madvise(p, len, MADV_HUGEPAGE);  // best effort; the mapping is valid either way
    *out = Mapping{p, len, fd, kHugePageSize, PageKind::kThp};
    return ACL_SUCCESS;
  }
};

// ---- allocation table -------------------------------------------------------------------------

struct Entry {
  Mapping m;
  std::size_t size = 0;
  MemSpace space = MemSpace::kDevice;
  std::shared_ptr<DeviceAllocator> backend;
};

std::string where(std::uintptr_t p) { return fmt("0x%llx", static_cast<unsigned long long>(p)); }
std::string describe_entry(const Entry& e) {
  return fmt("[base=0x%llx, size=%zu]", static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(e.m.base)),
             e.size);
}

class Runtime {
 public:
  std::shared_mutex mu;
  std::map<std::uintptr_t, Entry> table;  // keyed by base
  std::shared_ptr<DeviceAllocator> device = make_default_device_allocator();
  std::shared_ptr<DeviceAllocator> host = std::make_shared<HostMemfdAllocator>();
  Stats st;
  std::size_t live_device_mapped = 0;

  // Entry whose [base, base + size) holds p, or nullptr. Caller holds mu.
  const Entry* containing(std::uintptr_t p) const {
    auto it = table.upper_bound(p);
    if (it == table.begin()) return nullptr;
    --it;
    return p - it->first < it->second.size ? &it->second : nullptr;
  }

  // Entry holding all of [p, p + n) (n >= 1), optionally of one space; else nullptr + *why.
  const Entry* range(std::uintptr_t p, std::size_t n, const char* what, const MemSpace* want,
                     std::string* why) const {
    const Entry* e = containing(p);
    if (!e) {
      *why = fmt("%s ", what) + where(p) + " is not inside any live aclrtMalloc/aclrtMallocHost allocation";
      return nullptr;
    }
    if (want && e->space != *want) {
      *why = fmt("%s ", what) + where(p) + fmt(" lies in %s memory %s, expected %s memory", mem_space_name(e->space),
                                                 describe_entry(*e).c_str(), mem_space_name(*want));
      return nullptr;
    }
    std::size_t room = e->size - (p - reinterpret_cast<std::uintptr_t>(e->m.base));
    if (n > room) {
      *why = fmt("%s range ", what) + where(p) + fmt(" + %zu overruns allocation %s by %zu bytes", n,
                                                     describe_entry(*e).c_str(), n - room);
      return nullptr;
    }
    return e;
  }

  // Validates both sides of a copy for *kind; resolves ACL_MEMCPY_DEFAULT (a side inside any
  // allocation is bounds-checked against it). *de / *se: the device entries. Caller holds mu.
  bool check_copy(std::uintptr_t d, std::uintptr_t s, std::size_t n, int* kind, const Entry** de,
                  const Entry** se, std::string* why) const {
    const MemSpace dev = MemSpace::kDevice;
    if (*kind != ACL_MEMCPY_DEFAULT) {
      bool dst_dev = *kind == ACL_MEMCPY_HOST_TO_DEVICE || *kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
      bool src_dev = *kind == ACL_MEMCPY_DEVICE_TO_HOST || *kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
      if (dst_dev && !(*de = range(d, n, "dst", &dev, why))) return false;
      if (src_dev && !(*se = range(s, n, "src", &dev, why))) return false;
      return true;
    }
    const Entry* a = containing(d) ? range(d, n, "dst", nullptr, why) : nullptr;
    if (containing(d) && !a) return false;
    const Entry* b = containing(s) ? range(s, n, "src", nullptr, why) : nullptr;
    if (containing(s) && !b) return false;
    *de = a && a->space == dev ? a : nullptr;
    *se = b && b->space == dev ? b : nullptr;
    *kind = *de ? (*se ? ACL_MEMCPY_DEVICE_TO_DEVICE : ACL_MEMCPY_HOST_TO_DEVICE)
                : (*se ? ACL_MEMCPY_DEVICE_TO_HOST : ACL_MEMCPY_HOST_TO_HOST);
    return true;
  }

  aclError alloc(void** out, std::size_t size, int page_policy, MemSpace space, const std::string& call) {
    std::shared_ptr<DeviceAllocator> b;
    {
      std::shared_lock<std::shared_mutex> lk(mu);
      b = space == MemSpace::kDevice ? device : host;
    }
    if (size > b->capacity())
      return fail(ACL_ERROR_INVALID_PARAM,
                  call + fmt(": size exceeds the limit of %zu bytes (%s capacity)", b->capacity(), b->name()));
    Entry e;
    std::string why;
    aclError rc = b->allocate(size, page_policy, &e.m, &why);
    if (rc != ACL_SUCCESS) return fail(rc, call + ": " + why);
    e.size = size;
    e.space = space;
    e.backend = std::move(b);
    void* base = e.m.base;
    {
      std::unique_lock<std::shared_mutex> lk(mu);
      st.live_allocations++;
      st.total_allocs++;
      st.live_mapped_bytes += e.m.mapped_size;
      if (st.live_mapped_bytes > st.peak_mapped_bytes) st.peak_mapped_bytes = st.live_mapped_bytes;
      st.live_by_kind[static_cast<int>(e.m.kind)]++;
      if (space == MemSpace::kDevice) {
        st.live_device_bytes += size;
        live_device_mapped += e.m.mapped_size;
      }
      table.emplace(reinterpret_cast<std::uintptr_t>(base), std::move(e));
    }
    *out = base;
    return ACL_SUCCESS;
  }

  aclError free(void* ptr, MemSpace space, const std::string& call) {
    auto p = reinterpret_cast<std::uintptr_t>(ptr);
    std::string why;
    Entry e;
    {
      std::unique_lock<std::shared_mutex> lk(mu);
      auto it = table.find(p);
      if (it == table.end()) {
        const Entry* c = containing(p);
        why = c ? "pointer is inside allocation " + describe_entry(*c) + " but is not its base address"
                : "not a live allocation (never allocated here, or already freed)";
      } else if (it->second.space != space) {
        why = space == MemSpace::kDevice ? "pointer came from aclrtMallocHost; free it with aclrtFreeHost"
                                         : "pointer came from aclrtMalloc; free it with aclrtFree";
      } else {
        e = std::move(it->second);
        table.erase(it);
        st.live_allocations--;
        st.total_frees++;
        st.live_mapped_bytes -= e.m.mapped_size;
        st.live_by_kind[static_cast<int>(e.m.kind)]--;
        if (space == MemSpace::kDevice) {
          st.live_device_bytes -= e.size;
          live_device_mapped -= e.m.mapped_size;
        }
      }
    }
    if (!why.empty()) return fail(ACL_ERROR_INVALID_PARAM, call + ": " + why);
    e.backend->release(e.m);  // outside the lock: munmap of a large touched range takes time
    return ACL_SUCCESS;
  }
};

Runtime& rt() {
  static Runtime* r = new Runtime();  // never destroyed: safe to use from atexit / interpreter teardown
  return *r;
}

std::string ptr_arg(const void* p) { return where(reinterpret_cast<std::uintptr_t>(p)); }

}  // namespace

// ---- public API -------------------------------------------------------------------------------

const char* page_kind_name(PageKind k) noexcept {
  return k == PageKind::kHugeTlb ? "hugetlb" : k == PageKind::kThp ? "thp" : "normal";
}
const char* mem_space_name(MemSpace s) noexcept { return s == MemSpace::kHost ? "host" : "device"; }

std::shared_ptr<DeviceAllocator> make_default_device_allocator() { return std::make_shared<HostMemfdAllocator>(); }

void install_device_allocator(std::shared_ptr<DeviceAllocator> backend) {
  if (!backend) backend = make_default_device_allocator();
  std::unique_lock<std::shared_mutex> lk(rt().mu);
  rt().device = std::move(backend);
}

std::string device_allocator_name() {
  std::shared_lock<std::shared_mutex> lk(rt().mu);
  return rt().device->name();
}

aclError aclrtMalloc(void** dev_ptr, std::size_t size, int policy) {
  t_last_error.clear();
  std::string call = fmt("aclrtMalloc(size=%zu, policy=%d)", size, policy);
  if (!dev_ptr) return fail(ACL_ERROR_INVALID_PARAM, call + ": devPtr out-pointer is null");
  *dev_ptr = nullptr;
  if (size == 0) return fail(ACL_ERROR_INVALID_PARAM, call + ": size must be > 0");
  int page = policy & ~(ACL_MEM_TYPE_LOW_BAND_WIDTH | ACL_MEM_TYPE_HIGH_BAND_WIDTH);
  if (page == ACL_MEM_MALLOC_HUGE1G_ONLY || page == ACL_MEM_MALLOC_HUGE1G_ONLY_P2P)
    return fail(ACL_ERROR_FEATURE_UNSUPPORTED, call + ": 1 GiB huge pages are not supported by the shim");
  if (page < ACL_MEM_MALLOC_HUGE_FIRST || page > ACL_MEM_MALLOC_NORMAL_ONLY_P2P)
    return fail(ACL_ERROR_INVALID_PARAM, call + ": unknown aclrtMemMallocPolicy");
  if (page >= ACL_MEM_MALLOC_HUGE_FIRST_P2P) page -= ACL_MEM_MALLOC_HUGE_FIRST_P2P;
  return rt().alloc(dev_ptr, size, page, MemSpace::kDevice, call);
}

aclError aclrtFree(void* dev_ptr) {
  t_last_error.clear();
  std::string call = "aclrtFree(devPtr=" + ptr_arg(dev_ptr) + ")";
  if (!dev_ptr) return fail(ACL_ERROR_INVALID_PARAM, call + ": devPtr is null");
  return rt().free(dev_ptr, MemSpace::kDevice, call);
}

aclError aclrtMallocHost(void** host_ptr, std::size_t size) {
  t_last_error.clear();
  std::string call = fmt("aclrtMallocHost(size=%zu)", size);
  if (!host_ptr) return fail(ACL_ERROR_INVALID_PARAM, call + ": hostPtr out-pointer is null");
  *host_ptr = nullptr;
  if (size == 0) return fail(ACL_ERROR_INVALID_PARAM, call + ": size must be > 0");
  return rt().alloc(host_ptr, size, ACL_MEM_MALLOC_NORMAL_ONLY, MemSpace::kHost, call);
}

aclError aclrtFreeHost(void* host_ptr) {
  t_last_error.clear();
  std::string call = "aclrtFreeHost(hostPtr=" + ptr_arg(host_ptr) + ")";
  if (!host_ptr) return fail(ACL_ERROR_INVALID_PARAM, call + ": hostPtr is null");
  return rt().free(host_ptr, MemSpace::kHost, call);
}

aclError aclrtMemcpy(void* dst, std::size_t dst_max, const void* src, std::size_t count, int kind) {
  t_last_error.clear();
  std::string call = "aclrtMemcpy(dst=" + ptr_arg(dst) + fmt(", destMax=%zu, src=", dst_max) + ptr_arg(src) +
                     fmt(", count=%zu, kind=%d)", count, kind);
  if (!dst || !src) return fail(ACL_ERROR_INVALID_PARAM, call + ": dst and src must be non-null");
  if (kind < ACL_MEMCPY_HOST_TO_HOST || kind > ACL_MEMCPY_DEFAULT)
    return fail(ACL_ERROR_INVALID_PARAM, call + ": unknown aclrtMemcpyKind (expected 0..4)");
  if (count > dst_max) return fail(ACL_ERROR_INVALID_PARAM, call + ": count exceeds destMax");
  if (count == 0) return ACL_SUCCESS;
  auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
  if (count - 1 > UINTPTR_MAX - d || count - 1 > UINTPTR_MAX - s)
    return fail(ACL_ERROR_INVALID_PARAM, call + ": range wraps the address space");
  Runtime& r = rt();
  std::string why;
  std::shared_lock<std::shared_mutex> lk(r.mu);  // shared: copies run concurrently, frees wait
  const Entry* de = nullptr;
  const Entry* se = nullptr;
  if (!r.check_copy(d, s, count, &kind, &de, &se, &why)) {
    lk.unlock();
    return fail(ACL_ERROR_INVALID_PARAM, call + ": " + why);
  }
  if (const Entry* e = de ? de : se)
    e->backend->copy(dst, src, count, kind);
  else
    std::memmove(dst, src, count);
  return ACL_SUCCESS;
}

aclError aclrtMemset(void* dev_ptr, std::size_t max_count, int32_t value, std::size_t count) {
  t_last_error.clear();
  std::string call = "aclrtMemset(devPtr=" + ptr_arg(dev_ptr) + fmt(", maxCount=%zu, value=%d, count=%zu)",
                                                                    max_count, value, count);
  if (!dev_ptr) return fail(ACL_ERROR_INVALID_PARAM, call + ": devPtr is null");
  if (count > max_count) return fail(ACL_ERROR_INVALID_PARAM, call + ": count exceeds maxCount");
  if (count == 0) return ACL_SUCCESS;
  std::string why;
  {
    std::shared_lock<std::shared_mutex> lk(rt().mu);
    if (const Entry* e = rt().range(reinterpret_cast<std::uintptr_t>(dev_ptr), count, "devPtr", nullptr, &why)) {
      e->backend->fill(dev_ptr, value, count);
      return ACL_SUCCESS;
    }
  }
  return fail(ACL_ERROR_INVALID_PARAM, call + ": " + why);
}

aclError aclrtGetMemInfo(int attr, std::size_t* free_bytes, std::size_t* total_bytes) {
  t_last_error.clear();
  std::string call = fmt("aclrtGetMemInfo(attr=%d)", attr);
  if (!free_bytes || !total_bytes) return fail(ACL_ERROR_INVALID_PARAM, call + ": free/total out-pointer is null");
  if (attr < ACL_DDR_MEM || attr > ACL_HBM_MEM_P2P_NORMAL)
    return fail(ACL_ERROR_INVALID_PARAM, call + ": unknown aclrtMemAttr (expected 0..9)");
  bool huge = attr == ACL_DDR_MEM_HUGE || attr == ACL_HBM_MEM_HUGE || attr == ACL_DDR_MEM_P2P_HUGE ||
              attr == ACL_HBM_MEM_P2P_HUGE;
  if (huge) {
    *total_bytes = static_cast<std::size_t>(read_long(std::string(kHugePool) + "/nr_hugepages")) * kHugePageSize;
    *free_bytes = static_cast<std::size_t>(read_long(std::string(kHugePool) + "/free_hugepages")) * kHugePageSize;
    return ACL_SUCCESS;
  }
  std::shared_lock<std::shared_mutex> lk(rt().mu);
  std::size_t total = rt().device->capacity(), used = rt().live_device_mapped;
  *total_bytes = total;
  *free_bytes = total > used ? total - used : 0;
  return ACL_SUCCESS;
}

std::optional<AllocationInfo> lookup(const void* addr) {
  auto p = reinterpret_cast<std::uintptr_t>(addr);
  std::shared_lock<std::shared_mutex> lk(rt().mu);
  const Entry* e = rt().containing(p);
  if (!e) return std::nullopt;
  AllocationInfo info;
  info.base = reinterpret_cast<std::uintptr_t>(e->m.base);
  info.size = e->size;
  info.mapped_size = e->m.mapped_size;
  info.fd = e->m.fd;
  info.offset = p - info.base;
  info.page_size = e->m.page_size;
  info.kind = e->m.kind;
  info.space = e->space;
  return info;
}

Stats stats() {
  std::shared_lock<std::shared_mutex> lk(rt().mu);
  return rt().st;
}

std::string last_error() { return t_last_error; }
aclError record_error(aclError code, const std::string& message) { return fail(code, message); }

void set_log_sink(std::function<void(const std::string&)> sink) {
  std::lock_guard<std::mutex> lk(g_log_mu);
  g_sink = std::move(sink);
}
void set_log_enabled(bool enabled) { set_log_sink(enabled ? stderr_sink : nullptr); }

void set_require_shareable(bool require) { g_require_shareable.store(require); }
bool require_shareable() { return g_require_shareable.load(); }

}  // namespace hixl::acl
