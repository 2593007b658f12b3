// pybind11 bindings of the aclrtMalloc shim (csrc/acl/allocator.h), installed as hixl._core.acl.
#pragma once

// The full header, not a forward declaration: pybind11's namespace carries hidden visibility,
// and a plain `namespace pybind11 { class module_; }` would clash with it (-Wattributes).
#include <pybind11/pybind11.h>

// Fills m (module.cc passes m.def_submodule("acl")) with the CANN constants and functions.
void hixl_bind_acl(pybind11::module_& m);
