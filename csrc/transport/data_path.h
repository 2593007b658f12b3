// One link's data path, whatever carries it: RDMA (RC queue pairs), same-host (cross-memory
// attach / mapped memfd), or TCP (a progress thread on the target applies the bytes).
// The engine validates every range before it calls submit(); a path only moves bytes.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/rdma_endpoint.h"
#include "util/id_slab.h"

namespace hixl::transport {

using Desc = rdma::Desc;  // local_addr, remote_addr, length (+ lkey/rkey, used by RDMA only)
using Status = rdma::Status;
using Result = rdma::RequestResult;
enum class Op : int { kRead = 0, kWrite = 1 };
using Clock = std::chrono::steady_clock;
using Flag = std::optional<uint32_t>;
// Where a path delivers completion flags that arrive with the data (RDMA immediates).
using FlagSink = std::function<void(uint32_t)>;

class DataPath {
 public:
  virtual ~DataPath() = default;
  virtual const char* name() const = 0;
  // Starts a request. timeout < 0: asynchronous, no deadline; otherwise the request must end by then
  // (the caller waits for it right away). Throws hixl::Error when the path is unusable.
  // flag (writes only): a completion flag the peer receives after every byte of this request, and of
  // every request submitted before it on this path, is in its memory (RDMA: WRITE_WITH_IMM on the
  // last work request; shm/tcp: a Flag control frame once the bytes landed).
  virtual uint64_t submit(Op op, const std::vector<Desc>& descs, std::chrono::milliseconds timeout,
                          Flag flag) = 0;
  // Non-blocking. A terminal status is returned once, then the request is forgotten; unknown -> FAILED.
  virtual Result status(uint64_t req) = 0;
  // Up to timeout; WAITING when it passed.
  virtual Result wait(uint64_t req, std::chrono::milliseconds timeout) = 0;
  // Up to timeout (< 0: none) for a terminal status, which is left for status(); false on timeout.
  virtual bool wait_done(uint64_t req, std::chrono::milliseconds timeout) = 0;
  // After close() returns no byte of ours reaches the peer's memory any more, and nothing the peer
  // sends is applied to ours. Requests in flight end FAILED. Idempotent.
  virtual void close() = 0;
};

// RDMA: an adapter over one or more rdma::Endpoint (RC queue pairs to the same peer; each already
// has requests, deadlines and close()). With one queue pair a request goes to it as it is. With K > 1
// (a striped link, HixlRdmaQpsPerLink) a request's bytes are split into up to K contiguous stripes of
// at least kMinStripe bytes, one per queue pair (the first one rotating between requests), so that a
// queue pair waiting out a retransmission does not stall the link, and the request ends when every
// stripe did (FAILED if any failed, else TIMEOUT if any timed out). A flag goes on every queue pair
// (a zero-length WRITE_WITH_IMM where a queue pair carried no stripe), posted in the same order on
// all of them, and the receiving side hands it on once it arrived on all of them: each queue pair's
// immediate follows its own earlier writes, so all of them together follow every byte of the request
// and of those submitted before it.
// One thread per link waits on its queue pairs' receive completion channels (one poll()) for the
// peer's immediates (its completion flags) and hands them to `sink`; close() joins it. With a send
// window it also waits on the send completion channel of each queue pair that has work waiting for
// the window, and posts it as completions free the window (rdma::Endpoint::send_event()), so that an
// asynchronous request moves on while nobody waits for it.
class RdmaPath final : public DataPath {
 public:
  static constexpr size_t kMaxQps = 16;
  static constexpr uint64_t kMinStripe = 64 * 1024;
  RdmaPath(std::vector<std::shared_ptr<rdma::Endpoint>> eps, FlagSink sink);
  ~RdmaPath() override;
  const char* name() const override { return "rdma"; }
  uint64_t submit(Op op, const std::vector<Desc>& d, std::chrono::milliseconds timeout, Flag flag) override;
  Result status(uint64_t req) override;
  Result wait(uint64_t req, std::chrono::milliseconds timeout) override;
  bool wait_done(uint64_t req, std::chrono::milliseconds timeout) override;
  void close() override;

