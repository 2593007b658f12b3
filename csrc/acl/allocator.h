// aclrtMalloc-style device-memory shim: stands in for accelerator HBM on hosts without one.
//
// Names and numeric values follow CANN's runtime (acl_base.h / acl_rt.h). Memory is page-aligned
// and, where possible, backed by a memfd mapped MAP_SHARED, so a same-host transport can hand the
// fd to a peer; every allocation is pinnable with ibv_reg_mr (no MAP_NORESERVE).
//
// Layering: the public aclrt* functions validate arguments against one allocation table (one
// reader-writer mutex) and delegate the memory itself to a DeviceAllocator backend. The host memfd
// backend is the default, chosen in one place (make_default_device_allocator); a real device
// allocator can be installed with install_device_allocator().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace hixl::acl {

using aclError = int;

// aclError values (CANN acl_base.h).
inline constexpr aclError ACL_SUCCESS = 0;
inline constexpr aclError ACL_ERROR_INVALID_PARAM = 100000;
inline constexpr aclError ACL_ERROR_BAD_ALLOC = 200000;
inline constexpr aclError ACL_ERROR_API_NOT_SUPPORT = 200001;
inline constexpr aclError ACL_ERROR_MEMORY_ADDRESS_UNALIGNED = 200003;
inline constexpr aclError ACL_ERROR_FEATURE_UNSUPPORTED = 200006;
inline constexpr aclError ACL_ERROR_INTERNAL_ERROR = 500000;

// aclrtMemMallocPolicy (CANN acl_rt.h). The bandwidth bits may be OR'ed onto a page policy and
// are ignored by the host shim; HUGE1G policies are refused with ACL_ERROR_FEATURE_UNSUPPORTED.
inline constexpr int ACL_MEM_MALLOC_HUGE_FIRST = 0;
inline constexpr int ACL_MEM_MALLOC_HUGE_ONLY = 1;
inline constexpr int ACL_MEM_MALLOC_NORMAL_ONLY = 2;
inline constexpr int ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3;
inline constexpr int ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4;
inline constexpr int ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5;
inline constexpr int ACL_MEM_MALLOC_HUGE1G_ONLY = 6;
inline constexpr int ACL_MEM_MALLOC_HUGE1G_ONLY_P2P = 7;
inline constexpr int ACL_MEM_TYPE_LOW_BAND_WIDTH = 0x0100;
inline constexpr int ACL_MEM_TYPE_HIGH_BAND_WIDTH = 0x1000;

// aclrtMemcpyKind (CANN acl_rt.h). DEFAULT infers each side from the address.
inline constexpr int ACL_MEMCPY_HOST_TO_HOST = 0;
inline constexpr int ACL_MEMCPY_HOST_TO_DEVICE = 1;
inline constexpr int ACL_MEMCPY_DEVICE_TO_HOST = 2;
inline constexpr int ACL_MEMCPY_DEVICE_TO_DEVICE = 3;
inline constexpr int ACL_MEMCPY_DEFAULT = 4;

// aclrtMemAttr (CANN acl_rt.h), for aclrtGetMemInfo.
inline constexpr int ACL_DDR_MEM = 0;
inline constexpr int ACL_HBM_MEM = 1;
inline constexpr int ACL_DDR_MEM_HUGE = 2;
inline constexpr int ACL_DDR_MEM_NORMAL = 3;
inline constexpr int ACL_HBM_MEM_HUGE = 4;
inline constexpr int ACL_HBM_MEM_NORMAL = 5;
inline constexpr int ACL_DDR_MEM_P2P_HUGE = 6;
inline constexpr int ACL_DDR_MEM_P2P_NORMAL = 7;
inline constexpr int ACL_HBM_MEM_P2P_HUGE = 8;
inline constexpr int ACL_HBM_MEM_P2P_NORMAL = 9;

inline constexpr std::size_t kHugePageSize = std::size_t{2} << 20;  // 2 MiB

// Which pages back an allocation.
//   kNormal:  base pages (4 KiB on x86-64), memfd, MAP_SHARED.
//   kThp:     2 MiB-aligned mapping advised with MADV_HUGEPAGE. Best effort: the kernel may still
//             use base pages. Backed by a memfd when shmem THP is enabled
//             (/sys/kernel/mm/transparent_hugepage/shmem_enabled), otherwise by an anonymous
//             MAP_PRIVATE mapping with fd == -1 (not shareable with a peer process).
//   kHugeTlb: 2 MiB hugetlb pages, memfd(MFD_HUGETLB | MFD_HUGE_2MB), MAP_SHARED; reserved at mmap.
enum class PageKind : int { kNormal = 0, kThp = 1, kHugeTlb = 2 };
enum class MemSpace : int { kDevice = 0, kHost = 1 };

const char* page_kind_name(PageKind kind) noexcept;  // "normal" | "thp" | "hugetlb"
const char* mem_space_name(MemSpace space) noexcept;  // "device" | "host"

