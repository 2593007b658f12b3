// pybind11 module hixl._core: thin bindings; the Python package (python/hixl) is the public face.
// Every call that can block releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "transport/oob.h"
#include "transport/rdma_endpoint.h"
#include "verbs/device.h"
#include "verbs/error.h"
#include "wire/wire.h"

#if __has_include("bindings/acl_bindings.h")
#include "bindings/acl_bindings.h"
#define HIXL_HAVE_ACL_BINDINGS 1
#endif

namespace py = pybind11;
using namespace hixl;
using std::chrono::milliseconds;
using release = py::call_guard<py::gil_scoped_release>;

void hixl_bind_engine(py::module_& m);
void hixl_bind_fast_calls(py::module_& m);

namespace {

py::dict hello_to_dict(const wire::Hello& h) {
  py::dict d;
  d["qpn"] = h.qpn;
  d["psn"] = h.psn;
  d["lid"] = h.lid;
  d["gid"] = verbs::gid_to_string(h.gid);
  d["mtu"] = h.mtu;
  d["port"] = h.port;
  py::list regions;
  for (const auto& r : h.regions) {
    py::dict rd;
    rd["addr"] = r.addr;
    rd["len"] = r.len;
    rd["rkey"] = r.rkey;
    rd["access"] = r.access;
    regions.append(rd);
  }
  d["regions"] = regions;
  return d;
}

template <class T>
T get_int(const py::dict& d, const char* key, T dflt, bool required) {
  if (!d.contains(key)) {
    if (required) throw Error(std::string("connection info: missing key '") + key + "'");
    return dflt;
  }
  py::object o = d[key];
  if (!py::isinstance<py::int_>(o)) throw Error(std::string("connection info: '") + key + "' must be an int");
  long long v = o.cast<long long>();
  if (v < 0 || (unsigned long long)v > (unsigned long long)std::numeric_limits<T>::max())
    throw Error(std::string("connection info: '") + key + "'=" + std::to_string(v) + " out of range");
  return T(v);
}

wire::Hello dict_to_hello(const py::dict& d) {
  wire::Hello h;
  h.qpn = get_int<uint32_t>(d, "qpn", 0, true);
  h.psn = get_int<uint32_t>(d, "psn", 0, true);
  h.lid = get_int<uint16_t>(d, "lid", 0, false);
  h.mtu = get_int<uint16_t>(d, "mtu", 1024, false);
  h.port = get_int<uint8_t>(d, "port", 1, false);
  if (!d.contains("gid")) throw Error("connection info: missing key 'gid'");
  py::object g = d["gid"];
  if (py::isinstance<py::str>(g)) {
    h.gid = verbs::gid_from_string(g.cast<std::string>());
  } else if (py::isinstance<py::bytes>(g)) {
    std::string b = g.cast<std::string>();
    if (b.size() != 16) throw Error("connection info: 'gid' bytes must be 16 long, got " + std::to_string(b.size()));
    std::memcpy(h.gid.data(), b.data(), 16);
  } else {
    throw Error("connection info: 'gid' must be a str (IPv6 notation) or 16 bytes");
  }
  if (d.contains("regions")) {
    for (py::handle item : d["regions"].cast<py::list>()) {
      py::dict rd = item.cast<py::dict>();
      wire::Region r;
      r.addr = get_int<uint64_t>(rd, "addr", 0, true);
      r.len = get_int<uint64_t>(rd, "len", 0, true);
      r.rkey = get_int<uint32_t>(rd, "rkey", 0, true);
      r.access = get_int<uint32_t>(rd, "access", wire::kRemoteRead | wire::kRemoteWrite, false);
      h.regions.push_back(r);
    }
  }
  return h;
}

std::vector<rdma::Desc> to_descs(const py::sequence& seq) {
  std::vector<rdma::Desc> out;
  out.reserve(seq.size());
  size_t i = 0;
  for (py::handle item : seq) {
    py::tuple t = py::reinterpret_borrow<py::object>(item).cast<py::tuple>();
    if (t.size() != 4) throw Error("descriptor " + std::to_string(i) + ": want (local_addr, remote_addr, length, rkey)");
    auto u64 = [&](int k, const char* name) {
      py::object o = t[k];
      if (!py::isinstance<py::int_>(o)) throw Error("descriptor " + std::to_string(i) + ": " + name + " must be an int");
      if (o.cast<py::int_>() < py::int_(0)) throw Error("descriptor " + std::to_string(i) + ": " + name + " must be >= 0");
      return o.cast<uint64_t>();
    };
    rdma::Desc d{u64(0, "local_addr"), u64(1, "remote_addr"), u64(2, "length"), 0};
    uint64_t rkey = u64(3, "rkey");
    if (rkey > 0xffffffffULL) throw Error("descriptor " + std::to_string(i) + ": rkey beyond 32 bits");
    d.rkey = uint32_t(rkey);
    out.push_back(d);
    ++i;
  }
  return out;
}

py::tuple result_tuple(const rdma::RequestResult& r) { return py::make_tuple(int(r.status), r.error); }

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "hixl C++ core (libibverbs). Private: use the hixl package.";
  // Leaked on purpose: the exception types live as long as the interpreter.
  static auto* exc = new py::exception<Error>(m, "HixlError", PyExc_RuntimeError);
  static auto* nexc = new py::exception<NotSupported>(m, "NotSupportedError", exc->ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const NotSupported& e) {
      py::set_error(*nexc, e.what());
    } catch (const Error& e) {
      py::set_error(*exc, e.what());
    }
  });

  m.def("list_devices", [] {
    py::list out;
    for (const auto& d : verbs::list_devices()) {
      py::dict e;
      e["name"] = d.name;
      e["active_ports"] = d.active_ports;
      out.append(e);
    }
    return out;
  });
  m.def("split_host_port", &oob::split_host_port, py::arg("address"));

  // Wire format (exposed for tests and tools).
  m.def("wire_encode_hello", [](const py::dict& d) {
    auto v = wire::encode_hello(dict_to_hello(d));
    return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
  });
  m.def("wire_parse_hello_frame", [](const py::bytes& b) {
    std::string s = b;
    return hello_to_dict(wire::parse_hello_frame(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
  });
  m.attr("WIRE_VERSION") = wire::kVersion;
  m.attr("WIRE_MAX_PAYLOAD") = wire::kMaxPayload;
  // What this module's C++ core was built from (CMakeLists.txt); hixl_tools._perf, which is handed this
  // module's objects, checks that it was built from the same.
  m.attr("CORE_BUILD_ID") = HIXL_CORE_BUILD_ID;

  py::class_<rdma::Endpoint, std::shared_ptr<rdma::Endpoint>>(m, "Endpoint")
      .def(py::init([](const std::string& device, int port, int gid_index, uint32_t sq_depth, uint32_t rq_depth,
                       uint32_t max_inline, uint64_t slice_bytes, uint32_t max_chain, uint32_t busy_poll_us,
                       int traffic_class, int service_level, int timeout, int retry_cnt, const std::string& auth_token,
                       uint64_t window_bytes) {
             if (port < 1 || port > 255) throw Error("Endpoint: port=" + std::to_string(port) + " must be 1..255");
             if (traffic_class < 0 || traffic_class > 255) throw Error("Endpoint: traffic_class must be 0..255");
             if (service_level < 0 || service_level > 15) throw Error("Endpoint: service_level must be 0..15");
             if (timeout < 0 || timeout > 31) throw Error("Endpoint: timeout must be 0..31");
             if (retry_cnt < 0 || retry_cnt > 7) throw Error("Endpoint: retry_cnt must be 0..7");
             rdma::EndpointOptions o;
             o.device = device;
             o.port = uint8_t(port);
             o.gid_index = gid_index;
             o.sq_depth = sq_depth;
             o.rq_depth = rq_depth;
             o.max_inline = max_inline;
             o.slice_bytes = slice_bytes;
             o.max_chain = max_chain;
             o.busy_poll_us = busy_poll_us;
             o.traffic_class = uint8_t(traffic_class);
             o.service_level = uint8_t(service_level);
             o.timeout = uint8_t(timeout);
             o.retry_cnt = uint8_t(retry_cnt);
             o.auth_token = auth_token;
             o.window_bytes = window_bytes;
             py::gil_scoped_release nogil;
             return std::make_shared<rdma::Endpoint>(o);
           }),
           py::arg("device") = "", py::arg("port") = 1, py::arg("gid_index") = -1, py::arg("sq_depth") = 256,
           py::arg("rq_depth") = 256, py::arg("max_inline") = 64, py::arg("slice_bytes") = 4u << 20,
           py::arg("max_chain") = 64, py::arg("busy_poll_us") = 20, py::arg("traffic_class") = 0,
           py::arg("service_level") = 0, py::arg("timeout") = 14, py::arg("retry_cnt") = 7,
           py::arg("auth_token") = "", py::arg("window_bytes") = 0)
      .def("info", [](const rdma::Endpoint& ep) {
        rdma::LocalInfo li = ep.local_info();
        py::dict d = hello_to_dict(li.hello);
        d["device"] = li.device;
        d["gid_index"] = li.gid_index;
        d["link_layer"] = li.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand";
        return d;
      })
      .def("connect", [](rdma::Endpoint& ep, const py::dict& info) {
        wire::Hello h = dict_to_hello(info);
        py::gil_scoped_release nogil;
        ep.connect(h);
      })
      .def("listen", &rdma::Endpoint::listen, py::arg("host"), py::arg("port") = 0, release())
      .def("accept", [](rdma::Endpoint& ep, int64_t timeout_ms) {
        wire::Hello h;
        { py::gil_scoped_release nogil; h = ep.accept(milliseconds(timeout_ms)); }
        return hello_to_dict(h);
      }, py::arg("timeout_ms") = 10000)
      .def("connect_tcp", [](rdma::Endpoint& ep, const std::string& host, uint16_t port, int64_t timeout_ms) {
        wire::Hello h;
        { py::gil_scoped_release nogil; h = ep.connect_tcp(host, port, milliseconds(timeout_ms)); }
        return hello_to_dict(h);
      }, py::arg("host"), py::arg("port"), py::arg("timeout_ms") = 10000)
      .def("register_addr", [](rdma::Endpoint& ep, uint64_t addr, uint64_t length, int access) {
        std::pair<uint64_t, std::shared_ptr<verbs::MemoryRegion>> r;
        { py::gil_scoped_release nogil; r = ep.register_memory(reinterpret_cast<void*>(addr), length, access); }
        const auto& mr = r.second;
        return py::make_tuple(r.first, mr->addr(), mr->length(), mr->lkey(), mr->rkey());
      }, py::arg("addr"), py::arg("length"), py::arg("access"))
      .def("register_buffer", [](rdma::Endpoint& ep, const py::buffer& buf, int access) {
        py::buffer_info bi = buf.request(/*writable=*/(access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)) != 0);
        py::ssize_t expect = bi.itemsize;
        for (py::ssize_t i = bi.ndim - 1; i >= 0; --i) {
          if (bi.strides[size_t(i)] != expect) throw Error("register_buffer: buffer must be C-contiguous");
          expect *= bi.shape[size_t(i)];
        }
        uint64_t nbytes = uint64_t(bi.size) * uint64_t(bi.itemsize);
        void* ptr = bi.ptr;
        std::pair<uint64_t, std::shared_ptr<verbs::MemoryRegion>> r;
        { py::gil_scoped_release nogil; r = ep.register_memory(ptr, nbytes, access); }
        const auto& mr = r.second;
        return py::make_tuple(r.first, mr->addr(), mr->length(), mr->lkey(), mr->rkey());
      }, py::arg("buffer"), py::arg("access"))
      .def("deregister", &rdma::Endpoint::deregister_memory, py::arg("handle"), release())
      .def("submit", [](rdma::Endpoint& ep, int op, const py::sequence& descs, uint32_t imm, int64_t timeout_ms) {
        if (op < 0 || op > 2) throw Error("submit: op=" + std::to_string(op) + " must be 0 (READ), 1 (WRITE) or 2 (WRITE_WITH_IMM)");
        auto d = to_descs(descs);
        py::gil_scoped_release nogil;
        return ep.submit(rdma::Op(op), d, imm, milliseconds(timeout_ms));
      }, py::arg("op"), py::arg("descs"), py::arg("imm") = 0, py::arg("timeout_ms") = -1)
      .def("status", [](rdma::Endpoint& ep, uint64_t req) {
        rdma::RequestResult r;
        { py::gil_scoped_release nogil; r = ep.status(req); }
        return result_tuple(r);
      }, py::arg("req"))
      .def("wait", [](rdma::Endpoint& ep, uint64_t req, int64_t timeout_ms) {
        rdma::RequestResult r;
        { py::gil_scoped_release nogil; r = ep.wait(req, milliseconds(timeout_ms)); }
        return result_tuple(r);
      }, py::arg("req"), py::arg("timeout_ms"))
      .def("progress", &rdma::Endpoint::progress, py::arg("budget") = 64, release())
      .def("poll_imm", &rdma::Endpoint::poll_imm, py::arg("max") = 64, release())
      .def("wait_imm", [](rdma::Endpoint& ep, int64_t timeout_ms) -> py::object {
        std::optional<uint32_t> v;
        { py::gil_scoped_release nogil; v = ep.wait_imm(milliseconds(timeout_ms)); }
        if (!v) return py::none();
        return py::int_(*v);
      }, py::arg("timeout_ms"))
      .def("stats", [](const rdma::Endpoint& ep) {
        rdma::Stats s = ep.stats();
        py::dict d;
        d["posted_wrs"] = s.posted_wrs;
        d["doorbells"] = s.doorbells;
        d["signaled"] = s.signaled;
        d["backpressure_waits"] = s.backpressure_waits;
        d["imm_received"] = s.imm_received;
        return d;
      })
      .def("close", &rdma::Endpoint::close, release())
      .def_property_readonly("connected", &rdma::Endpoint::connected)
      .def_property_readonly("path_mtu", &rdma::Endpoint::path_mtu)
      .def_property_readonly("dead", &rdma::Endpoint::dead)
      .def_property_readonly("dead_reason", &rdma::Endpoint::dead_reason)
      .def_property_readonly("sq_depth", &rdma::Endpoint::sq_depth)
      .def_property_readonly("outstanding", &rdma::Endpoint::outstanding)
      .def_property_readonly("max_inline", [](const rdma::Endpoint& ep) { return ep.options().max_inline; })
      .def_property_readonly("slice_bytes", [](const rdma::Endpoint& ep) { return ep.options().slice_bytes; })
      .def_property_readonly("window_bytes", [](const rdma::Endpoint& ep) { return ep.options().window_bytes; });

  m.attr("ACCESS_LOCAL_WRITE") = int(IBV_ACCESS_LOCAL_WRITE);
  m.attr("ACCESS_REMOTE_WRITE") = int(IBV_ACCESS_REMOTE_WRITE);
  m.attr("ACCESS_REMOTE_READ") = int(IBV_ACCESS_REMOTE_READ);

  hixl_bind_engine(m);
  hixl_bind_fast_calls(m);
#ifdef HIXL_HAVE_ACL_BINDINGS
  py::module_ acl = m.def_submodule("acl", "aclrtMalloc-style device memory shim");
  hixl_bind_acl(acl);
#endif
}
