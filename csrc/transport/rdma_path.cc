// RdmaPath (data_path.h): one link's requests over one RC queue pair, or striped over several.
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "transport/data_path.h"
#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::transport {

using std::chrono::milliseconds;

namespace {
// kFailed > kTimeout > kCompleted: what a striped request reports when its stripes ended differently.
int severity(Status s) { return s == Status::kFailed ? 2 : s == Status::kTimeout ? 1 : 0; }
}  // namespace

RdmaPath::RdmaPath(std::vector<std::shared_ptr<rdma::Endpoint>> eps, FlagSink sink)
    : eps_(std::move(eps)), sink_(std::move(sink)) {
  if (eps_.empty() || eps_.size() > kMaxQps || std::find(eps_.begin(), eps_.end(), nullptr) != eps_.end())
    throw Error("rdma path: needs 1.." + std::to_string(kMaxQps) + " endpoints, got " + std::to_string(eps_.size()));
  imm_.resize(eps_.size());
  if (eps_[0]->options().window_bytes) {
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) throw_errno("rdma path: eventfd", errno);
  }
  flags_ = std::thread([this] { flags_loop(); });
}

RdmaPath::~RdmaPath() {
  close();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void RdmaPath::wake_if_pending(const rdma::Endpoint& ep) {
  if (wake_fd_ < 0 || !ep.has_pending()) return;
  const uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof one) < 0 && errno != EAGAIN)  // EAGAIN: the counter is full, it is awake
    log::warn("rdma path: write to the send window's eventfd failed: " + errno_str(errno));
}

