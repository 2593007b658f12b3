// Transfers (sync and async, with their status), and notifies to peers. A transfer is checked
// against our registry and the peer's regions before anything is posted.
#include <algorithm>

#include "engine/engine.h"
#include "engine/internal.h"
#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::engine {

using namespace detail;

int Engine::ensure_link(const std::string& key, int timeout_ms, std::shared_ptr<Link>* out) {
  *out = links_.find(key);
  if (*out) return kSuccess;
  if (!opts_.auto_connect) return fail(kNotConnected, "not connected to " + key + " (AutoConnect is off)");
  int rc = connect(key, std::max(1, timeout_ms));
  if (rc != kSuccess && rc != kAlreadyConnected) return rc;
  *out = links_.find(key);
  return *out ? kSuccess : fail(kNotConnected, "auto-connect to " + key + " did not leave a link");
}

int Engine::prepare(const std::shared_ptr<Link>& link, TransferOp op, const std::vector<OpDesc>& descs,
                    Clock::time_point deadline, std::vector<rdma::Desc>* out) {
  if (descs.empty()) return fail(kParamInvalid, "transfer: empty descriptor list");
  if (op != TransferOp::kRead && op != TransferOp::kWrite)
    return fail(kParamInvalid, "transfer: unknown op " + std::to_string(int(op)));
  if (!link->path) return fail(kFailed, "transfer: link to " + link->key + " has no data transport");
  if (int rc = registry_.resolve_local(descs, out); rc != kSuccess) return rc;
  const uint32_t need = op == TransferOp::kWrite ? wire::kRemoteWrite : wire::kRemoteRead;
  auto resolve = [&](size_t* bad) {
    std::lock_guard<std::mutex> g(link->mu);
    const RegionEntry* last = nullptr;
    for (size_t i = 0; i < descs.size(); ++i) {
      const OpDesc& d = descs[i];
      if (!(last && last->contains(d.remote_addr, d.len))) last = link->remote.find(d.remote_addr, d.len, need);
      if (!last) {
        *bad = i;
        return false;
      }
      (*out)[i].rkey = last->key;
    }
    return true;
  };
  size_t bad = 0;
  if (resolve(&bad)) return kSuccess;
  // Not in our copy of the peer's regions: it may have registered since. Ask once, then decide.
  uint64_t seq = link->expect();
  wire::Control q;
  q.type = wire::FrameType::kRegionsReq;
  q.seq = seq;
  auto until = std::min(deadline, Clock::now() + milliseconds(1000));
  try {
    link->send(q, until);
    link->wait_reply(seq, until, nullptr);  // the progress thread applied the list before delivering
  } catch (const std::exception& e) {
    link->forget(seq);
    log::info("region refresh from " + link->key + " failed: " + e.what());
  }
  if (resolve(&bad)) return kSuccess;
  const OpDesc& d = descs[bad];
  return fail(kParamInvalid, CallDesc("transfer").arg("desc", bad).hex("remote_addr", d.remote_addr).arg("len", d.len)
                                 .str() + ": remote range is not inside a region " + link->key + " registered for " +
                                 (op == TransferOp::kWrite ? "remote write" : "remote read"));
}

bool Engine::abort_link(const std::shared_ptr<Link>& link, const std::string& why) {
  // 1. Our QP to ERR: nothing more leaves this side. 2. The peer moves its QP to ERR too, so packets
  // still in the network are dropped on arrival, and confirms. Only then may the caller say "no
  // write of this call lands later".
  if (link->path) link->path->close();
  bool confirmed = false;
  uint64_t seq = link->expect();
  try {
    wire::Control a;
    a.type = wire::FrameType::kAbort;
    a.seq = seq;
    a.text = why;
    auto until = Clock::now() + milliseconds(5000);
    link->send(a, until);
    confirmed = link->wait_reply(seq, until, nullptr).has_value();
  } catch (const std::exception& e) {
    link->forget(seq);
    log::warn("abort of link " + link->key + ": " + e.what());
  }
  remove_link(link, why);
  return confirmed;
}

int Engine::submit_checks(TransferOp op, int64_t flag, const char* call) {
  if (flag < 0) return kSuccess;
  if (flag > int64_t(UINT32_MAX)) return fail(kParamInvalid, std::string(call) + ": flag must be < 2^32");
  if (op != TransferOp::kWrite) return fail(kParamInvalid, std::string(call) + ": a completion flag needs a WRITE");
  return kSuccess;
}

