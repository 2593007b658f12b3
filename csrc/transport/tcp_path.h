// TCP fallback data path, for peers on different hosts without RDMA. Two TCP connections per link,
// one per direction, so a request and the reply to it never wait on each other:
//   - on the "request" socket this side sends requests and reads replies (in the requesting thread);
//   - on the "serve" socket a thread of this side reads the peer's requests, checks every range
//     against our registrations (the same checks as the initiator's), applies writes straight into
//     registered memory and answers reads from it. Once a request's header arrived, a peer that
//     sends nothing of it for kFrameStall is cut (the data connection closes). So is a peer that
//     takes or sends nothing of our asynchronous request (no deadline of its own) for as long.
// Wire, little endian: request = u32 magic 'HXTD', u32 op (1 write, 2 read), u64 seq, u32 ndesc,
// u32 0, ndesc * {u64 addr, u64 len}, then (write) the payloads back to back. Reply = u32 magic,
// u32 status (hixl code), u64 seq, then (read, status 0) the payloads.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "transport/data_path.h"
#include "transport/oob.h"
#include "transport/served_memory.h"

namespace hixl::transport {

class TcpPath final : public QueuedPath {
 public:
  // memory: checks and holds what each of the peer's requests touches (served_memory.h); a
  // deregistration cuts a request that touches its region, so after deregister_mem() returns no
  // byte of that request lands in (or is read from) that memory. It outlives the path.
  TcpPath(std::string peer, ServedMemory* memory);
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
  bool serve_one(const uint8_t* header, ServedMemory::Use* use, std::vector<uint8_t>* descs,
                 std::vector<Range>* ranges, std::vector<iovec>* iov, std::string* why);
  std::string peer_;
  ServedMemory* memory_;
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
