// hixl._core.Engine: the C++ engine behind hixl.Hixl. Every method releases the GIL (all of them
// can block: registration pins memory, connects and transfers wait on the network) and returns
// status codes; argument checking that needs Python types lives in python/hixl/engine.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

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
// Numpy fast paths: the arrays are copied (one memcpy, GIL held) before the GIL is released, so
// another Python thread changing them cannot change what was checked; the copies are per-thread
// scratch, reused (no allocation per call). hixl/engine.py checks dtypes and shapes first.
using U64Array = py::array_t<uint64_t, py::array::c_style>;
static_assert(sizeof(OpDesc) == 3 * sizeof(uint64_t), "OpDesc is three u64 (local_addr, remote_addr, len)");
const std::vector<OpDesc>& copy_descs(const U64Array& a) {
  thread_local std::vector<OpDesc> v;
  if (a.ndim() != 2 || a.shape(1) != 3) throw py::value_error("descriptor array must have shape (N, 3)");
  v.resize(size_t(a.shape(0)));
  if (!v.empty()) std::memcpy(v.data(), a.data(), v.size() * sizeof(OpDesc));
  return v;
}
const std::vector<uint64_t>& copy_u64(const U64Array& a, int slot) {
  thread_local std::vector<uint64_t> v[4];
  if (a.ndim() != 1) throw py::value_error("index and block arrays must be one-dimensional");
  v[slot].resize(size_t(a.shape(0)));
  if (!v[slot].empty()) std::memcpy(v[slot].data(), a.data(), v[slot].size() * sizeof(uint64_t));
  return v[slot];
}

// (rc, [(peer, value), ...]); built without the GIL (plain C++ values), converted by pybind11 later.
std::pair<int, std::vector<std::pair<std::string, uint32_t>>> flag_tuples(
    std::pair<int, std::vector<FlagEvent>> r) {
  std::vector<std::pair<std::string, uint32_t>> out;
  out.reserve(r.second.size());
  for (auto& f : r.second) out.emplace_back(std::move(f.peer), f.value);
  return {r.first, std::move(out)};
}

// CANN's list of TransferOpDesc read in C++ (hixl/engine.py, Hixl._descs): in Python each descriptor
// cost ~0.2 us for its attributes, checks and a tuple, and pybind11 ~0.1 us more to convert the tuple.
// Only the plain form is taken here: every element has local_addr, remote_addr and len that are
// Python ints (exactly), with la > 0, ra > 0, len > 0, la + len <= 2^64 and ra + len <= 2^64, the
// checks of the Python path. Anything else gives None and leaves no Python error set: the caller then
// takes the Python path, which accepts numpy integers and refuses the rest with its message.
py::object descs_from_list(const py::handle& seq) {
  // Exactly a list or a tuple: a subclass may define its own iteration, which the Python path follows.
  if (!PyList_CheckExact(seq.ptr()) && !PyTuple_CheckExact(seq.ptr())) return py::none();
  // Interned once and kept for the process's life (a static py::object would be released after the
  // interpreter is gone).
  static PyObject* const kLocal = PyUnicode_InternFromString("local_addr");
  static PyObject* const kRemote = PyUnicode_InternFromString("remote_addr");
  static PyObject* const kLen = PyUnicode_InternFromString("len");
  if (!kLocal || !kRemote || !kLen) {  // out of memory at the first call: the Python path, every time
    PyErr_Clear();
    return py::none();
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  if (n == 0) return py::none();
  U64Array out({py::ssize_t(n), py::ssize_t(3)});
  uint64_t* o = out.mutable_data();
  // One attribute as a u64, or false (no attribute, not an exact int, negative or >= 2^64).
  auto u64_attr = [](PyObject* obj, PyObject* name, uint64_t* v) {
    PyObject* x = PyObject_GetAttr(obj, name);
    if (!x) {
      PyErr_Clear();
      return false;
    }
    bool ok = PyLong_CheckExact(x);
    if (ok) {
      *v = PyLong_AsUnsignedLongLong(x);  // -1 with OverflowError for negative or too large
      if (*v == ~0ULL && PyErr_Occurred()) {
        PyErr_Clear();
        ok = false;
      }
    }
    Py_DECREF(x);
    return ok;
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
    // An attribute can be a property that runs Python code, which could shrink the list: look at its
    // size again for each element, and hold the element while reading it.
    if (PySequence_Fast_GET_SIZE(seq.ptr()) != n) return py::none();
    py::object item = py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(seq.ptr(), i));
    uint64_t la = 0, ra = 0, len = 0;
    if (!u64_attr(item.ptr(), kLocal, &la) || !u64_attr(item.ptr(), kRemote, &ra) ||
        !u64_attr(item.ptr(), kLen, &len))
      return py::none();
    // la + len <= 2^64 (and ra's): the range does not wrap; la, ra and len are all > 0
    if (la == 0 || ra == 0 || len == 0 || len - 1 > ~la || len - 1 > ~ra) return py::none();
    o[3 * i] = la;
    o[3 * i + 1] = ra;
    o[3 * i + 2] = len;
  }
  return std::move(out);
}
}  // namespace

