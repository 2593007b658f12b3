#include "transport/tcp_path.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <climits>
#include <cstdlib>

#include <algorithm>
#include <cstring>

#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::transport {

namespace {

constexpr uint32_t kMagic = 0x44545848;  // "HXTD"
constexpr uint32_t kOpWrite = 1, kOpRead = 2;
constexpr uint32_t kMaxDescs = 4096;      // per frame; bigger requests use several frames
constexpr size_t kHeader = 24, kReply = 16;
constexpr int kParamInvalid = 103900, kFailed = 503900;

void put32(uint8_t* p, uint32_t v) { for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i)); }
void put64(uint8_t* p, uint64_t v) { for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i)); }
uint32_t get32(const uint8_t* p) { uint32_t v = 0; for (int i = 0; i < 4; ++i) v |= uint32_t(p[i]) << (8 * i); return v; }
uint64_t get64(const uint8_t* p) { uint64_t v = 0; for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i); return v; }

enum class Io { kOk, kTimeout, kStopped, kClosed, kError };

// How long a wait for the socket spins (non-blocking retries) after the last progress before it
// sleeps in poll(). Waking a sleeping thread costs tens of microseconds on a VM (the idle vCPU is
// halted), more than the whole round trip of a small request; a bounded spin keeps back-to-back
// requests and their replies off that path. $HIXL_TCP_SPIN_US overrides it (0: never spin).
std::chrono::microseconds spin_budget() {
  static const std::chrono::microseconds v = [] {
    const char* e = std::getenv("HIXL_TCP_SPIN_US");
    long us = e && *e ? std::strtol(e, nullptr, 10) : 50;
    return std::chrono::microseconds(std::clamp(us, 0L, 100000L));
  }();
  return v;
}

// Once a request's header arrived, the peer that sends nothing more of it for this long is cut: a
// live peer stalling mid-frame holds only its own link's serving thread, and not for ever. TCP's
// own retransmissions back off to 6.4 s only after six losses of one segment in a row.
constexpr std::chrono::milliseconds kFrameStall{10000};

// Moves every byte of iov[0, cnt) with sendmsg/recvmsg (IOV_MAX entries at a time; the array is
// consumed). Waits spin for spin_budget() since the last progress, then poll in 100 ms slices so
// that `stop` and the deadline are noticed. stall > 0: also kTimeout after that long without a byte.
Io xferv(int fd, iovec* iov, size_t cnt, bool sending, Clock::time_point deadline, const std::atomic<bool>* stop,
         int* err, std::chrono::milliseconds stall = std::chrono::milliseconds(0)) {
  size_t i = 0;
  Clock::time_point spin_until{};
  Clock::time_point stall_at = stall.count() ? Clock::now() + stall : Clock::time_point::max();
  while (i < cnt) {
    if (iov[i].iov_len == 0) {
      ++i;
      continue;
    }
    if (stop && *stop) return Io::kStopped;
    // Also while the peer keeps up (no EAGAIN ever): a 64 MiB write must still end at its deadline.
    if (Clock::now() >= deadline) return Io::kTimeout;
    msghdr m{};
    m.msg_iov = iov + i;
    m.msg_iovlen = std::min<size_t>(cnt - i, IOV_MAX);
    ssize_t n = sending ? ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT) : ::recvmsg(fd, &m, MSG_DONTWAIT);
    if (n > 0) {
      for (size_t left = size_t(n); left;) {
        size_t step = std::min(left, iov[i].iov_len);
        iov[i].iov_base = static_cast<uint8_t*>(iov[i].iov_base) + step;
        iov[i].iov_len -= step;
        left -= step;
        if (!iov[i].iov_len) ++i;
      }
      spin_until = {};
      if (stall.count()) stall_at = Clock::now() + stall;
      continue;
    }
    if (n == 0 && !sending) return Io::kClosed;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      *err = errno;
      return errno == ECONNRESET || errno == EPIPE ? Io::kClosed : Io::kError;
    }
    auto now = Clock::now();
    if (now >= deadline || now >= stall_at) return Io::kTimeout;
    if (spin_until == Clock::time_point{}) spin_until = now + spin_budget();
    if (now < spin_until) {
      // Yield while spinning: the thread we wait for may have been woken onto this very CPU, where
      // a plain spin would hold it off for the whole budget (seen as +100 us round trips).
      ::sched_yield();
      continue;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(std::min(deadline, stall_at) - now).count();
    pollfd pf{fd, short(sending ? POLLOUT : POLLIN), 0};
    int rc = ::poll(&pf, 1, int(std::min<long long>(left + 1, 100)));
    if (rc < 0 && errno != EINTR) {
      *err = errno;
      return Io::kError;
    }
  }
  return Io::kOk;
}

Io xfer(int fd, void* p, size_t len, bool sending, Clock::time_point deadline, const std::atomic<bool>* stop,
        int* err, std::chrono::milliseconds stall = std::chrono::milliseconds(0)) {
  iovec v{p, len};
  return xferv(fd, &v, 1, sending, deadline, stop, err, stall);
}

