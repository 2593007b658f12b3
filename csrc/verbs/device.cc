#include "verbs/device.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::verbs {
namespace {

// Fork-safe registration: ibv_fork_init() must run before any other verbs call. Kernels >= 5.13
// keep pinned pages with the parent by themselves (rdma-core then reports IBV_FORK_UNNEEDED);
// older ones need the MADV_DONTFORK that ibv_fork_init arranges for every later registration.
// Only those: rdma-core's ibv_fork_init() does not check, and its MADV_DONTFORK covers whole pages,
// so a registered buffer that shares pages with the malloc heap leaves the child a heap with holes
// (a forked child crashed in its first free() next to a registered numpy array).
void fork_init_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (ibv_is_fork_initialized() == IBV_FORK_UNNEEDED) return;
    int rc = ibv_fork_init();
    if (rc != 0)
      log::warn(std::string("ibv_fork_init() failed: ") + std::strerror(rc) +
                ": memory registered before a fork() may be corrupted in the parent afterwards");
  });
}

struct DeviceList {
  int n = 0;
  ibv_device** list = nullptr;
  DeviceList() {
    fork_init_once();
    list = ibv_get_device_list(&n);
  }
  ~DeviceList() { if (list) ibv_free_device_list(list); }
};

int count_active_ports(ibv_context* ctx) {
  ibv_device_attr attr{};
  if (ibv_query_device(ctx, &attr) != 0) return 0;
  int active = 0;
  for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
    ibv_port_attr pa{};
    if (ibv_query_port(ctx, p, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) ++active;
  }
  return active;
}

// RoCE GID type from sysfs: "RoCE v2" / "IB/RoCE v1"; empty when unknown (IB, old kernels).
std::string gid_type(const std::string& dev, uint8_t port, int index) {
  std::ifstream f("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) +
                  "/gid_attrs/types/" + std::to_string(index));
  std::string s;
  std::getline(f, s);
  return s;
}

bool is_ipv4_mapped(const Gid& g) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(g.data(), prefix, 12) == 0;
}

bool is_zero(const Gid& g) {
  for (auto b : g) if (b) return false;
  return true;
}

}  // namespace

std::vector<DeviceSummary> list_devices() {
  std::vector<DeviceSummary> out;
  DeviceList dl;
  for (int i = 0; dl.list && i < dl.n; ++i) {
    DeviceSummary s;
    s.name = ibv_get_device_name(dl.list[i]);
    if (ibv_context* ctx = ibv_open_device(dl.list[i])) {
      s.active_ports = count_active_ports(ctx);
      ibv_close_device(ctx);
    }
    out.push_back(s);
  }
  return out;
}

std::string gid_to_string(const Gid& gid) {
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, gid.data(), buf, sizeof(buf));
  return buf;
}

Gid gid_from_string(const std::string& s) {
  Gid g{};
  if (inet_pton(AF_INET6, s.c_str(), g.data()) != 1)
    throw Error("gid_from_string(\"" + s + "\"): not an IPv6-format GID");
  return g;
}

int mtu_to_bytes(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
  }
  return 0;
}

ibv_mtu mtu_from_bytes(int bytes) {
  switch (bytes) {
    case 256: return IBV_MTU_256;
    case 512: return IBV_MTU_512;
    case 1024: return IBV_MTU_1024;
    case 2048: return IBV_MTU_2048;
    case 4096: return IBV_MTU_4096;
  }
  throw Error("mtu_from_bytes(" + std::to_string(bytes) + "): MTU must be 256, 512, 1024, 2048 or 4096");
}

Context::Context(ibv_context* ctx, std::string name) : ctx_(ctx), name_(std::move(name)) {
  int rc = ibv_query_device(ctx_, &attr_);
  if (rc != 0) {
    ibv_close_device(ctx_);
    throw_errno(CallDesc("ibv_query_device").arg("device", name_).str(), rc);
  }
}

Context::~Context() {
  events_.reset();  // its reader reads ctx_'s async fd
  if (int rc = ibv_close_device(ctx_))
    log::warn(CallDesc("ibv_close_device").arg("device", name_).str() + " failed: " + errno_str(rc));
}

AsyncEvents& Context::async_events() {
  std::lock_guard<std::mutex> g(events_mu_);
  if (!events_) events_ = std::make_unique<AsyncEvents>(ctx_, name_);
  return *events_;
}

std::shared_ptr<Context> Context::open(const std::string& requested) {
  std::string want = requested;
  if (want.empty()) if (const char* e = std::getenv("HIXL_DEVICE")) want = e;
  DeviceList dl;
  if (!dl.list || dl.n == 0)
    throw Error("ibv_get_device_list: no RDMA devices found (is an RDMA driver such as rdma_rxe loaded?)",
                ENODEV);
  std::string seen;
  for (int i = 0; i < dl.n; ++i) {
    std::string name = ibv_get_device_name(dl.list[i]);
    seen += (seen.empty() ? "" : ", ") + name;
    if (!want.empty() && name != want) continue;
    ibv_context* ctx = HIXL_CHECK_PTR(ibv_open_device(dl.list[i]),
                                      CallDesc("ibv_open_device").arg("device", name).str());
    if (want.empty() && count_active_ports(ctx) == 0) {
      ibv_close_device(ctx);
      continue;
    }
    return std::shared_ptr<Context>(new Context(ctx, name));
  }
  if (!want.empty()) throw Error("RDMA device \"" + want + "\" not found (devices: " + seen + ")", ENODEV);
  throw Error("no RDMA device with an ACTIVE port (devices: " + seen + ")", ENODEV);
}