int Engine::transfer_sync(const std::string& remote, TransferOp op, const std::vector<OpDesc>& descs,
                          int timeout_ms, int64_t flag) {
  try {
    if (!ready()) return fail(kFailed, "transfer_sync: engine is not initialized");
    if (timeout_ms <= 0) return fail(kParamInvalid, "transfer_sync: timeout_in_millis must be > 0");
    if (int rc = submit_checks(op, flag, "transfer_sync"); rc != kSuccess) return rc;
    auto key = canonical(remote);
    if (!key) return fail(kParamInvalid, "transfer_sync: \"" + remote + "\" is not an engine address");
    auto deadline = Clock::now() + milliseconds(timeout_ms);
    std::shared_ptr<Link> link;
    int rc = ensure_link(*key, timeout_ms, &link);
    if (rc != kSuccess) return rc;
    std::vector<rdma::Desc> rd;
    rc = prepare(link, op, descs, deadline, &rd);
    if (rc != kSuccess) return rc;
    transport::Op top = op == TransferOp::kWrite ? transport::Op::kWrite : transport::Op::kRead;
    rdma::RequestResult r;
    try {
      uint64_t id = link->path->submit(top, rd, std::max(left_until(deadline), milliseconds(1)),
                                       flag < 0 ? transport::Flag() : transport::Flag(uint32_t(flag)));
      r = link->path->wait(id, left_until(deadline));
    } catch (const Error& e) {
      remove_link(link, std::string("transfer failed: ") + e.what());
      return fail(kFailed, "transfer_sync to " + *key + ": " + e.what());
    }
    if (r.status == TransferStatus::kCompleted) return ok();
    if (r.status == TransferStatus::kFailed) {
      remove_link(link, "transfer failed: " + r.error);
      return fail(kFailed, "transfer_sync to " + *key + ": " + r.error);
    }
    if (!abort_link(link, "transfer_sync timed out after " + std::to_string(timeout_ms) + " ms"))
      return fail(kFailed, "transfer_sync to " + *key + ": not complete within " + std::to_string(timeout_ms) +
                               " ms, and the peer did not confirm its queue pair is in the error state: writes "
                               "already on the wire may still land. The link is closed");
    return fail(kTimeout, "transfer_sync to " + *key + ": not complete within " + std::to_string(timeout_ms) +
                              " ms; both queue pairs are in the error state, so none of its writes can land later. "
                              "The link is closed");
  } catch (const std::exception& e) {
    return fail(kFailed, "transfer_sync(" + remote + "): " + e.what());
  }
}

std::pair<int, uint64_t> Engine::transfer_async(const std::string& remote, TransferOp op,
                                                const std::vector<OpDesc>& descs, uint64_t user_data, int64_t flag,
                                                int timeout_ms) {
  try {
    const auto start = Clock::now();
    if (!ready()) return {fail(kFailed, "transfer_async: engine is not initialized"), 0};
    if (timeout_ms < 0) timeout_ms = opts_.async_timeout_ms;
    if (int rc = submit_checks(op, flag, "transfer_async"); rc != kSuccess) return {rc, 0};
    auto key = canonical(remote);
    if (!key) return {fail(kParamInvalid, "transfer_async: \"" + remote + "\" is not an engine address"), 0};
    std::shared_ptr<Link> link;
    int rc = ensure_link(*key, 1000, &link);
    if (rc != kSuccess) return {rc, 0};
    std::vector<rdma::Desc> rd;
    rc = prepare(link, op, descs, Clock::now() + milliseconds(1000), &rd);
    if (rc != kSuccess) return {rc, 0};
    uint64_t ep_req;
    try {
      ep_req = link->path->submit(op == TransferOp::kWrite ? transport::Op::kWrite : transport::Op::kRead, rd,
                                  milliseconds(-1), flag < 0 ? transport::Flag() : transport::Flag(uint32_t(flag)));
    } catch (const Error& e) {
      remove_link(link, std::string("transfer failed: ") + e.what());
      return {fail(kFailed, "transfer_async to " + *key + ": " + e.what()), 0};
    }
    const auto deadline = timeout_ms > 0 ? start + milliseconds(timeout_ms) : Clock::time_point::max();
    const uint64_t id = requests_.add(link, ep_req, user_data, timeout_ms, deadline);
    return {ok(), id};
  } catch (const std::exception& e) {
    return {fail(kFailed, "transfer_async(" + remote + "): " + e.what()), 0};
  }
}

// A terminal status is consumed exactly once (Requests), so two threads polling one request cannot
// turn a COMPLETED into "unknown request".
std::pair<int, int> Engine::transfer_status(uint64_t req) {
  try {
    if (!ready()) return {fail(kFailed, "get_transfer_status: engine is not initialized"), 0};
    auto res = requests_.status(req);
    if (!res)
      return {fail(kParamInvalid, "get_transfer_status(req=" + std::to_string(req) +
                                      "): unknown request (never issued, or already reported complete/failed)"),
              int(TransferStatus::kFailed)};
    return {ok(), int(res->status)};
  } catch (const std::exception& e) {
    return {fail(kFailed, "get_transfer_status: " + std::string(e.what())), int(TransferStatus::kFailed)};
  }
}