void RdmaPath::flags_loop() {
  // Each round: collect what every queue pair received, then sleep in one poll() on their receive
  // channels (armed: an immediate that came after the collection makes its fd readable), at most
  // 100 ms so that close() is seen. A queue pair that closed or failed drops out; the others go on.
  // With a send window, the poll() also watches wake_fd_ and the send channel of each queue pair
  // with work waiting for its window.
  const size_t k = eps_.size();
  std::vector<bool> live(k, true);
  std::vector<pollfd> fds(2 * k + 1);
  std::vector<size_t> qp_of(2 * k + 1);
  enum : size_t { kWake = SIZE_MAX };
  auto stopped = [&](size_t qp, const std::exception& e) {
    log::warn("rdma path: receiving completion flags on queue pair " + std::to_string(qp) + " of " +
              std::to_string(k) + " stopped: " + e.what());
    live[qp] = false;
  };
  while (!stop_) {
    size_t n = 0;
    for (size_t qp = 0; qp < k; ++qp) {
      if (!live[qp] || eps_[qp]->closed()) {
        live[qp] = false;
        continue;
      }
      try {
        for (;;) {
          auto got = eps_[qp]->poll_imm(256);
          for (uint32_t v : got) on_imm(qp, v);
          if (got.size() < 256) break;
        }
      } catch (const std::exception& e) {
        stopped(qp, e);
        continue;
      }
      fds[n] = pollfd{eps_[qp]->imm_fd(), POLLIN, 0};
      qp_of[n++] = qp;
    }
    if (n == 0 || stop_) return;
    const size_t recv_n = n;
    if (wake_fd_ >= 0) {
      fds[n] = pollfd{wake_fd_, POLLIN, 0};
      qp_of[n++] = kWake;
      for (size_t qp = 0; qp < k; ++qp) {
        if (!live[qp] || !eps_[qp]->has_pending()) continue;
        fds[n] = pollfd{eps_[qp]->send_fd(), POLLIN, 0};
        qp_of[n++] = qp;
      }
    }
    if (::poll(fds.data(), nfds_t(n), 100) < 0) {
      if (errno == EINTR) continue;
      log::warn("rdma path: poll() on " + std::to_string(n) + " completion channels failed: " +
                errno_str(errno) + "; completion flags on this link stop");
      return;
    }
    for (size_t j = 0; j < n; ++j) {
      if (!fds[j].revents) continue;
      if (qp_of[j] == kWake) {
        uint64_t count;
        while (::read(wake_fd_, &count, sizeof count) > 0) {}
        continue;
      }
      if (fds[j].revents & (POLLERR | POLLHUP | POLLNVAL)) {  // would wake every poll(): drop it
        stopped(qp_of[j], Error("poll() on its " + std::string(j < recv_n ? "receive" : "send") +
                                " completion channel (fd " + std::to_string(fds[j].fd) + ") reported revents " +
                                std::to_string(fds[j].revents)));
        continue;
      }
      try {
        if (j < recv_n) {
          eps_[qp_of[j]]->imm_event();
        } else if (!eps_[qp_of[j]]->send_event()) {
          // A waiter sleeps on that channel and takes the event itself, at once: do not spin on it meanwhile.
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      } catch (const std::exception& e) {
        stopped(qp_of[j], e);
      }
    }
  }
}

void RdmaPath::on_imm(size_t qp, uint32_t v) {
  if (eps_.size() == 1) {
    sink_(v);
    return;
  }
  // The peer posts a flag on every queue pair, in the same order on each: the fronts match. Handed on
  // under imm_mu_, so that flags leave in the order they completed.
  std::lock_guard<std::mutex> g(imm_mu_);
  imm_[qp].push_back(v);
  while (std::all_of(imm_.begin(), imm_.end(), [](const std::deque<uint32_t>& q) { return !q.empty(); })) {
    const uint32_t f = imm_[0].front();
    for (size_t i = 0; i < imm_.size(); ++i) {
      if (imm_[i].front() != f)
        log::warn("rdma path: completion flag " + std::to_string(imm_[i].front()) + " on queue pair " +
                  std::to_string(i) + " arrived where queue pair 0 had " + std::to_string(f) +
                  " (the peer posts each flag on every queue pair in the same order)");
      imm_[i].pop_front();
    }
    sink_(f);
  }
}

uint64_t RdmaPath::submit(Op op, const std::vector<Desc>& d, milliseconds timeout, Flag flag) {
  if (flag && op != Op::kWrite) throw Error("rdma path: a completion flag needs a WRITE");
  const rdma::Op o = op == Op::kRead ? rdma::Op::kRead : flag ? rdma::Op::kWriteImm : rdma::Op::kWrite;
  const size_t k = eps_.size();
  if (k == 1) {
    const uint64_t id = eps_[0]->submit(o, d, flag.value_or(0), timeout);
    wake_if_pending(*eps_[0]);
    return id;
  }

  // Striped: split the bytes into n contiguous stripes of about total / n bytes each.
  uint64_t total = 0;
  for (const Desc& x : d) total += x.length;
  const size_t n = size_t(std::clamp<uint64_t>((total + kMinStripe - 1) / kMinStripe, 1, k));
  const uint64_t per = (total + n - 1) / n;
  std::vector<std::vector<Desc>> stripes(n);
  {
    size_t s = 0;
    uint64_t in_s = 0;
    for (const Desc& x : d) {
      uint64_t off = 0;
      if (x.length == 0) continue;
      while (off < x.length) {
        if (in_s == per && s + 1 < n) ++s, in_s = 0;
        const uint64_t take = std::min(x.length - off, s + 1 < n ? per - in_s : x.length - off);
        Desc part = x;
        part.local_addr += off;
        part.remote_addr += off;
        part.length = take;
        stripes[s].push_back(part);
        off += take;
        in_s += take;
      }
    }
  }
  // Held while this flag goes out on every queue pair (in the same order on each); waited for until
  // our own deadline, never longer: an earlier flag still waiting for send-queue room costs this
  // request its deadline, nothing more.
  std::unique_lock<std::timed_mutex> fl(flag_mu_, std::defer_lock);
  if (flag && timeout.count() < 0) {
    fl.lock();
  } else if (flag && !fl.try_lock_until(Clock::now() + timeout)) {
    Striped late;
    late.status = Status::kTimeout;
    late.error = "rdma path: an earlier flagged request of this link was still being posted after " +
                 std::to_string(timeout.count()) + " ms";
    std::lock_guard<std::mutex> g(mu_);
    const uint64_t id = reqs_.add(std::move(late));
    if (!id)
      throw Error("rdma path: " + std::to_string(reqs_.size()) + " requests not yet collected with status()/wait()", EAGAIN);
    return id;
  }
  size_t first;
  uint64_t id;
  {
    std::lock_guard<std::mutex> g(mu_);
    first = next_qp_;
    next_qp_ = (next_qp_ + n) % k;
    id = reqs_.add(Striped{});
    if (!id)
      throw Error("rdma path: " + std::to_string(reqs_.size()) + " requests not yet collected with status()/wait()", EAGAIN);
  }
  // Stripe i on queue pair (first + i) % k; with a flag, every other queue pair gets it alone.
  const size_t posts = flag ? k : n;
  static const std::vector<Desc> kNone;
  for (size_t i = 0; i < posts; ++i) {
    const size_t qp = (first + i) % k;
    Result failed;
    uint64_t sub = 0;
    try {
      sub = eps_[qp]->submit(o, i < n ? stripes[i] : kNone, flag.value_or(0), timeout);
      wake_if_pending(*eps_[qp]);
    } catch (const Error& e) {
      if (i == 0) {  // nothing posted: the caller learns it as from one queue pair
        std::lock_guard<std::mutex> g(mu_);
        reqs_.erase(id);
        throw;
      }
      failed = {Status::kFailed, e.what()};
    }
    std::lock_guard<std::mutex> g(mu_);
    Striped& s = *reqs_.find(id);
    s.qp[i] = uint8_t(qp);
    s.sub[i] = sub;
    s.n = uint8_t(i + 1);
    if (!sub) {  // the rest is not posted: the request ends FAILED once the posted stripes ended
      note_locked(s, i, failed);
      break;
    }
  }
  return id;
}

void RdmaPath::note_locked(Striped& s, size_t k, Result r) {
  s.over[k] = true;
  if (severity(r.status) > severity(s.status) || (r.status != Status::kCompleted && s.error.empty())) {
    s.status = r.status;
    s.error = "queue pair " + std::to_string(s.qp[k]) + " of " + std::to_string(eps_.size()) + ": " + r.error;
  }
}

Result RdmaPath::status(uint64_t req) {
  if (eps_.size() == 1) return eps_[0]->status(req);
  std::lock_guard<std::mutex> g(mu_);
  Striped* s = reqs_.find(req);
  if (!s) return {Status::kFailed, "unknown request " + std::to_string(req)};
  bool all = true;
  for (size_t k = 0; k < s->n; ++k) {
    if (s->over[k]) continue;
    Result r = eps_[s->qp[k]]->status(s->sub[k]);
    if (r.status == Status::kWaiting) {
      all = false;
      continue;
    }
    note_locked(*s, k, std::move(r));
  }
  if (!all) return Result(Status::kWaiting);
  Result out{s->status, std::move(s->error)};
  reqs_.erase(req);
  return out;
}

bool RdmaPath::wait_done(uint64_t req, milliseconds timeout) {
  if (eps_.size() == 1) return eps_[0]->wait_done(req, timeout);
  Striped copy;
  {
    std::lock_guard<std::mutex> g(mu_);
    const Striped* s = reqs_.find(req);
    if (!s) return true;
    copy = *s;
  }
  const auto deadline = timeout.count() < 0 ? Clock::time_point::max() : Clock::now() + timeout;
  for (size_t k = 0; k < copy.n; ++k) {
    if (copy.over[k]) continue;
    milliseconds left(-1);
    if (deadline != Clock::time_point::max())
      left = std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
    if (!eps_[copy.qp[k]]->wait_done(copy.sub[k], left)) return false;
  }
  return true;
}

Result RdmaPath::wait(uint64_t req, milliseconds timeout) {
  if (eps_.size() == 1) return eps_[0]->wait(req, timeout);
  if (!wait_done(req, timeout)) return Result(Status::kWaiting);
  return status(req);
}

void RdmaPath::close() {
  stop_ = true;
  for (auto& ep : eps_) ep->close();
  std::lock_guard<std::mutex> g(join_mu_);
  if (flags_.joinable() && flags_.get_id() != std::this_thread::get_id()) flags_.join();
}

}  // namespace hixl::transport
