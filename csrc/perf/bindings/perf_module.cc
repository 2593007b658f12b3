// pybind11 module hixl_tools._perf: the benchmarks' C++ loops and call floors, kept out of hixl._core.
//
// The loops take the hixl._core.Endpoint and hixl._core.Engine objects a benchmark made: pybind11
// shares type registrations between modules built with the same pybind11 internals (the types are
// not py::module_local), so `rdma::Endpoint&` here resolves an object of _core's. This module links
// its own copy of the hixl_core library; that is sound because
//   - the layouts are the same: both modules compile the same sources with the same compiler and
//     flags, which HIXL_CORE_BUILD_ID (a hash of them, from CMakeLists.txt) stands for, and the
//     import below refuses a _core whose id differs;
//   - the loops run on the calling thread and reach the engine's and endpoint's state through the
//     object (its locks, tables, queues, metrics); the engine's own threads run _core's code;
//   - the process-wide state of this copy is per-thread scratch or set up the same way as _core's:
//     the engine's thread_local ThreadState (last error, descriptor scratch, the link look-up cache,
//     checked against the table's id and generation read from the object), the cycle counter's rate,
//     the log's threshold (from the environment) and its lock. A request that fails in a loop raises
//     with its error and leaves hixl.Hixl's last_error as it was. Should a loop drop the last
//     reference to a link that closed meanwhile, its queue pair goes to this copy's Reaper, a second
//     one-thread reaper that releases it in the same way (Engine.finalize waits for _core's only).
#include <pybind11/pybind11.h>

#include <string>

namespace py = pybind11;

void hixl_bind_perf(py::module_& m);
void hixl_bind_floor_calls(py::module_& m);

PYBIND11_MODULE(_perf, m) {
  m.doc() = "hixl_tools C++ measurement loops over hixl._core objects. Private: use hixl_tools.bench.";
  py::module_ core = py::module_::import("hixl._core");  // registers Endpoint, Engine, HixlError
  const std::string theirs = py::str(py::getattr(core, "CORE_BUILD_ID", py::str("(none)")));
  if (theirs != HIXL_CORE_BUILD_ID)
    throw py::import_error("hixl_tools._perf: built against another hixl._core (its core build " +
                           std::string(HIXL_CORE_BUILD_ID) + ", the installed hixl's " + theirs +
                           "): build and install hixl and hixl-tools from the same checkout "
                           "(pip install . ./tools)");
  m.attr("CORE_BUILD_ID") = HIXL_CORE_BUILD_ID;
  hixl_bind_perf(m);
  hixl_bind_floor_calls(m);
}