PortInfo Context::query_port(uint8_t port) const {
  ibv_port_attr pa{};
  HIXL_CHECK_RET(ibv_query_port(ctx_, port, &pa),
                 CallDesc("ibv_query_port").arg("device", name_).arg("port", int(port)).str());
  PortInfo p;
  p.port_num = port;
  p.state = pa.state;
  p.active_mtu = pa.active_mtu;
  p.lid = pa.lid;
  p.link_layer = pa.link_layer;
  p.max_msg_sz = pa.max_msg_sz;
  p.gid_tbl_len = pa.gid_tbl_len;
  return p;
}

Gid Context::query_gid(uint8_t port, int index) const {
  ibv_gid gid{};
  HIXL_CHECK_ERRNO(ibv_query_gid(ctx_, port, index, &gid), CallDesc("ibv_query_gid")
                       .arg("device", name_).arg("port", int(port)).arg("index", index).str());
  Gid g;
  std::memcpy(g.data(), gid.raw, 16);
  return g;
}

int Context::select_gid_index(uint8_t port, int requested) const {
  if (requested < 0) {
    if (const char* e = std::getenv("HIXL_GID_INDEX")) {
      char* end = nullptr;
      long v = std::strtol(e, &end, 10);
      if (!*e || *end || v < 0 || v > 255) throw Error(std::string("HIXL_GID_INDEX=\"") + e + "\": not a GID index");
      requested = int(v);
    }
  }
  PortInfo pi = query_port(port);
  if (requested >= 0) {
    if (requested >= pi.gid_tbl_len || requested > 255)
      throw Error(CallDesc("select_gid_index").arg("device", name_).arg("port", int(port))
                      .arg("index", requested).str() + ": index beyond gid_tbl_len=" +
                  std::to_string(pi.gid_tbl_len) + " (or the 8-bit sgid_index)");
    Gid g = query_gid(port, requested);
    if (is_zero(g) && pi.link_layer == IBV_LINK_LAYER_ETHERNET)
      throw Error(CallDesc("select_gid_index").arg("device", name_).arg("port", int(port)).arg("index", requested)
                      .str() + ": that GID entry is empty (no address configured on the netdev for it)");
    return requested;
  }
  if (pi.link_layer != IBV_LINK_LAYER_ETHERNET) return 0;  // InfiniBand: index 0 (LID routed)
  int v2 = -1, any = -1;
  for (int i = 0; i < pi.gid_tbl_len; ++i) {
    Gid g;
    try { g = query_gid(port, i); } catch (const Error&) { continue; }
    if (is_zero(g)) continue;
    std::string type = gid_type(name_, port, i);
    bool rocev2 = type.find("v2") != std::string::npos;
    if (rocev2 && is_ipv4_mapped(g)) return i;
    if (rocev2 && v2 < 0) v2 = i;
    if (any < 0) any = i;
  }
  if (v2 >= 0) return v2;
  if (any >= 0) return any;
  throw Error(CallDesc("select_gid_index").arg("device", name_).arg("port", int(port)).str() +
              ": no valid GID in the table (is the netdev up and addressed?)");
}

ProtectionDomain::ProtectionDomain(std::shared_ptr<Context> ctx)
    : ctx_(std::move(ctx)),
      pd_(HIXL_CHECK_PTR(ibv_alloc_pd(ctx_->get()), CallDesc("ibv_alloc_pd").arg("device", ctx_->name()).str())) {}

ProtectionDomain::~ProtectionDomain() {
  if (int rc = ibv_dealloc_pd(pd_))
    log::warn(CallDesc("ibv_dealloc_pd").arg("device", ctx_->name()).str() + " failed: " + errno_str(rc));
}

std::shared_ptr<ProtectionDomain> ProtectionDomain::shared_for(const std::string& device_name) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<ProtectionDomain>> cache;
  static pid_t cache_pid = 0;
  std::lock_guard<std::mutex> g(mu);
  // A forked child must not use the parent's context or PD (their queues and doorbells belong to the
  // parent; the parent's engines are kept, never used, in the child): it opens its own.
  if (cache_pid != ::getpid()) {
    cache.clear();
    cache_pid = ::getpid();
  }
  std::string key = device_name;
  if (key.empty()) if (const char* e = std::getenv("HIXL_DEVICE")) key = e;
  if (auto it = cache.find(key); it != cache.end())
    if (auto pd = it->second.lock()) return pd;
  auto pd = std::make_shared<ProtectionDomain>(Context::open(key));
  cache[key] = pd;
  cache[pd->context()->name()] = pd;
  return pd;
}

}  // namespace hixl::verbs
