// Bindings for the C++ measurement loops used by bench/ (GIL released for their whole run).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "perf/perf.h"
#include "verbs/error.h"

namespace py = pybind11;

void hixl_bind_perf(py::module_& m) {
  using namespace hixl;
  m.def("perf_write_pingpong",
        [](rdma::Endpoint& ep, uint64_t local_buf, uint64_t remote_recv_addr, uint32_t rkey, uint64_t size,
           uint32_t iters, bool initiator, uint32_t timeout_ms) {
          py::gil_scoped_release nogil;
          return perf::write_pingpong(ep, reinterpret_cast<uint8_t*>(local_buf), remote_recv_addr, rkey, size, iters,
                                      initiator, timeout_ms);
        },
        py::arg("ep"), py::arg("local_buf"), py::arg("remote_recv_addr"), py::arg("rkey"), py::arg("size"),
        py::arg("iters"), py::arg("initiator"), py::arg("timeout_ms") = 10000);
  m.def("perf_write_stream",
        [](rdma::Endpoint& ep, int op, uint64_t local_addr, uint64_t remote_addr, uint32_t rkey, uint64_t span,
           uint64_t size, uint32_t descs_per_req, uint32_t iters, uint32_t window) {
          if (op < 0 || op > 2) throw Error("perf_write_stream: bad op");
          perf::StreamResult r;
          {
            py::gil_scoped_release nogil;
            r = perf::write_stream(ep, rdma::Op(op), local_addr, remote_addr, rkey, span, size, descs_per_req, iters,
                                   window);
          }
          py::dict d;
          d["elapsed_ns"] = r.elapsed_ns;
          d["bytes"] = r.bytes;
          d["requests"] = r.requests;
          return d;
        },
        py::arg("ep"), py::arg("op"), py::arg("local_addr"), py::arg("remote_addr"), py::arg("rkey"), py::arg("span"),
        py::arg("size"), py::arg("descs_per_req") = 1, py::arg("iters") = 1000, py::arg("window") = 16);
}