// What a backend hands out. [base, base + mapped_size) is mapped; fd (or -1) maps it from offset 0.
struct Mapping {
  void* base = nullptr;
  std::size_t mapped_size = 0;
  int fd = -1;
  std::size_t page_size = 0;
  PageKind kind = PageKind::kNormal;
};

// A live allocation, as seen from any address inside it.
struct AllocationInfo {
  std::uintptr_t base = 0;
  std::size_t size = 0;         // bytes requested; bounds checks use [base, base + size)
  std::size_t mapped_size = 0;  // bytes mapped (size rounded up to the page size)
  int fd = -1;                  // owned by the allocator, closed by aclrtFree; -1: not shareable
  std::size_t offset = 0;       // queried address - base (== offset into fd)
  std::size_t page_size = 0;
  PageKind kind = PageKind::kNormal;
  MemSpace space = MemSpace::kDevice;
};

// Backend seam. Must be thread-safe: allocate/release/copy/fill of different allocations run
// concurrently (the table lock is not held during allocate/release).
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual const char* name() const noexcept = 0;
  // page_policy is one of HUGE_FIRST / HUGE_ONLY / NORMAL_ONLY (P2P and bandwidth bits already
  // folded away); size > 0 and within capacity(). On failure return a code and fill *why.
  virtual aclError allocate(std::size_t size, int page_policy, Mapping* out, std::string* why) = 0;
  virtual void release(const Mapping& m) noexcept = 0;
  // Copies/fills already bounds-checked ranges; ranges may overlap.
  virtual void copy(void* dst, const void* src, std::size_t count, int kind) noexcept = 0;
  virtual void fill(void* dst, int value, std::size_t count) noexcept = 0;
  // Largest single allocation accepted (bytes); also aclrtGetMemInfo's total.
  virtual std::size_t capacity() const noexcept = 0;
};

// The one place the default backend is chosen (the host memfd backend).
std::shared_ptr<DeviceAllocator> make_default_device_allocator();
// Replaces the backend used by later aclrtMalloc calls (null: back to the default). Live
// allocations keep the backend that made them and are released through it.
void install_device_allocator(std::shared_ptr<DeviceAllocator> backend);
std::string device_allocator_name();

// --- CANN runtime API (out-parameters as in C) -------------------------------------------------
aclError aclrtMalloc(void** dev_ptr, std::size_t size, int policy);
aclError aclrtFree(void* dev_ptr);
aclError aclrtMallocHost(void** host_ptr, std::size_t size);  // page-aligned memfd host memory
aclError aclrtFreeHost(void* host_ptr);
// count > dst_max, null pointers, unknown kind, or a device side outside one live device
// allocation are refused. Overlap is allowed (memmove). count == 0 is a no-op.
aclError aclrtMemcpy(void* dst, std::size_t dst_max, const void* src, std::size_t count, int kind);
// dev_ptr must lie inside a live allocation (aclrtMalloc or aclrtMallocHost); value's low byte.
aclError aclrtMemset(void* dev_ptr, std::size_t max_count, int32_t value, std::size_t count);
// *_HUGE attrs report the 2 MiB hugetlb pool; others report capacity() and capacity minus the
// bytes mapped by live device allocations.
aclError aclrtGetMemInfo(int attr, std::size_t* free_bytes, std::size_t* total_bytes);

// --- Shim extensions ---------------------------------------------------------------------------
// Any address inside a live allocation (device or host) -> its description; nullopt otherwise.
// The fd stays owned by the allocator and is closed on free: dup() it to keep it.
std::optional<AllocationInfo> lookup(const void* addr);

struct Stats {
  std::size_t live_allocations = 0;  // device + host
  std::size_t live_device_bytes = 0;  // requested
  std::size_t live_mapped_bytes = 0;  // device + host, mapped
  std::size_t peak_mapped_bytes = 0;
  std::uint64_t total_allocs = 0;
  std::uint64_t total_frees = 0;
  std::size_t live_by_kind[3] = {0, 0, 0};  // indexed by PageKind
};
Stats stats();

// Message of this thread's most recent aclrt* call if it failed; "" if it succeeded.
std::string last_error();
// Records a failure detected outside this library (e.g. Python argument checks): logs it,
// stores it as this thread's last error, and returns code.
aclError record_error(aclError code, const std::string& message);

// Errors go to the sink (default: one line on stderr). An empty function silences logging.
void set_log_sink(std::function<void(const std::string&)> sink);
void set_log_enabled(bool enabled);  // true: stderr sink, false: silent

// When true, ACL_MEM_MALLOC_HUGE_FIRST never falls back to anonymous THP (fd == -1) and uses
// memfd base pages instead, so every allocation has an fd. Default false.
void set_require_shareable(bool require);
bool require_shareable();

}  // namespace hixl::acl
