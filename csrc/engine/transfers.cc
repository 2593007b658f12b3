// Transfers (sync and async, with their status), and notifies to peers. A transfer is checked
// against our registry and the peer's regions before anything is posted.
#include <algorithm>

#include "engine/engine.h"
#include "engine/internal.h"
#include "engine/thread_state.h"
#include "util/ticks.h"
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

int Engine::find_link(const std::string& remote, int timeout_ms, const char* call, std::shared_ptr<Link>* out,
                      std::string* key, LinkLookup* last) {
  // Links are kept under canonical names, and callers mostly pass one back: try it as given first.
  if ((*out = links_.find(remote, last))) {
    if (key) *key = remote;
    return kSuccess;
  }
  auto canon = canonical(remote);
  if (!canon)
    return refuse(Metrics::Refused::kParam,
                  fail(kParamInvalid, std::string(call) + ": \"" + remote + "\" is not an engine address"));
  if (key) *key = *canon;
  return ensure_link(*canon, timeout_ms, out);
}

void Engine::refresh_regions(const std::shared_ptr<Link>& link, Clock::time_point deadline) {
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
}

int Engine::prepare(const std::shared_ptr<Link>& link, TransferOp op, const OpDesc* descs, size_t n,
                    Clock::time_point deadline, std::vector<rdma::Desc>* out) {
  if (n == 0) return refuse(Metrics::Refused::kParam, fail(kParamInvalid, "transfer: empty descriptor list"));
  if (op != TransferOp::kRead && op != TransferOp::kWrite)
    return refuse(Metrics::Refused::kParam, fail(kParamInvalid, "transfer: unknown op " + std::to_string(int(op))));
  if (!link->path) return fail(kFailed, "transfer: link to " + link->key + " has no data transport");
  if (int rc = registry_.resolve_local(descs, n, out); rc != kSuccess) return refuse(Metrics::Refused::kRange, rc);
  const uint32_t need = op == TransferOp::kWrite ? wire::kRemoteWrite : wire::kRemoteRead;
  auto resolve = [&](size_t* bad) {
    std::lock_guard<util::Mutex> g(link->mu);
    const RegionEntry* last = nullptr;
    for (size_t i = 0; i < n; ++i) {
      rdma::Desc& d = (*out)[i];  // the checked copy: what is posted is what was checked
      if (!(last && last->contains(d.remote_addr, d.length))) last = link->remote.find(d.remote_addr, d.length, need);
      if (!last) {
        *bad = i;
        return false;
      }
      d.rkey = last->key;
    }
    return true;
  };
  size_t bad = 0;
  if (resolve(&bad)) return kSuccess;
  // Not in our copy of the peer's regions: it may have registered since. Ask once, then decide.
  refresh_regions(link, deadline);
  if (resolve(&bad)) return kSuccess;
  const rdma::Desc& d = (*out)[bad];
  bool in_a_region;  // but one without the access: refused for access, else for its range
  {
    std::lock_guard<util::Mutex> g(link->mu);
    in_a_region = link->remote.find(d.remote_addr, d.length, 0) != nullptr;
  }
  metrics_.refused(in_a_region ? Metrics::Refused::kAccess : Metrics::Refused::kRange);
  return fail(kParamInvalid, CallDesc("transfer").arg("desc", bad).hex("remote_addr", d.remote_addr).arg("len", d.length)
                                 .str() + ": remote range is not inside a region " + link->key + " registered for " +
                                 (op == TransferOp::kWrite ? "remote write" : "remote read"));
}

bool Engine::abort_link(const std::shared_ptr<Link>& link, const std::string& why) {
  // 1. Our QP to ERR: nothing more leaves this side. 2. The peer moves its QP to ERR too, so packets
  // still in the network are dropped on arrival, and confirms. Only then may the caller say "no
  // write of this call lands later".
  link->abort_begun = true;  // before the path closes: transfers failing from here on leave the link to us
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
  remove_link(link, why, Metrics::Cause::kAbort);
  return confirmed;
}

