// hixl._core.Engine: the C++ engine behind hixl.Hixl. Every method releases the GIL (all of them
// can block: registration pins memory, connects and transfers wait on the network) and returns
// status codes; argument checking that needs Python types lives in python/hixl/engine.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "engine/engine.h"

namespace py = pybind11;
using namespace hixl::engine;
using release = py::call_guard<py::gil_scoped_release>;

namespace {
using DescTuples = std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>;  // (local_addr, remote_addr, len)
std::vector<OpDesc> to_descs(const DescTuples& d) {
  std::vector<OpDesc> out(d.size());
  for (size_t i = 0; i < d.size(); ++i) out[i] = {std::get<0>(d[i]), std::get<1>(d[i]), std::get<2>(d[i])};
  return out;
}
// (rc, [(peer, value), ...]); built without the GIL (plain C++ values), converted by pybind11 later.
std::pair<int, std::vector<std::pair<std::string, uint32_t>>> flag_tuples(
    std::pair<int, std::vector<FlagEvent>> r) {
  std::vector<std::pair<std::string, uint32_t>> out;
  out.reserve(r.second.size());
  for (auto& f : r.second) out.emplace_back(std::move(f.peer), f.value);
  return {r.first, std::move(out)};
}
}  // namespace

void hixl_bind_engine(py::module_& m) {
  py::class_<Engine>(m, "Engine")
      .def(py::init<>())
      .def(
          "initialize",
          [](Engine& e, const std::string& local, const std::string& transport, const std::string& device,
             int gid_index, int traffic_class, int service_level, bool auto_connect, const std::string& auth_token,
             int async_timeout_ms, int heartbeat_ms, int heartbeat_misses) {
            Options o;
            if (async_timeout_ms >= 0) o.async_timeout_ms = async_timeout_ms;  // < 0: the defaults (engine.h)
            if (heartbeat_ms >= 0) o.heartbeat_ms = heartbeat_ms;
            if (heartbeat_misses >= 0) o.heartbeat_misses = heartbeat_misses;
            o.transport = transport;
            o.device = device;
            o.gid_index = gid_index;
            o.traffic_class = traffic_class;
            o.service_level = service_level;
            o.auto_connect = auto_connect;
            o.auth_token = auth_token;
            return e.initialize(local, o);
          },
          py::arg("local_engine"), py::arg("transport") = "auto", py::arg("device") = "", py::arg("gid_index") = -1,
          py::arg("traffic_class") = -1, py::arg("service_level") = -1, py::arg("auto_connect") = false,
          py::arg("auth_token") = "", py::arg("async_timeout_ms") = -1, py::arg("heartbeat_ms") = -1,
          py::arg("heartbeat_misses") = -1, release())
      .def("finalize", &Engine::finalize, release())
      .def(
          "register_mem",
          [](Engine& e, uint64_t addr, uint64_t len, int type, uint32_t access) {
            return e.register_mem(addr, len, MemType(type), access);
          },
          py::arg("addr"), py::arg("len"), py::arg("mem_type"), py::arg("access") = 3, release())
      .def("deregister_mem", &Engine::deregister_mem, py::arg("handle"), release())
      .def("connect", &Engine::connect, py::arg("remote"), py::arg("timeout_ms"), release())
      .def("disconnect", &Engine::disconnect, py::arg("remote"), py::arg("timeout_ms"), release())
      .def(
          "transfer_sync",
          [](Engine& e, const std::string& remote, int op, const DescTuples& d, int timeout_ms, int64_t flag) {
            return e.transfer_sync(remote, TransferOp(op), to_descs(d), timeout_ms, flag);
          },
          py::arg("remote"), py::arg("op"), py::arg("descs"), py::arg("timeout_ms"), py::arg("flag") = -1, release())
      .def(
          "transfer_async",
          [](Engine& e, const std::string& remote, int op, const DescTuples& d, uint64_t user_data, int64_t flag,
             int timeout_ms) { return e.transfer_async(remote, TransferOp(op), to_descs(d), user_data, flag, timeout_ms); },
          py::arg("remote"), py::arg("op"), py::arg("descs"), py::arg("user_data"), py::arg("flag") = -1,
          py::arg("timeout_ms") = -1, release())
      .def("transfer_status", &Engine::transfer_status, py::arg("req"), release())
      .def("transfer_wait", &Engine::transfer_wait, py::arg("req"), py::arg("timeout_ms"), release())
      .def(
          "poll_flags",
          [](Engine& e, size_t max_count) { return flag_tuples(e.poll_flags(max_count)); },
          py::arg("max_count") = 4096, release())
      .def(
          "wait_flags",
          [](Engine& e, size_t max_count, int timeout_ms) { return flag_tuples(e.wait_flags(max_count, timeout_ms)); },
          py::arg("max_count"), py::arg("timeout_ms"), release())
      .def_property_readonly("flag_fd", &Engine::flag_fd)
      .def(
          "all_transfer_status",
          [](Engine& e, uint64_t max_count, bool skip_waiting) {
            auto [rc, results] = e.all_transfer_status(max_count, skip_waiting);
            std::vector<std::tuple<uint64_t, uint64_t, int>> out;
            out.reserve(results.size());
            for (auto& r : results) out.emplace_back(r.req, r.user_data, r.status);
            return std::make_pair(rc, out);
          },
          py::arg("max_count"), py::arg("skip_waiting"), release())
      .def("send_notify", &Engine::send_notify, py::arg("remote"), py::arg("name"), py::arg("msg"),
           py::arg("timeout_ms"), release())
      .def(
          "get_notifies",
          [](Engine& e, int wait_ms) {
            std::pair<int, std::vector<Notify>> r;
            {
              py::gil_scoped_release nogil;
              r = wait_ms == 0 ? e.get_notifies() : e.wait_notifies(wait_ms);
            }
            // Names and messages arrive as bytes from the peer: decode with replacement so one bad
            // sender cannot make get_notifies raise.
            py::list out;
            for (auto& n : r.second) {
              py::str name = py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(n.name.data(), Py_ssize_t(n.name.size()), "replace"));
              py::str msg = py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(n.msg.data(), Py_ssize_t(n.msg.size()), "replace"));
              out.append(py::make_tuple(name, msg));
            }
            return py::make_tuple(r.first, out);
          },
          py::arg("wait_ms") = 0)
      .def(
          "link_info",
          [](Engine& e, const std::string& remote) {
            std::pair<int, LinkInfo> r;
            {
              py::gil_scoped_release nogil;
              r = e.link_info(remote);
            }
            py::dict d;
            if (r.first == kSuccess) {
              const LinkInfo& li = r.second;
              d["remote"] = li.remote;
              d["transport"] = li.transport;
              d["initiator"] = li.initiator;
              d["device"] = li.device;
              d["gid_index"] = li.gid_index;
              d["path_mtu"] = li.path_mtu;
              d["qpn"] = li.qpn;
              d["remote_qpn"] = li.remote_qpn;
              d["traffic_class"] = li.traffic_class;
              d["service_level"] = li.service_level;
              d["remote_regions"] = li.remote_regions;
            }
            return py::make_tuple(r.first, d);
          },
          py::arg("remote"))
      .def("peers", &Engine::peers, release())
      .def_property_readonly("local_engine", &Engine::local_engine)
      .def_property_readonly("data_transport", &Engine::data_transport)
      .def("last_error", &Engine::last_error);
}
