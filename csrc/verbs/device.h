// Device context and protection domain owners (RAII, move-only, shared by the objects built on them).
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "verbs/async_events.h"

namespace hixl::verbs {

struct DeviceSummary {
  std::string name;
  int active_ports = 0;
};

// Lists the RDMA devices the kernel exposes (empty when none; never throws for "no devices").
std::vector<DeviceSummary> list_devices();

struct PortInfo {
  uint8_t port_num = 1;
  ibv_port_state state = IBV_PORT_NOP;
  ibv_mtu active_mtu = IBV_MTU_1024;
  uint16_t lid = 0;
  uint8_t link_layer = IBV_LINK_LAYER_UNSPECIFIED;
  uint32_t max_msg_sz = 0;
  int gid_tbl_len = 0;
};

using Gid = std::array<uint8_t, 16>;

std::string gid_to_string(const Gid& gid);   // "::ffff:192.168.77.1" / "fe80::..."
Gid gid_from_string(const std::string& s);   // throws hixl::Error on malformed input
int mtu_to_bytes(ibv_mtu mtu);
ibv_mtu mtu_from_bytes(int bytes);           // throws on anything but 256/512/1024/2048/4096

// Owns an ibv_context (ibv_close_device on destruction).
class Context {
 public:
  // name empty -> $HIXL_DEVICE -> the first device with an ACTIVE port.
  static std::shared_ptr<Context> open(const std::string& name = "");
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  ibv_context* get() const { return ctx_; }
  const std::string& name() const { return name_; }
  const ibv_device_attr& attr() const { return attr_; }
  // Soft-RoCE (the kernel's rdma_rxe, vendor id 0xffffff): RoCE in software over an ordinary, lossy
  // Ethernet NIC, with go-back-N retransmission driven by a coarse timer.
  bool soft_roce() const { return attr_.vendor_id == kSoftRoceVendorId; }
  static constexpr uint32_t kSoftRoceVendorId = 0xffffff;  // RXE_VENDOR_ID (kernel rxe_param.h)
  PortInfo query_port(uint8_t port) const;
  // Explicit index, else $HIXL_GID_INDEX, else a RoCEv2 IPv4-mapped GID, else RoCEv2, else index 0.
  int select_gid_index(uint8_t port, int requested = -1) const;
  Gid query_gid(uint8_t port, int index) const;
  // The device's async events (started on first use; throws hixl::Error if the reader cannot start).
  AsyncEvents& async_events();

 private:
  Context(ibv_context* ctx, std::string name);
  ibv_context* ctx_;
  std::string name_;
  ibv_device_attr attr_{};
  std::mutex events_mu_;
  std::unique_ptr<AsyncEvents> events_;  // stopped before the device is closed
};

// Owns an ibv_pd; keeps its Context alive.
class ProtectionDomain {
 public:
  explicit ProtectionDomain(std::shared_ptr<Context> ctx);
  ~ProtectionDomain();
  ProtectionDomain(const ProtectionDomain&) = delete;
  ProtectionDomain& operator=(const ProtectionDomain&) = delete;
  ibv_pd* get() const { return pd_; }
  const std::shared_ptr<Context>& context() const { return ctx_; }

  // One PD per device per process, reference counted (as NCCL does): endpoints on the same device
  // share it so a region registered through one is usable through another.
  static std::shared_ptr<ProtectionDomain> shared_for(const std::string& device_name);

 private:
  std::shared_ptr<Context> ctx_;
  ibv_pd* pd_;
};

}  // namespace hixl::verbs