void Engine::transfer_failed(const std::shared_ptr<Link>& link, const std::string& why) {
  if (link->abort_begun.load()) return;
  remove_link(link, "transfer failed: " + why, Metrics::Cause::kTransferError);
}

int Engine::submit_checks(TransferOp op, int64_t flag, const char* call) {
  if (flag < 0) return kSuccess;
  if (flag > int64_t(UINT32_MAX))
    return refuse(Metrics::Refused::kParam, fail(kParamInvalid, std::string(call) + ": flag must be < 2^32"));
  if (op != TransferOp::kWrite)
    return refuse(Metrics::Refused::kParam,
                  fail(kParamInvalid, std::string(call) + ": a completion flag needs a WRITE"));
  return kSuccess;
}


namespace {
uint64_t bytes_of(const std::vector<rdma::Desc>& rd) {
  uint64_t n = 0;
  for (const rdma::Desc& d : rd) n += d.length;
  return n;
}
}  // namespace

int Engine::run_sync(const std::shared_ptr<Link>& link, TransferOp op, const std::vector<rdma::Desc>& rd,
                     Clock::time_point deadline, int timeout_ms, int64_t flag, const char* call) {
  const std::string& key = link->key;
  transport::Op top = op == TransferOp::kWrite ? transport::Op::kWrite : transport::Op::kRead;
  const uint64_t t0 = util::ticks();
  auto ended = [&](TransferStatus s) {
    metrics_.transfer_ended(op, link->transport, s, bytes_of(rd), rd.size(), util::ticks() - t0);
  };
  rdma::RequestResult r;
  try {
    uint64_t id = link->path->submit(top, rd, std::max(left_until(deadline), milliseconds(1)),
                                     flag < 0 ? transport::Flag() : transport::Flag(uint32_t(flag)));
    r = link->path->wait(id, left_until(deadline));
  } catch (const Error& e) {
    ended(TransferStatus::kFailed);
    transfer_failed(link, e.what());
    return fail(kFailed, std::string(call) + " to " + key + ": " + e.what());
  }
  if (r.status == TransferStatus::kCompleted) {
    ended(TransferStatus::kCompleted);
    return ok();
  }
  if (r.status == TransferStatus::kFailed) {
    ended(TransferStatus::kFailed);
    transfer_failed(link, r.error);
    return fail(kFailed, std::string(call) + " to " + key + ": " + r.error);
  }
  const bool confirmed = abort_link(link, std::string(call) + " timed out after " + std::to_string(timeout_ms) + " ms");
  ended(confirmed ? TransferStatus::kTimeout : TransferStatus::kFailed);
  if (!confirmed)
    return fail(kFailed, std::string(call) + " to " + key + ": not complete within " + std::to_string(timeout_ms) +
                             " ms, and the peer did not confirm its queue pair is in the error state: writes "
                             "already on the wire may still land. The link is closed");
  return fail(kTimeout, std::string(call) + " to " + key + ": not complete within " + std::to_string(timeout_ms) +
                            " ms; both queue pairs are in the error state, so none of its writes can land later. "
                            "The link is closed");
}

