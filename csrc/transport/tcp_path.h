// TCP fallback data path, for peers on different hosts without RDMA. Two TCP connections per link,
// one per direction, so a request and the reply to it never wait on each other:
//   - on the "request" socket this side sends requests and reads replies (in the requesting thread);
//   - on the "serve" socket a thread of this side reads the peer's requests, checks every range
//     against our registrations (the same checks as the initiator's), applies writes straight into
//     registered memory and answers reads from it.
// Wire, little endian: request = u32 magic 'HXTD', u32 op (1 write, 2 read), u64 seq, u32 ndesc,
// u32 0, ndesc * {u64 addr, u64 len}, then (write) the payloads back to back. Reply = u32 magic,
// u32 status (hixl code), u64 seq, then (read, status 0) the payloads.
#pragma once

#include <atomic>
#include <functional>
#include <shared_mutex>
#include <string>
#include <thread>

#include "transport/data_path.h"
#include "transport/oob.h"

namespace hixl::transport {

class TcpPath final : public QueuedPath {
 public:
  // Is [addr, addr+len) inside one of our registered regions (write: the peer writes into it)?
  using Validator = std::function<bool(uint64_t addr, uint64_t len, bool write)>;
  // registry_mu: held shared while a peer's request touches our memory; deregistration takes it
  // exclusively, so after deregister_mem() returns no TCP write lands in that memory.
  TcpPath(std::string peer, Validator validate, std::shared_mutex* registry_mu);
  ~TcpPath() override;
  const char* name() const override { return "tcp"; }
  // serve = the socket on which the peer sends us requests. Both must be attached before use.
  void attach(bool serve, oob::Socket s);
  bool wait_attached(Clock::time_point deadline);
  void close() override;  // also joins the thread serving the peer: nothing of theirs lands after it

 protected:
  Result execute(Op op, const std::vector<Desc>& descs, Clock::time_point deadline) override;
  void interrupt() override;

 private:
  void serve_loop();
  std::string peer_;
  Validator validate_;
  std::shared_mutex* registry_mu_;
  std::mutex attach_mu_;
  std::condition_variable attach_cv_;
  oob::Socket req_, srv_;
  std::atomic<bool> stopping_{false};
  bool broken_ = false;  // a request stopped midway: the stream is out of step, the path is done
  std::thread server_;
  std::mutex server_join_mu_;
  uint64_t next_seq_ = 1;
};

}  // namespace hixl::transport
