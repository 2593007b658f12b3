// hixl._core.acl: thin pybind11 layer over csrc/acl/allocator.h. Addresses are Python ints.
// Argument range checks live in python/hixl/acl.py (which never raises); here every call that can
// block (mmap/munmap, large memcpy/memset) releases the GIL.
#include "bindings/acl_bindings.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>

#include "acl/allocator.h"

namespace py = pybind11;
namespace acl = hixl::acl;

namespace {

using Addr = std::uintptr_t;
void* ptr(Addr a) { return reinterpret_cast<void*>(a); }
Addr addr(const void* p) { return reinterpret_cast<Addr>(p); }
using Release = py::call_guard<py::gil_scoped_release>;

py::object describe(Addr a) {
  auto info = acl::lookup(ptr(a));
  if (!info) return py::none();
  py::dict d;
  d["base"] = info->base;
  d["size"] = info->size;
  d["mapped_size"] = info->mapped_size;
  d["fd"] = info->fd;
  d["offset"] = info->offset;
  d["page_size"] = info->page_size;
  d["kind"] = acl::page_kind_name(info->kind);
  d["memory"] = acl::mem_space_name(info->space);
  d["shareable"] = info->fd >= 0;
  return std::move(d);
}

py::dict stats() {
  acl::Stats s = acl::stats();
  py::dict d;
  d["live_allocations"] = s.live_allocations;
  d["live_device_bytes"] = s.live_device_bytes;
  d["live_mapped_bytes"] = s.live_mapped_bytes;
  d["peak_mapped_bytes"] = s.peak_mapped_bytes;
  d["total_allocs"] = s.total_allocs;
  d["total_frees"] = s.total_frees;
  for (int k = 0; k < 3; ++k)
    d[py::str(std::string("live_") + acl::page_kind_name(static_cast<acl::PageKind>(k)))] = s.live_by_kind[k];
  return d;
}

}  // namespace