std::pair<int, uint64_t> Engine::run_async(const std::shared_ptr<Link>& link, TransferOp op,
                                           const std::vector<rdma::Desc>& rd, uint64_t user_data, int64_t flag,
                                           int timeout_ms, Clock::time_point start, const char* call,
                                           ThreadState& ts) {
  const uint64_t t0 = util::ticks();
  uint64_t ep_req;
  try {
    ep_req = link->path->submit(op == TransferOp::kWrite ? transport::Op::kWrite : transport::Op::kRead, rd,
                                milliseconds(-1), flag < 0 ? transport::Flag() : transport::Flag(uint32_t(flag)));
  } catch (const Error& e) {
    if (e.err() == EAGAIN)  // the path's table of requests not yet collected is full; the link is fine
      return {refuse(Metrics::Refused::kLimit,
                     fail(kResourceExhausted, std::string(call) + " to " + link->key + ": " + e.what())),
              0};
    metrics_.transfer_ended(op, link->transport, TransferStatus::kFailed, 0, rd.size(), util::ticks() - t0);
    transfer_failed(link, e.what());
    return {fail(kFailed, std::string(call) + " to " + link->key + ": " + e.what()), 0};
  }
  const auto deadline = timeout_ms > 0 ? start + milliseconds(timeout_ms) : Clock::time_point::max();
  const uint64_t id = requests_.add(link, ep_req, user_data, timeout_ms, deadline,
                                    {op, uint32_t(std::min<size_t>(rd.size(), UINT32_MAX)), bytes_of(rd), t0});
  if (!id) {  // more requests outstanding than the table holds: this one ends here, not unseen
    link->path->wait(ep_req, milliseconds(timeout_ms > 0 ? timeout_ms : 60000));
    metrics_.refused(Metrics::Refused::kLimit);
    return {fail(kResourceExhausted, std::string(call) + " to " + link->key + ": " +
                                         std::to_string(util::IdSlab<int>::kMaxLive) +
                                         " requests not yet collected with get_transfer_status (this one was waited for)"),
            0};
  }
  ts.last_error.clear();  // ok(), without looking the thread's state up again
  return {kSuccess, id};
}

int Engine::transfer_sync(const std::string& remote, TransferOp op, const OpDesc* descs, size_t n, int timeout_ms,
                          int64_t flag) {
  try {
    if (!ready()) return fail(kFailed, "transfer_sync: engine is not initialized");
    if (timeout_ms <= 0)
      return refuse(Metrics::Refused::kParam, fail(kParamInvalid, "transfer_sync: timeout_in_millis must be > 0"));
    if (int rc = submit_checks(op, flag, "transfer_sync"); rc != kSuccess) return rc;
    const auto deadline = Clock::now() + milliseconds(timeout_ms);
    std::shared_ptr<Link> link;
    ThreadState& ts = thread_state();
    if (int rc = find_link(remote, timeout_ms, "transfer_sync", &link, nullptr, &ts.last_link); rc != kSuccess)
      return rc;
    std::vector<rdma::Desc>& rd = ts.scratch;
    if (int rc = prepare(link, op, descs, n, deadline, &rd); rc != kSuccess) return rc;
    return run_sync(link, op, rd, deadline, timeout_ms, flag, "transfer_sync");
  } catch (const std::exception& e) {
    return fail(kFailed, "transfer_sync(" + remote + "): " + e.what());
  }
}

std::pair<int, uint64_t> Engine::transfer_async(const std::string& remote, TransferOp op, const OpDesc* descs,
                                                size_t n, uint64_t user_data, int64_t flag, int timeout_ms) {
  try {
    ThreadState& ts = thread_state();
    const auto start = ts.clock.now_at_least();  // at most one clock read per 0.5 ms of calls
    if (!ready()) return {fail(kFailed, "transfer_async: engine is not initialized"), 0};
    if (timeout_ms < 0) timeout_ms = opts_.async_timeout_ms;
    if (int rc = submit_checks(op, flag, "transfer_async"); rc != kSuccess) return {rc, 0};
    std::shared_ptr<Link> link;
    if (int rc = find_link(remote, 1000, "transfer_async", &link, nullptr, &ts.last_link); rc != kSuccess)
      return {rc, 0};
    std::vector<rdma::Desc>& rd = ts.scratch;
    if (int rc = prepare(link, op, descs, n, start + milliseconds(1000), &rd); rc != kSuccess) return {rc, 0};
    return run_async(link, op, rd, user_data, flag, timeout_ms, start, "transfer_async", ts);
  } catch (const std::exception& e) {
    return {fail(kFailed, "transfer_async(" + remote + "): " + e.what()), 0};
  }
}