void hixl_bind_engine(py::module_& m) {
  py::class_<Engine>(m, "Engine")
      .def(py::init<>())
      .def(
          "initialize",
          [](Engine& e, const std::string& local, const std::string& transport, const std::string& device,
             int gid_index, int traffic_class, int service_level, bool auto_connect, const std::string& auth_token,
             int async_timeout_ms, int heartbeat_ms, int heartbeat_misses, int rdma_timeout, int rdma_retry_count,
             int rdma_qps_per_link, int64_t rdma_max_wr_bytes, int64_t rdma_send_window_bytes,
             bool trust_claimed_address) {
            Options o;
            if (async_timeout_ms >= 0) o.async_timeout_ms = async_timeout_ms;  // < 0: the defaults (engine.h)
            if (heartbeat_ms >= 0) o.heartbeat_ms = heartbeat_ms;
            if (heartbeat_misses >= 0) o.heartbeat_misses = heartbeat_misses;
            o.transport = transport;
            o.device = device;
            o.gid_index = gid_index;
            o.traffic_class = traffic_class;
            o.service_level = service_level;
            o.rdma_timeout = rdma_timeout;
            o.rdma_retry_count = rdma_retry_count;
            o.rdma_qps_per_link = rdma_qps_per_link;
            o.rdma_max_wr_bytes = rdma_max_wr_bytes;
            o.rdma_send_window_bytes = rdma_send_window_bytes;
            o.auto_connect = auto_connect;
            o.auth_token = auth_token;
            o.trust_claimed_address = trust_claimed_address;
            return e.initialize(local, o);
          },
          py::arg("local_engine"), py::arg("transport") = "auto", py::arg("device") = "", py::arg("gid_index") = -1,
          py::arg("traffic_class") = -1, py::arg("service_level") = -1, py::arg("auto_connect") = false,
          py::arg("auth_token") = "", py::arg("async_timeout_ms") = -1, py::arg("heartbeat_ms") = -1,
          py::arg("heartbeat_misses") = -1, py::arg("rdma_timeout") = -1, py::arg("rdma_retry_count") = -1,
          py::arg("rdma_qps_per_link") = -1, py::arg("rdma_max_wr_bytes") = -1,
          py::arg("rdma_send_window_bytes") = -1, py::arg("trust_claimed_address") = false, release())
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
      .def(
          "transfer_async_one",  // one descriptor, no containers to convert: the per-request fast path
          [](Engine& e, const std::string& remote, int op, uint64_t local_addr, uint64_t remote_addr, uint64_t len,
             uint64_t user_data) {
            OpDesc d{local_addr, remote_addr, len};
            return e.transfer_async(remote, TransferOp(op), &d, 1, user_data);
          },
          py::arg("remote"), py::arg("op"), py::arg("local_addr"), py::arg("remote_addr"), py::arg("len"),
          py::arg("user_data") = 0, release())
      .def(
          "transfer_sync_array",
          [](Engine& e, const std::string& remote, int op, const U64Array& d, int timeout_ms, int64_t flag) {
            const auto& v = copy_descs(d);
            py::gil_scoped_release nogil;
            return e.transfer_sync(remote, TransferOp(op), v.data(), v.size(), timeout_ms, flag);
          },
          py::arg("remote"), py::arg("op"), py::arg("descs"), py::arg("timeout_ms"), py::arg("flag") = -1)
      .def(
          "transfer_async_array",
          [](Engine& e, const std::string& remote, int op, const U64Array& d, uint64_t user_data, int64_t flag,
             int timeout_ms) {
            const auto& v = copy_descs(d);
            py::gil_scoped_release nogil;
            return e.transfer_async(remote, TransferOp(op), v.data(), v.size(), user_data, flag, timeout_ms);
          },
          py::arg("remote"), py::arg("op"), py::arg("descs"), py::arg("user_data"), py::arg("flag") = -1,
          py::arg("timeout_ms") = -1)
      .def(
          "prep_descs",
          [](Engine& e, const std::string& remote, const U64Array& addrs, const U64Array& lens, int timeout_ms) {
            const auto& a = copy_u64(addrs, 0);
            const auto& l = copy_u64(lens, 1);
            if (a.size() != l.size()) throw py::value_error("addrs and lens differ in length");
            py::gil_scoped_release nogil;
            return e.prep_descs(remote, a.data(), l.data(), a.size(), timeout_ms);
          },
          py::arg("remote"), py::arg("addrs"), py::arg("lens"), py::arg("timeout_ms"))
      .def("release_descs", &Engine::release_descs, py::arg("handle"), release())
      .def(
          "transfer_prepped",
          [](Engine& e, int op, uint64_t local_list, const U64Array& local_idx, uint64_t remote_list,
             const U64Array& remote_idx, bool sync, int timeout_ms, uint64_t user_data,
             int64_t flag) -> std::pair<int, uint64_t> {
            const auto& li = copy_u64(local_idx, 2);
            const auto& ri = copy_u64(remote_idx, 3);
            if (li.size() != ri.size()) throw py::value_error("local_idx and remote_idx differ in length");
            py::gil_scoped_release nogil;
            if (sync)
              return {e.transfer_prepped_sync(TransferOp(op), local_list, li.data(), remote_list, ri.data(), li.size(),
                                              timeout_ms, flag),
                      0};
            return e.transfer_prepped_async(TransferOp(op), local_list, li.data(), remote_list, ri.data(), li.size(),
                                            user_data, flag, timeout_ms);
          },
          py::arg("op"), py::arg("local_list"), py::arg("local_idx"), py::arg("remote_list"), py::arg("remote_idx"),
          py::arg("sync"), py::arg("timeout_ms"), py::arg("user_data") = 0, py::arg("flag") = -1)
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
      .def("fail_flag", &Engine::fail_flag, py::arg("remote"), py::arg("value"), py::arg("reason"),
           py::arg("timeout_ms"), release())
      .def(
          "poll_flag_failures",
          [](Engine& e, size_t max_count) {
            auto [rc, fs] = e.poll_flag_failures(max_count);
            std::vector<std::tuple<std::string, int64_t, std::string>> out;
            out.reserve(fs.size());
            for (auto& f : fs) out.emplace_back(std::move(f.peer), f.value, std::move(f.reason));
            return std::make_pair(rc, std::move(out));
          },
          py::arg("max_count") = 4096, release())
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
              d["rdma_timeout"] = li.rdma_timeout;
              d["rdma_retry_count"] = li.rdma_retry_count;
              d["rdma_max_wr_bytes"] = li.rdma_max_wr_bytes;
              d["posted_wrs"] = li.posted_wrs;
              d["rdma_send_window_bytes"] = li.rdma_send_window_bytes;
              d["qps"] = li.qps;
              d["qpns"] = li.qpns;
              d["remote_regions"] = li.remote_regions;
            }
            return py::make_tuple(r.first, d);
          },
          py::arg("remote"))
      .def("peers", &Engine::peers, release())
      .def("_inject_async_event", &Engine::inject_async_event, py::arg("type"), py::arg("qp_num"), py::arg("port"),
           release())
      .def("count_refused",
           [](Engine& e, const std::string& reason) {
             for (int r = 0; r < int(Metrics::Refused::kCount); ++r)
               if (reason == Metrics::refused_name(r)) return e.count_refused(Metrics::Refused(r));
             throw py::value_error("count_refused: unknown reason \"" + reason + "\"");
           })
      // The engine's counters (engine/metrics.h) as plain Python values; python/hixl/metrics.py
      // names them. Reading them takes no lock of the data path.
      .def("metrics",
           [](const Engine& e) {
             std::array<uint64_t, Metrics::kTransports> links{};
             Metrics::Snapshot s;
             {
               py::gil_scoped_release nogil;
               s = e.metrics(&links);
             }
             py::list ops, transports, statuses, bounds;
             for (int o = 0; o < Metrics::kOps; ++o) ops.append(Metrics::op_name(o));
             for (int t = 0; t < Metrics::kTransports; ++t) transports.append(Metrics::transport_name(t));
             for (int st = 0; st < Metrics::kStatuses; ++st) statuses.append(Metrics::status_name(st));
             for (double b : Metrics::kBuckets) bounds.append(b);
             py::list transfers, bytes, descs, buckets, sums;
             for (int o = 0; o < Metrics::kOps; ++o) {
               py::list per_t, b_t, d_t, bk;
               for (int t = 0; t < Metrics::kTransports; ++t) {
                 py::list per_s;
                 for (int st = 0; st < Metrics::kStatuses; ++st) per_s.append(s.transfers[o][t][st]);
                 per_t.append(per_s);
                 b_t.append(s.bytes[o][t]);
                 d_t.append(s.descriptors[o][t]);
               }
               for (uint64_t v : s.seconds_buckets[o]) bk.append(v);
               transfers.append(per_t);
               bytes.append(b_t);
               descs.append(d_t);
               buckets.append(bk);
               sums.append(s.seconds_sum[o]);
             }
             py::dict closed, refused, out;
             for (int c = 0; c < int(Metrics::Cause::kCount); ++c) closed[Metrics::cause_name(c)] = s.links_closed[c];
             for (int r = 0; r < int(Metrics::Refused::kCount); ++r) refused[Metrics::refused_name(r)] = s.refused[r];
             py::list open_links;
             for (uint64_t n : links) open_links.append(n);
             out["ops"] = ops;
             out["transports"] = transports;
             out["statuses"] = statuses;
             out["bucket_bounds"] = bounds;
             out["transfers"] = transfers;
             out["bytes"] = bytes;
             out["descriptors"] = descs;
             out["seconds_buckets"] = buckets;
             out["seconds_sum"] = sums;
             out["links"] = open_links;
             out["links_closed"] = closed;
             out["notifies_sent"] = s.notifies_sent;
             out["notifies_received"] = s.notifies_received;
             out["refused"] = refused;
             return out;
           })
      .def_property_readonly("local_engine", &Engine::local_engine)
      .def_property_readonly("data_transport", &Engine::data_transport)
      .def("last_error", &Engine::last_error);
  m.def("descs_from_list", &descs_from_list, py::arg("op_descs"),
        "An (N, 3) uint64 array from a list or tuple of TransferOpDesc whose fields are valid Python ints, "
        "else None (the Python path then decides).");
}
