// hixl_tools._perf: bindings for the C++ measurement loops of bench/ and hixl_tools.bench (GIL released for
// their whole run). They take hixl._core's Endpoint and Engine objects (perf_module.cc says why that is sound).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "engine/engine.h"
#include "perf/perf.h"
#include "verbs/error.h"

namespace py = pybind11;

namespace {
py::dict stream_dict(const hixl::perf::StreamResult& r) {
  py::dict d;
  d["elapsed_ns"] = r.elapsed_ns;
  d["bytes"] = r.bytes;
  d["requests"] = r.requests;
  d["req_p50_ns"] = r.req_p50_ns;
  d["req_p99_ns"] = r.req_p99_ns;
  return d;
}

hixl::rdma::Op rdma_op(int op, const char* fn) {
  if (op < 0 || op > 2) throw hixl::Error(std::string(fn) + ": op must be 0 (READ), 1 (WRITE) or 2 (WRITE_WITH_IMM)");
  return hixl::rdma::Op(op);
}

hixl::engine::TransferOp engine_op(int op, const char* fn) {
  if (op < 0 || op > 1) throw hixl::Error(std::string(fn) + ": op must be 0 (READ) or 1 (WRITE)");
  return hixl::engine::TransferOp(op);
}
}  // namespace

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
           uint64_t size, uint32_t descs_per_req, uint32_t iters, uint32_t window, uint32_t imm) {
          auto o = rdma_op(op, "perf_write_stream");
          perf::StreamResult r;
          {
            py::gil_scoped_release nogil;
            r = perf::write_stream(ep, o, local_addr, remote_addr, rkey, span, size, descs_per_req, iters, window,
                                   imm);
          }
          return stream_dict(r);
        },
        py::arg("ep"), py::arg("op"), py::arg("local_addr"), py::arg("remote_addr"), py::arg("rkey"), py::arg("span"),
        py::arg("size"), py::arg("descs_per_req") = 1, py::arg("iters") = 1000, py::arg("window") = 16,
        py::arg("imm") = 0);
  m.def("perf_op_latency",
        [](rdma::Endpoint& ep, int op, uint64_t local_addr, uint64_t remote_addr, uint32_t rkey, uint64_t size,
           uint32_t descs_per_req, uint32_t iters, uint32_t timeout_ms) {
          auto o = rdma_op(op, "perf_op_latency");
          py::gil_scoped_release nogil;
          return perf::op_latency(ep, o, local_addr, remote_addr, rkey, size, descs_per_req, iters, timeout_ms);
        },
        py::arg("ep"), py::arg("op"), py::arg("local_addr"), py::arg("remote_addr"), py::arg("rkey"), py::arg("size"),
        py::arg("descs_per_req") = 1, py::arg("iters") = 1000, py::arg("timeout_ms") = 10000);
  m.def("perf_drain_imm",
        [](rdma::Endpoint& ep, uint64_t count, uint32_t timeout_ms) {
          py::gil_scoped_release nogil;
          return perf::drain_imm(ep, count, timeout_ms);
        },
        py::arg("ep"), py::arg("count"), py::arg("timeout_ms") = 10000);
  m.def("perf_engine_stream",
        [](engine::Engine& e, const std::string& remote, int op, int64_t flag, uint64_t local_addr,
           uint64_t remote_addr, uint64_t span, uint64_t size, uint32_t descs_per_req, uint32_t iters,
           uint32_t window, uint32_t timeout_ms) {
          auto o = engine_op(op, "perf_engine_stream");
          perf::StreamResult r;
          {
            py::gil_scoped_release nogil;
            r = perf::engine_stream(e, remote, o, flag, local_addr, remote_addr, span, size, descs_per_req, iters,
                                    window, timeout_ms);
          }
          return stream_dict(r);
        },
        py::arg("engine"), py::arg("remote"), py::arg("op"), py::arg("flag"), py::arg("local_addr"),
        py::arg("remote_addr"), py::arg("span"), py::arg("size"), py::arg("descs_per_req") = 1,
        py::arg("iters") = 1000, py::arg("window") = 16, py::arg("timeout_ms") = 60000);
  // The floor of a Python loop over the engine (hixl bench --desc-sweep): bindings with the argument
  // and result types of Engine.transfer_async_one and Engine.transfer_wait, that release the GIL as
  // those do, and do nothing else. A loop over them costs what the interpreter and pybind11 add to each
  // request; the C++ loop's time plus that is the best a Python loop over these bindings can reach.
  m.def(
      "perf_call_floor_async",
      [](const std::string& remote, int op, uint64_t local_addr, uint64_t remote_addr, uint64_t len,
         uint64_t user_data) {
        return std::make_pair(0, uint64_t(remote.size()) + uint64_t(op) + local_addr + remote_addr + len + user_data);
      },
      py::arg("remote"), py::arg("op"), py::arg("local_addr"), py::arg("remote_addr"), py::arg("len"),
      py::arg("user_data") = 0, py::call_guard<py::gil_scoped_release>());
  m.def(
      "perf_call_floor_wait", [](uint64_t req, int timeout_ms) { return std::make_pair(0, int(req == 0 || timeout_ms < 0)); },
      py::arg("req"), py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>());
  m.def("perf_engine_latency",
        [](engine::Engine& e, const std::string& remote, int op, int64_t flag, uint64_t local_addr,
           uint64_t remote_addr, uint64_t size, uint32_t descs_per_req, uint32_t iters, uint32_t timeout_ms) {
          auto o = engine_op(op, "perf_engine_latency");
          py::gil_scoped_release nogil;
          return perf::engine_latency(e, remote, o, flag, local_addr, remote_addr, size, descs_per_req, iters,
                                      timeout_ms);
        },
        py::arg("engine"), py::arg("remote"), py::arg("op"), py::arg("flag"), py::arg("local_addr"),
        py::arg("remote_addr"), py::arg("size"), py::arg("descs_per_req") = 1, py::arg("iters") = 1000,
        py::arg("timeout_ms") = 60000);
}