// ------------------------------------------------------------------- prepared descriptor lists
std::pair<int, uint64_t> Engine::prep_descs(const std::string& remote, const uint64_t* addr, const uint64_t* len,
                                            size_t n, int timeout_ms) {
  try {
    if (!ready()) return {fail(kFailed, "prep_descs: engine is not initialized"), 0};
    if (n == 0) return {fail(kParamInvalid, "prep_descs: no blocks"), 0};
    if (timeout_ms <= 0) return {fail(kParamInvalid, "prep_descs: timeout_in_millis must be > 0"), 0};
    auto list = std::make_shared<DescList>();
    list->addr.assign(addr, addr + n);
    list->len.assign(len, len + n);
    if (remote.empty()) {  // (a remote list's keys and flags are sized by resolve_remote_locked)
      list->key.resize(n);
      list->flags.resize(n);
      size_t bad = registry_.resolve_blocks(list->addr.data(), list->len.data(), n, list->key.data(),
                                            list->flags.data(), DescList::kLocalOk, &list->version);
      if (bad < n)
        return {fail(kParamInvalid, CallDesc("prep_descs").arg("block", bad).hex("addr", addr[bad]).arg("len", len[bad])
                                        .str() + ": empty, wrapping, or not inside a region registered here"),
                0};
    } else {
      std::shared_ptr<Link> link;
      if (int rc = find_link(remote, timeout_ms, "prep_descs", &link, &list->peer); rc != kSuccess) return {rc, 0};
      list->remote = true;
      auto resolve = [&] {
        std::lock_guard<util::Mutex> g(link->mu);
        list->link = link;
        return list->resolve_remote_locked(*link);
      };
      size_t bad = resolve();
      if (bad < n) {  // the peer may have registered since it last sent its list: ask once
        refresh_regions(link, Clock::now() + milliseconds(timeout_ms));
        bad = resolve();
      }
      if (bad < n)
        return {fail(kParamInvalid, CallDesc("prep_descs").arg("peer", list->peer).arg("block", bad)
                                        .hex("addr", addr[bad]).arg("len", len[bad]).str() +
                                        ": not inside a region the peer registered (for remote read or write)"),
                0};
    }
    const uint64_t h = lists_.add(std::move(list));
    if (!h) return {fail(kResourceExhausted, "prep_descs: too many prepared lists"), 0};
    return {ok(), h};
  } catch (const std::exception& e) {
    return {fail(kFailed, "prep_descs: " + std::string(e.what())), 0};
  }
}

int Engine::release_descs(uint64_t handle) {
  if (!ready()) return fail(kFailed, "release_descs: engine is not initialized");
  if (!lists_.remove(handle))
    return fail(kParamInvalid, "release_descs(handle=" + std::to_string(handle) + "): no such prepared list");
  return ok();
}