void hixl_bind_acl(py::module_& m) {
#define HIXL_ACL_CONST(name) m.attr(#name) = acl::name
  HIXL_ACL_CONST(ACL_SUCCESS);
  HIXL_ACL_CONST(ACL_ERROR_INVALID_PARAM);
  HIXL_ACL_CONST(ACL_ERROR_BAD_ALLOC);
  HIXL_ACL_CONST(ACL_ERROR_API_NOT_SUPPORT);
  HIXL_ACL_CONST(ACL_ERROR_MEMORY_ADDRESS_UNALIGNED);
  HIXL_ACL_CONST(ACL_ERROR_FEATURE_UNSUPPORTED);
  HIXL_ACL_CONST(ACL_ERROR_INTERNAL_ERROR);
  HIXL_ACL_CONST(ACL_MEM_MALLOC_HUGE_FIRST);
  HIXL_ACL_CONST(ACL_MEM_MALLOC_HUGE_ONLY);
  HIXL_ACL_CONST(ACL_MEM_MALLOC_NORMAL_ONLY);
  HIXL_ACL_CONST(ACL_MEM_MALLOC_HUGE_FIRST_P2P);
  HIXL_ACL_CONST(ACL_MEM_MALLOC_HUGE_ONLY_P2P);
  HIXL_ACL_CONST(ACL_MEM_MALLOC_NORMAL_ONLY_P2P);
  HIXL_ACL_CONST(ACL_MEM_MALLOC_HUGE1G_ONLY);
  HIXL_ACL_CONST(ACL_MEM_MALLOC_HUGE1G_ONLY_P2P);
  HIXL_ACL_CONST(ACL_MEM_TYPE_LOW_BAND_WIDTH);
  HIXL_ACL_CONST(ACL_MEM_TYPE_HIGH_BAND_WIDTH);
  HIXL_ACL_CONST(ACL_MEMCPY_HOST_TO_HOST);
  HIXL_ACL_CONST(ACL_MEMCPY_HOST_TO_DEVICE);
  HIXL_ACL_CONST(ACL_MEMCPY_DEVICE_TO_HOST);
  HIXL_ACL_CONST(ACL_MEMCPY_DEVICE_TO_DEVICE);
  HIXL_ACL_CONST(ACL_MEMCPY_DEFAULT);
  HIXL_ACL_CONST(ACL_DDR_MEM);
  HIXL_ACL_CONST(ACL_HBM_MEM);
  HIXL_ACL_CONST(ACL_DDR_MEM_HUGE);
  HIXL_ACL_CONST(ACL_DDR_MEM_NORMAL);
  HIXL_ACL_CONST(ACL_HBM_MEM_HUGE);
  HIXL_ACL_CONST(ACL_HBM_MEM_NORMAL);
  HIXL_ACL_CONST(ACL_DDR_MEM_P2P_HUGE);
  HIXL_ACL_CONST(ACL_DDR_MEM_P2P_NORMAL);
  HIXL_ACL_CONST(ACL_HBM_MEM_P2P_HUGE);
  HIXL_ACL_CONST(ACL_HBM_MEM_P2P_NORMAL);
#undef HIXL_ACL_CONST
  m.attr("HUGE_PAGE_SIZE") = acl::kHugePageSize;

  m.def(
      "aclrtMalloc",
      [](std::size_t size, int policy) {
        void* p = nullptr;
        int ret = acl::aclrtMalloc(&p, size, policy);
        return std::make_tuple(ret, addr(p));
      },
      py::arg("size"), py::arg("policy"), Release(), "-> (ret, addr); addr is 0 on failure");
  m.def(
      "aclrtFree", [](Addr a) { return acl::aclrtFree(ptr(a)); }, py::arg("addr"), Release());
  m.def(
      "aclrtMallocHost",
      [](std::size_t size) {
        void* p = nullptr;
        int ret = acl::aclrtMallocHost(&p, size);
        return std::make_tuple(ret, addr(p));
      },
      py::arg("size"), Release(), "-> (ret, addr); addr is 0 on failure");
  m.def(
      "aclrtFreeHost", [](Addr a) { return acl::aclrtFreeHost(ptr(a)); }, py::arg("addr"), Release());
  m.def(
      "aclrtMemcpy",
      [](Addr dst, std::size_t dst_max, Addr src, std::size_t count, int kind) {
        return acl::aclrtMemcpy(ptr(dst), dst_max, ptr(src), count, kind);
      },
      py::arg("dst"), py::arg("dst_max"), py::arg("src"), py::arg("count"), py::arg("kind"), Release());
  m.def(
      "aclrtMemset",
      [](Addr a, std::size_t max_count, std::int32_t value, std::size_t count) {
        return acl::aclrtMemset(ptr(a), max_count, value, count);
      },
      py::arg("addr"), py::arg("max_count"), py::arg("value"), py::arg("count"), Release());
  m.def(
      "aclrtGetMemInfo",
      [](int attr) {
        std::size_t free_bytes = 0, total_bytes = 0;
        int ret = acl::aclrtGetMemInfo(attr, &free_bytes, &total_bytes);
        return std::make_tuple(ret, free_bytes, total_bytes);
      },
      py::arg("attr"), "-> (ret, free, total) in bytes");
  m.def("describe", &describe, py::arg("addr"),
        "dict(base, size, mapped_size, fd, offset, page_size, kind, memory, shareable) for any address "
        "inside a live allocation, else None");
  m.def("stats", &stats);
  m.def("last_error", &acl::last_error);
  m.def("record_error", &acl::record_error, py::arg("code"), py::arg("message"));
  m.def("set_log_enabled", &acl::set_log_enabled, py::arg("enabled"));
  m.def("set_require_shareable", &acl::set_require_shareable, py::arg("require"));
  m.def("require_shareable", &acl::require_shareable);
  m.def("device_allocator_name", &acl::device_allocator_name);
}