const char* io_name(Io r) {
  switch (r) {
    case Io::kOk: return "ok";
    case Io::kTimeout: return "timed out";
    case Io::kStopped: return "path closing";
    case Io::kClosed: return "peer closed the connection";
    case Io::kError: return "socket error";
  }
  return "?";
}

}  // namespace

TcpPath::TcpPath(std::string peer, ServedMemory* memory) : peer_(std::move(peer)), memory_(memory) {}

TcpPath::~TcpPath() { close(); }

void TcpPath::attach(bool serve, oob::Socket s) {
  std::lock_guard<std::mutex> g(attach_mu_);
  if (stopping_) return;  // closed meanwhile: s closes here
  if ((serve ? srv_ : req_).valid()) {
    log::warn("tcp path to " + peer_ + ": a second " + (serve ? "serve" : "request") + " connection; dropped");
    return;
  }
  if (serve) {
    srv_ = std::move(s);
    server_ = std::thread([this] { serve_loop(); });
  } else {
    req_ = std::move(s);
  }
  attach_cv_.notify_all();
}

bool TcpPath::wait_attached(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lk(attach_mu_);
  return attach_cv_.wait_until(lk, deadline, [&] { return stopping_ || (req_.valid() && srv_.valid()); }) &&
         !stopping_;
}

void TcpPath::interrupt() {
  std::lock_guard<std::mutex> g(attach_mu_);
  stopping_ = true;  // before the shutdown: the server thread checks it before every recv
  req_.shutdown();
  srv_.shutdown();
  attach_cv_.notify_all();
}

void TcpPath::close() {
  QueuedPath::close();  // interrupt(), then the worker and any synchronous request have stopped
  std::lock_guard<std::mutex> g(server_join_mu_);
  if (server_.joinable()) server_.join();  // the peer's request being applied has stopped too
}

Result TcpPath::execute(Op op, const std::vector<Desc>& descs, Clock::time_point deadline) {
  auto fail = [&](Status st, const std::string& why) {
    broken_ = true;
    req_.shutdown();
    return Result{st, "tcp path to " + peer_ + ": " + why};
  };
  if (broken_) return {Status::kFailed, "tcp path to " + peer_ + " is broken by an earlier failure"};
  if (!wait_attached(std::min(deadline, Clock::now() + std::chrono::milliseconds(5000))))
    return {Status::kFailed, "tcp path to " + peer_ + ": data connections not attached"};
  const int fd = req_.fd();
  const bool write = op == Op::kWrite;
  int err = 0;
  // A request without a deadline of its own (asynchronous) is cut, as the peer's are on our side,
  // when the peer takes or sends nothing of a frame for kFrameStall.
  const auto stall = deadline == Clock::time_point::max() ? kFrameStall : std::chrono::milliseconds(0);
  std::vector<uint8_t> buf;
  std::vector<iovec> iov;
  for (size_t first = 0; first < descs.size(); first += kMaxDescs) {
    size_t n = std::min<size_t>(kMaxDescs, descs.size() - first);
    uint64_t seq = next_seq_++;
    buf.assign(kHeader + 16 * n, 0);
    put32(&buf[0], kMagic);
    put32(&buf[4], write ? kOpWrite : kOpRead);
    put64(&buf[8], seq);
    put32(&buf[16], uint32_t(n));
    for (size_t i = 0; i < n; ++i) {
      put64(&buf[kHeader + 16 * i], descs[first + i].remote_addr);
      put64(&buf[kHeader + 16 * i + 8], descs[first + i].length);
    }
    // One sendmsg for the header, the descriptors and (write) every payload: no copy, no extra
    // segment or wakeup per descriptor.
    iov.assign(1, iovec{buf.data(), buf.size()});
    for (size_t i = 0; write && i < n; ++i)
      iov.push_back(iovec{reinterpret_cast<void*>(descs[first + i].local_addr), descs[first + i].length});
    // stopping_ ends every wait at once on close(): a shut-down socket still yields what the peer
    // keeps sending, so a slow read would otherwise hold close(), and the thread that called it, for
    // as long as the peer sends.
    Io r = xferv(fd, iov.data(), iov.size(), true, deadline, &stopping_, &err, stall);
    uint8_t rep[kReply];
    if (r == Io::kOk) r = xfer(fd, rep, sizeof rep, false, deadline, &stopping_, &err, stall);
    if (r != Io::kOk)
      return fail(r == Io::kTimeout ? Status::kTimeout : Status::kFailed,
                  std::string(write ? "write" : "read") + " " + io_name(r) + (err ? ": " + errno_str(err) : ""));
    if (get32(rep) != kMagic || get64(rep + 8) != seq)
      return fail(Status::kFailed, "reply out of step (magic/seq mismatch)");
    if (uint32_t st = get32(rep + 4))
      return fail(Status::kFailed, "the peer refused the request (status " + std::to_string(st) +
                                       "): a range is not inside its registered memory");
    if (!write) {
      iov.clear();
      for (size_t i = 0; i < n; ++i)
        iov.push_back(iovec{reinterpret_cast<void*>(descs[first + i].local_addr), descs[first + i].length});
      r = xferv(fd, iov.data(), iov.size(), false, deadline, &stopping_, &err, stall);
      if (r != Io::kOk)
        return fail(r == Io::kTimeout ? Status::kTimeout : Status::kFailed,
                    std::string("read payload ") + io_name(r) + (err ? ": " + errno_str(err) : ""));
    }
    if (closed()) return fail(Status::kFailed, "path closed during the request");
  }
  return Result(Status::kCompleted);
}