int Engine::build_prepped(TransferOp op, uint64_t local_list, const uint64_t* local_idx, uint64_t remote_list,
                          const uint64_t* remote_idx, size_t n, int timeout_ms, const char* call,
                          std::shared_ptr<Link>* link_out, std::vector<rdma::Desc>* out) {
  constexpr auto kParam = Metrics::Refused::kParam;
  if (n == 0) return refuse(kParam, fail(kParamInvalid, std::string(call) + ": no descriptors"));
  if (op != TransferOp::kRead && op != TransferOp::kWrite)
    return refuse(kParam, fail(kParamInvalid, std::string(call) + ": unknown op " + std::to_string(int(op))));
  auto L = lists_.get(local_list);
  if (!L || L->remote)
    return refuse(kParam, fail(kParamInvalid, CallDesc(call).arg("local_list", local_list).str() +
                                                  ": not a prepared list of ours"));
  auto R = lists_.get(remote_list);
  if (!R || !R->remote)
    return refuse(kParam, fail(kParamInvalid, CallDesc(call).arg("remote_list", remote_list).str() +
                                                  ": not a prepared list of a peer"));
  std::shared_ptr<Link>& link = *link_out;
  if (int rc = ensure_link(R->peer, timeout_ms, &link); rc != kSuccess) return rc;
  if (!link->path) return fail(kFailed, std::string(call) + ": link to " + link->key + " has no data transport");
  const uint8_t need = op == TransferOp::kWrite ? wire::kRemoteWrite : wire::kRemoteRead;
  const bool write = op == TransferOp::kWrite;
  out->resize(n);
  for (int attempt = 0;; ++attempt) {
    size_t bad = n;
    const char* why = nullptr;
    bool remote_access = false;  // why: a remote block lacks the access (a refresh may help)
    bool in_a_region = false;    // ... though it is inside a region (with other access)
    {
      std::lock_guard<std::mutex> gl(L->mu);
      std::lock_guard<std::mutex> gr(R->mu);
      // A (de)registration here, or a new region list or a new link there, since the lists were
      // resolved: resolve them again before trusting a key.
      if (L->version != registry_.version())
        registry_.resolve_blocks(L->addr.data(), L->len.data(), L->size(), L->key.data(), L->flags.data(),
                                 DescList::kLocalOk, &L->version);
      {
        std::lock_guard<util::Mutex> g(link->mu);
        if (R->link.lock() != link || R->version != link->remote_version) {
          R->resolve_remote_locked(*link);
          R->link = link;
        }
      }
      const size_t nl = L->size(), nr = R->size();
      const uint64_t* la = L->addr.data();
      const uint64_t* ll = L->len.data();
      const uint64_t* ra = R->addr.data();
      const uint64_t* rl = R->len.data();
      const uint32_t* rkeys = write ? R->wkey.data() : R->key.data();
      rdma::Desc* d = out->data();
      for (size_t i = 0; i < n; ++i) {
        const uint64_t li = local_idx[i], ri = remote_idx[i];
        if (li >= nl || ri >= nr) {
          bad = i, why = "index out of range";
          break;
        }
        if (ll[li] != rl[ri]) {
          bad = i, why = "the local and remote blocks differ in length";
          break;
        }
        if (!(L->flags[li] & DescList::kLocalOk)) {
          bad = i, why = "the local block is no longer inside a registered region";
          break;
        }
        if (!(R->flags[ri] & need)) {
          bad = i, remote_access = true;
          in_a_region = R->flags[ri] & (wire::kRemoteRead | wire::kRemoteWrite);
          why = write ? "the remote block is not inside a region the peer registered for remote write"
                               : "the remote block is not inside a region the peer registered for remote read";
          break;
        }
        d[i] = rdma::Desc{la[li], ra[ri], ll[li], rkeys[ri], L->key[li], true};
      }
    }
    if (!why) return kSuccess;
    // A remote block without the access: the peer may have registered since; ask once, then decide.
    if (attempt == 0 && remote_access) {
      refresh_regions(link, Clock::now() + milliseconds(std::max(1, timeout_ms)));
      continue;
    }
    const uint64_t li = local_idx[bad], ri = remote_idx[bad];
    metrics_.refused(in_a_region ? Metrics::Refused::kAccess : Metrics::Refused::kRange);
    return fail(kParamInvalid, CallDesc(call).arg("desc", bad).arg("local_idx", li).arg("remote_idx", ri)
                                   .arg("local_blocks", L->size()).arg("remote_blocks", R->size()).str() + ": " + why);
  }
}

int Engine::transfer_prepped_sync(TransferOp op, uint64_t local_list, const uint64_t* local_idx, uint64_t remote_list,
                                  const uint64_t* remote_idx, size_t n, int timeout_ms, int64_t flag) {
  const char* call = "transfer_prepped_sync";
  try {
    if (!ready()) return fail(kFailed, std::string(call) + ": engine is not initialized");
    if (timeout_ms <= 0)
      return refuse(Metrics::Refused::kParam,
                    fail(kParamInvalid, std::string(call) + ": timeout_in_millis must be > 0"));
    if (int rc = submit_checks(op, flag, call); rc != kSuccess) return rc;
    const auto deadline = Clock::now() + milliseconds(timeout_ms);
    std::shared_ptr<Link> link;
    ThreadState& ts = thread_state();
    std::vector<rdma::Desc>& rd = ts.scratch;
    if (int rc = build_prepped(op, local_list, local_idx, remote_list, remote_idx, n, timeout_ms, call, &link, &rd);
        rc != kSuccess)
      return rc;
    return run_sync(link, op, rd, deadline, timeout_ms, flag, call);
  } catch (const std::exception& e) {
    return fail(kFailed, std::string(call) + ": " + e.what());
  }
}