std::pair<int, int> Engine::transfer_wait(uint64_t req, int timeout_ms) {
  try {
    if (!ready()) return {fail(kFailed, "transfer_wait: engine is not initialized"), 0};
    auto [path, path_req] = requests_.path_of(req);
    // Wait without the engine lock and without consuming the status: transfer_status() below takes
    // it exactly once, as for any poller.
    const auto until = timeout_ms < 0 ? Clock::time_point::max() : Clock::now() + milliseconds(timeout_ms);
    if (path) path->wait_done(path_req, milliseconds(timeout_ms));
    for (;;) {
      auto r = transfer_status(req);
      if (r.first != kSuccess) detail::last_error() = "transfer_wait: " + detail::last_error();
      if (r.first != kSuccess || r.second != int(TransferStatus::kWaiting) || Clock::now() >= until) return r;
      // The path is done or closed, but the request is past its deadline and its link's abort is
      // still deciding between TIMEOUT and FAILED (finish_expired() notifies); or wait_done() was
      // woken early. Either way: wait again, bounded by our own timeout.
      requests_.wait_change(std::min(until, Clock::now() + milliseconds(50)));
    }
  } catch (const std::exception& e) {
    return {fail(kFailed, "transfer_wait: " + std::string(e.what())), int(TransferStatus::kFailed)};
  }
}

std::pair<int, std::vector<TransferResult>> Engine::all_transfer_status(uint64_t max_count, bool skip_waiting) {
  try {
    if (!ready()) return {fail(kFailed, "get_all_transfer_status: engine is not initialized"), {}};
    return {ok(), requests_.all(max_count, skip_waiting)};
  } catch (const std::exception& e) {
    return {fail(kFailed, "get_all_transfer_status: " + std::string(e.what())), {}};
  }
}

// ---------------------------------------------------------------------------------- notifies
int Engine::send_notify(const std::string& remote, const std::string& name, const std::string& msg, int timeout_ms) {
  try {
    if (!ready()) return fail(kFailed, "send_notify: engine is not initialized");
    if (timeout_ms <= 0) return fail(kParamInvalid, "send_notify: timeout_in_millis must be > 0");
    if (name.size() > kMaxNotifyBytes || msg.size() > kMaxNotifyBytes)
      return fail(kParamInvalid, "send_notify: name/message longer than 1024 characters (4096 bytes of UTF-8)");
    auto key = canonical(remote);
    if (!key) return fail(kParamInvalid, "send_notify: \"" + remote + "\" is not an engine address");
    auto deadline = Clock::now() + milliseconds(timeout_ms);
    std::shared_ptr<Link> link;
    int rc = ensure_link(*key, timeout_ms, &link);
    if (rc != kSuccess) return rc;
    uint64_t seq = link->expect();
    wire::Control n;
    n.type = wire::FrameType::kNotify;
    n.seq = seq;
    n.name = name;
    n.text = msg;
    bool went_down = false;
    std::optional<wire::Control> ack;
    try {
      link->send(n, deadline);
      ack = link->wait_reply(seq, deadline, &went_down);
    } catch (const Error& e) {
      link->forget(seq);
      return fail(e.err() == ETIMEDOUT ? kTimeout : kNotifyFailed, "send_notify to " + *key + ": " + e.what());
    }
    if (!ack) {
      if (went_down) return fail(kNotifyFailed, "send_notify to " + *key + ": the link closed before the peer acknowledged");
      return fail(kTimeout, "send_notify to " + *key + ": no acknowledgement within " + std::to_string(timeout_ms) + " ms");
    }
    if (ack->status == kSuccess) return ok();
    return fail(known_code(ack->status) ? int(ack->status) : kNotifyFailed,
                "send_notify to " + *key + ": the peer refused the notify" +
                    (ack->status == kResourceExhausted ? " (4096 unread notifies pending there)" : ""));
  } catch (const std::exception& e) {
    return fail(kFailed, "send_notify(" + remote + "): " + e.what());
  }
}

// ------------------------------------------------------------------------------------- inbox
std::pair<int, std::vector<Notify>> Engine::wait_notifies(int timeout_ms) {
  if (!ready()) return {fail(kFailed, "wait_notifies: engine is not initialized"), {}};
  inbox_.wait_notifies(timeout_ms);
  return get_notifies();
}

std::pair<int, std::vector<Notify>> Engine::get_notifies() {
  if (!ready()) return {fail(kFailed, "get_notifies: engine is not initialized"), {}};
  return {ok(), inbox_.take_notifies()};
}

std::pair<int, std::vector<FlagEvent>> Engine::poll_flags(size_t max) {
  if (!ready()) return {fail(kFailed, "poll_flags: engine is not initialized"), {}};
  return {ok(), inbox_.poll_flags(max)};
}

std::pair<int, std::vector<FlagEvent>> Engine::wait_flags(size_t max, int timeout_ms) {
  if (!ready()) return {fail(kFailed, "wait_flags: engine is not initialized"), {}};
  std::vector<FlagEvent> out;
  if (!inbox_.wait_flags(max, timeout_ms, &out)) return {fail(kFailed, "wait_flags: engine finalized"), {}};
  return {ok(), std::move(out)};
}

}  // namespace hixl::engine