 private:
  struct Striped {  // a request of a striped link: its stripes' endpoint requests
    uint8_t n = 0;
    std::array<uint8_t, kMaxQps> qp{};
    std::array<uint64_t, kMaxQps> sub{};
    std::array<bool, kMaxQps> over{};  // its terminal status was collected (below, or failed to post)
    Status status = Status::kCompleted;  // the worst terminal status so far (kFailed > kTimeout > kCompleted)
    std::string error;
    void on_erase() { error.clear(); }
  };
  void flags_loop();
  void on_imm(size_t qp, uint32_t v);
  void wake_if_pending(const rdma::Endpoint& ep);
  void note_locked(Striped& s, size_t k, Result r);

  std::vector<std::shared_ptr<rdma::Endpoint>> eps_;
  FlagSink sink_;
  std::atomic<bool> stop_{false};
  std::thread flags_;
  std::mutex join_mu_;
  // With a send window (rdma::EndpointOptions::window_bytes) the flags thread also posts what waits for
  // it: it watches a queue pair's send completion channel while that one has pending work, and wake_fd_
  // (an eventfd) tells it a submit left some. -1 without a window.
  int wake_fd_ = -1;
  // Striped links only.
  std::mutex mu_;        // reqs_, next_qp_
  std::timed_mutex flag_mu_;  // a flagged request's immediates go out on every queue pair in the same order
  util::IdSlab<Striped> reqs_;
  size_t next_qp_ = 0;
  std::mutex imm_mu_;    // imm_: immediates per queue pair not yet matched on all of them
  std::vector<std::deque<uint32_t>> imm_;
};

// Paths whose bytes are moved by a CPU on this side (same-host, TCP): synchronous requests run in the
// caller's thread; asynchronous ones are queued to one worker thread per link, in order, except a
// small one (at most inline_bytes(), 0: never) submitted while nothing is queued or running: it
// runs in the caller's thread at once (handing it to the worker would cost two thread switches,
// far more than moving a few KiB). A request's flag goes out through the sender (the engine: a Flag
// frame on the link's control connection) once execute() completed, before the request reports
// COMPLETED.
class QueuedPath : public DataPath {
 public:
  ~QueuedPath() override;
  uint64_t submit(Op op, const std::vector<Desc>& descs, std::chrono::milliseconds timeout, Flag flag) override;
  Result status(uint64_t req) override;
  Result wait(uint64_t req, std::chrono::milliseconds timeout) override;
  bool wait_done(uint64_t req, std::chrono::milliseconds timeout) override;
  void close() override;
  void set_flag_sender(FlagSink send) { flag_sender_ = std::move(send); }  // before the first submit

 protected:
  // Moves the bytes; returns kCompleted, kFailed (with error) or kTimeout at the deadline (and then
  // guarantees nothing more of this request lands: it stops before returning). Called with no lock
  // held, one request at a time (run_mu_).
  virtual Result execute(Op op, const std::vector<Desc>& descs, Clock::time_point deadline) = 0;
  // Called once by close() before the worker is joined: unblock execute() (shut sockets down...).
  virtual void interrupt() {}
  // Asynchronous requests of at most this many bytes may run in the submitting thread (see above).
  virtual uint64_t inline_bytes() const { return 0; }
  bool closed() const;
  // Marks the path closed, fails queued jobs, interrupt()s, joins the worker. Derived destructors
  // call it first (the worker calls their execute()).
  void stop_worker();

 private:
  struct Job {
    uint64_t id;
    Op op;
    std::vector<Desc> descs;
    Flag flag;
    Clock::time_point deadline;
  };
  struct Entry {        // a request not yet reported
    bool done = false;  // result holds its terminal status
    Result result;
  };
  void worker_loop();
  Result run(Op op, const std::vector<Desc>& descs, Flag flag, Clock::time_point deadline);  // under run_mu_
  // run() once run_mu_ is ours; kTimeout when the request before it still runs at `deadline`.
  Result run_locked(Op op, const std::vector<Desc>& descs, Flag flag, Clock::time_point deadline);
  void finish(uint64_t id, Result r);  // records a terminal status, wakes waiters
  FlagSink flag_sender_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // One execute() at a time: requests of a link run in submission order. Waited for until the
  // waiter's own deadline (run_locked()), never longer.
  std::timed_mutex run_mu_;
  std::mutex join_mu_;
  std::atomic<bool> closed_{false};  // set under mu_; closed() reads it without (once per request and chunk)
  int running_ = 0;  // jobs taken off the queue (or run inline) and not yet reported
  std::deque<Job> queue_;
  util::IdSlab<Entry> reqs_;
  std::thread worker_;
};

}  // namespace hixl::transport