std::pair<int, uint64_t> Engine::transfer_prepped_async(TransferOp op, uint64_t local_list, const uint64_t* local_idx,
                                                        uint64_t remote_list, const uint64_t* remote_idx, size_t n,
                                                        uint64_t user_data, int64_t flag, int timeout_ms) {
  const char* call = "transfer_prepped_async";
  try {
    ThreadState& ts = thread_state();
    const auto start = ts.clock.now_at_least();
    if (!ready()) return {fail(kFailed, std::string(call) + ": engine is not initialized"), 0};
    if (timeout_ms < 0) timeout_ms = opts_.async_timeout_ms;
    if (int rc = submit_checks(op, flag, call); rc != kSuccess) return {rc, 0};
    std::shared_ptr<Link> link;
    std::vector<rdma::Desc>& rd = ts.scratch;
    if (int rc = build_prepped(op, local_list, local_idx, remote_list, remote_idx, n, 1000, call, &link, &rd);
        rc != kSuccess)
      return {rc, 0};
    return run_async(link, op, rd, user_data, flag, timeout_ms, start, call, ts);
  } catch (const std::exception& e) {
    return {fail(kFailed, std::string(call) + ": " + e.what()), 0};
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
    // Most waits in a windowed loop find their request already ended: one look at the table.
    if (auto res = requests_.status(req); res && res->status != TransferStatus::kWaiting)
      return {ok(), int(res->status)};
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
    if (ack->status == kSuccess) {
      metrics_.notify_sent();
      return ok();
    }
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

int Engine::fail_flag(const std::string& remote, uint32_t value, const std::string& reason, int timeout_ms) {
  try {
    if (!ready()) return fail(kFailed, "fail_flag: engine is not initialized");
    if (timeout_ms <= 0) return fail(kParamInvalid, "fail_flag: timeout_in_millis must be > 0");
    auto key = canonical(remote);
    if (!key) return fail(kParamInvalid, "fail_flag: \"" + remote + "\" is not an engine address");
    auto link = links_.find(*key);
    if (!link) return fail(kNotConnected, "fail_flag: not connected to " + *key);
    wire::Control f;
    f.type = wire::FrameType::kFlagFailed;
    f.status = value;
    f.text = reason.substr(0, kMaxNotifyBytes);
    try {
      link->send(f, Clock::now() + milliseconds(timeout_ms));
    } catch (const Error& e) {
      return fail(e.err() == ETIMEDOUT ? kTimeout : kFailed, "fail_flag to " + *key + ": " + e.what());
    }
    return ok();
  } catch (const std::exception& e) {
    return fail(kFailed, "fail_flag(" + remote + "): " + e.what());
  }
}

std::pair<int, std::vector<FlagFailure>> Engine::poll_flag_failures(size_t max) {
  if (!ready()) return {fail(kFailed, "poll_flag_failures: engine is not initialized"), {}};
  return {ok(), inbox_.poll_failures(max)};
}

std::pair<int, std::vector<FlagEvent>> Engine::wait_flags(size_t max, int timeout_ms) {
  if (!ready()) return {fail(kFailed, "wait_flags: engine is not initialized"), {}};
  std::vector<FlagEvent> out;
  if (!inbox_.wait_flags(max, timeout_ms, &out)) return {fail(kFailed, "wait_flags: engine finalized"), {}};
  return {ok(), std::move(out)};
}

}  // namespace hixl::engine