// One request of the peer's: its descriptors, then (write) its payloads into our memory or (read)
// the reply and the payloads from it. True when the next request may follow; false when the data
// connection closes, with *why set unless the peer or our own close ended it. The memory it touches
// is held (memory_->begin) only while its bytes move.
bool TcpPath::serve_one(const uint8_t* h, ServedMemory::Use* use, std::vector<uint8_t>* descs,
                        std::vector<Range>* ranges, std::vector<iovec>* iov, std::string* why) {
  const int fd = srv_.fd();
  const auto forever = Clock::time_point::max();
  int err = 0;
  auto reply = [&](uint64_t seq, uint32_t status) {
    uint8_t rep[kReply];
    put32(rep, kMagic);
    put32(rep + 4, status);
    put64(rep + 8, seq);
    return xfer(fd, rep, sizeof rep, true, Clock::now() + std::chrono::seconds(30), &stopping_, &err);
  };
  uint32_t op = get32(h + 4), n = get32(h + 16);
  uint64_t seq = get64(h + 8);
  if (get32(h) != kMagic || (op != kOpWrite && op != kOpRead) || n == 0 || n > kMaxDescs || get32(h + 20)) {
    reply(seq, kFailed);
    *why = "malformed request header";
    return false;
  }
  descs->resize(16 * size_t(n));
  auto ended = [&](Io r, const char* what) {
    if (r != Io::kStopped && r != Io::kClosed)
      *why = std::string(what) + " " + io_name(r) + (err ? ": " + errno_str(err) : "");
    return false;
  };
  if (Io r = xfer(fd, descs->data(), descs->size(), false, forever, &stopping_, &err, kFrameStall); r != Io::kOk)
    return ended(r, "descriptors");
  const bool write = op == kOpWrite;
  ranges->resize(n);
  for (uint32_t i = 0; i < n; ++i) (*ranges)[i] = Range{get64(&(*descs)[16 * i]), get64(&(*descs)[16 * i + 8])};
  if (!memory_->begin(use, ranges->data(), n, write)) {
    // An honest initiator checked the same ranges; the payload that follows cannot be skipped safely.
    reply(seq, kParamInvalid);
    *why = std::string(write ? "write" : "read") + " request for memory that is not registered here for remote " +
           (write ? "write" : "read");
    return false;
  }
  uint8_t rep[kReply];
  put32(rep, kMagic);
  put32(rep + 4, 0);
  put64(rep + 8, seq);
  iov->clear();
  if (!write) iov->push_back(iovec{rep, sizeof rep});  // the reply, then the payloads, in one sendmsg
  for (const Range& r : *ranges) iov->push_back(iovec{reinterpret_cast<void*>(r.addr), size_t(r.len)});
  Io r = write ? xferv(fd, iov->data(), iov->size(), false, forever, &stopping_, &err, kFrameStall)
               : xferv(fd, iov->data(), iov->size(), true, Clock::now() + std::chrono::seconds(30), &stopping_, &err);
  memory_->end(use);  // from here on a deregistration of that memory needs nothing of ours
  if (use->was_cut) {
    *why = "a request touched memory deregistered meanwhile (it was cut)";
    return false;
  }
  if (r != Io::kOk) return ended(r, "payload");
  return !write || reply(seq, 0) == Io::kOk;
}

void TcpPath::serve_loop() {
  const int fd = srv_.fd();
  ServedMemory::Use use;
  use.cut = [this] { srv_.shutdown(); };
  std::vector<uint8_t> descs;
  std::vector<Range> ranges;
  std::vector<iovec> iov;
  std::string why;
  int err = 0;
  for (;;) {
    uint8_t h[kHeader];
    Io r = xfer(fd, h, sizeof h, false, Clock::time_point::max(), &stopping_, &err);
    if (r != Io::kOk) {
      if (r != Io::kStopped && r != Io::kClosed) why = std::string("header ") + io_name(r);
      break;
    }
    if (!serve_one(h, &use, &descs, &ranges, &iov, &why)) break;
  }
  if (!why.empty()) log::warn("tcp path from " + peer_ + ": " + why + "; closing the data connection");
  srv_.shutdown();
}

}  // namespace hixl::transport
