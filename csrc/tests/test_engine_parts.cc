// The engine's parts, each alone (no device, no peer, no engine): the registry, the inbox, the
// link table, the handshake limits, the request table (over a scripted data path), the slab behind
// the request tables, the lock of the request path (util::Mutex) and the prepared descriptor lists. Their behaviour through the engine is covered by pytest.
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "check.h"
#include "engine/desc_lists.h"
#include "engine/handshakes.h"
#include "engine/inbox.h"
#include "engine/link_table.h"
#include "engine/registry.h"
#include "engine/requests.h"
#include "transport/shm_fence.h"
#include "util/id_slab.h"
#include "util/mutex.h"
#include "util/recent_clock.h"
#include "util/ticks.h"

using namespace hixl;
using namespace hixl::engine;

namespace {

constexpr uint32_t kRW = wire::kRemoteRead | wire::kRemoteWrite;

// The same-host fence: a slot is open with a fresh tag; closing revokes it and waits for copies in
// progress (a copy that never ends: false after the bound, and the slot is not handed out again).
void fence() {
  transport::FenceOwner f;
  auto [s1, t1] = f.open();
  auto [s2, t2] = f.open();
  CHECK(s1 != s2 && t1 != 0 && t2 != 0 && t1 != t2);
  auto* slots = static_cast<transport::FenceSlot*>(
      ::mmap(nullptr, transport::kFenceBytes, PROT_READ | PROT_WRITE, MAP_SHARED, f.fd(), 0));  // as a peer maps it
  CHECK(slots != MAP_FAILED && slots[s1].tag.load() == t1);
  slots[s1].inflight.fetch_add(1);  // a peer's copy in progress
  std::thread done([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    slots[s1].inflight.fetch_sub(1);
  });
  auto t0 = std::chrono::steady_clock::now();
  CHECK(f.close(s1, std::chrono::milliseconds(5000)));
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(40) && slots[s1].tag.load() == 0);
  done.join();
  auto [s3, t3] = f.open();  // the drained slot again, with another tag
  CHECK(s3 == s1 && t3 != t1 && t3 != 0);
  slots[s2].inflight.fetch_add(1);  // a copy that never ends (its peer died inside it)
  CHECK(!f.close(s2, std::chrono::milliseconds(20)));
  auto [s4, t4] = f.open();
  CHECK(s4 != s2 && t4 != t2);
  ::munmap(slots, transport::kFenceBytes);
}

void registry() {
  Registry r;  // no protection domain: regions without MRs (shm/tcp only)
  bool changed0 = false;
  CHECK(r.add(0x1000, 16, MemType::kHost, 3, &changed0).first == kFailed && !changed0);  // no fence yet
  r.open_fence();
  CHECK(r.fence_fd() >= 0);
  std::vector<uint8_t> a(4096), b(4096);
  const uint64_t pa = uint64_t(a.data()), pb = uint64_t(b.data());
  bool changed = false;
  // Bad arguments: PARAM_INVALID, nothing registered.
  CHECK_EQ(r.add(0, 16, MemType::kHost, kRW, &changed).first, kParamInvalid);
  CHECK_EQ(r.add(pa, 0, MemType::kHost, kRW, &changed).first, kParamInvalid);
  CHECK_EQ(r.add(UINT64_MAX - 4, 16, MemType::kHost, kRW, &changed).first, kParamInvalid);
  CHECK_EQ(r.add(pa, 16, MemType(7), kRW, &changed).first, kParamInvalid);
  CHECK_EQ(r.add(pa, 16, MemType::kHost, 4, &changed).first, kParamInvalid);
  CHECK(!changed && r.size() == 0);
  uint64_t v0 = 0;
  r.regions(&v0);
  auto [rc, h1] = r.add(pa, a.size(), MemType::kHost, kRW, &changed);
  CHECK(rc == kSuccess && h1 != 0 && changed);
  // The same range again: the same handle, nothing new for peers; with other access: refused.
  auto again = r.add(pa, a.size(), MemType::kHost, kRW, &changed);
  CHECK(again.first == kSuccess && again.second == h1 && !changed);
  CHECK_EQ(r.add(pa, a.size(), MemType::kHost, wire::kRemoteRead, &changed).first, kParamInvalid);
  auto [rc2, h2] = r.add(pb, b.size(), MemType::kHost, wire::kRemoteRead, &changed);
  CHECK(rc2 == kSuccess && h2 != h1);
  uint64_t v1 = 0;
  auto regions = r.regions(&v1);
  CHECK(regions.size() == 2 && v1 > v0);
  CHECK(r.extents().empty());  // no memfd behind plain heap memory
  // Local resolution: inside one region; the first bad descriptor is named.
  std::vector<rdma::Desc> out;
  auto resolve = [&](std::vector<OpDesc> d) { return r.resolve_local(d.data(), d.size(), &out); };
  CHECK_EQ(resolve({{pa, 0x100, 64}, {pb + 8, 0x200, 8}}), kSuccess);
  CHECK(out.size() == 2 && out[1].local_addr == pb + 8 && out[1].length == 8 && out[1].has_lkey);
  CHECK_EQ(resolve({{pa, 0x100, 64}, {pa + 4090, 0x200, 8}}), kParamInvalid);
  CHECK(detail::last_error().find("desc=1") != std::string::npos);
  CHECK_EQ(resolve({{pa, 0x100, 0}}), kParamInvalid);
  // Prepared blocks: every block resolved (keys and flags), the first bad one named; the version
  // tells a list to resolve again after a (de)registration.
  {
    uint64_t addrs[3] = {pa, pb + 8, pa + 4090}, lens[3] = {64, 8, 8}, ver = 0;
    uint32_t keys[3];
    uint8_t flags[3];
    CHECK_EQ(r.resolve_blocks(addrs, lens, 3, keys, flags, 4, &ver), size_t(2));
    CHECK(flags[0] == 4 && flags[1] == 4 && flags[2] == 0 && ver == r.version());
    lens[2] = 0;
    CHECK_EQ(r.resolve_blocks(addrs, lens, 2, keys, flags, 4, &ver), size_t(2));
  }
  // Access for tcp peers: b is read-only; a request spanning both regions holds both.
  auto allows = [&](uint64_t addr, uint64_t len, bool write) {
    transport::ServedMemory::Use u;
    transport::Range rg{addr, len};
    bool ok = r.begin(&u, &rg, 1, write);
    if (ok) r.end(&u);
    return ok;
  };
  CHECK(allows(pa, 64, true) && allows(pb, 64, false) && allows(pa, 64, false));
  CHECK(!allows(pb, 64, true) && !allows(pa + 4000, 200, true) && !allows(pa, 0, false));
  {
    transport::ServedMemory::Use u;
    transport::Range rg[3] = {{pa, 8}, {pb, 8}, {pa + 8, 8}};
    CHECK(r.begin(&u, rg, 3, false) && u.regions.size() == 2);
    r.end(&u);
  }
  // Removal cuts a request that holds the region and returns once it let go, not before; a request
  // holding another region is left alone.
  {
    transport::ServedMemory::Use held_b, held_a;
    std::atomic<int> cuts{0};
    std::atomic<bool> ended{false};
    held_b.cut = [&] { ++cuts; };
    held_a.cut = [&] { cuts += 100; };
    transport::Range rb{pb, 8}, ra{pa, 8};
    CHECK(r.begin(&held_b, &rb, 1, false) && r.begin(&held_a, &ra, 1, true));
    std::thread t([&] {
      while (cuts.load() == 0) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ended = true;
      r.end(&held_b);
    });
    CHECK(r.remove(h2, &changed) == kSuccess && changed);
    CHECK(ended.load() && cuts.load() == 1 && held_b.was_cut && !held_a.was_cut);
    t.join();
    r.end(&held_a);
    transport::Range rb2{pb, 8};
    CHECK(!r.begin(&held_b, &rb2, 1, false));  // gone for new requests
  }
  // Removal: idempotent for handles issued, refused for others; peers learn of it once.
  CHECK(r.remove(h2, &changed) == kSuccess && !changed);
  CHECK_EQ(r.remove(h2 + 100, &changed), kParamInvalid);
  CHECK_EQ(r.remove(0, &changed), kParamInvalid);
  uint64_t v2 = 0;
  CHECK(r.regions(&v2).size() == 1 && v2 > v1);
  CHECK(!allows(pb, 64, false));
  // Closed: everything dropped, no more registrations.
  r.close();
  CHECK(r.size() == 0 && r.add(pb, 64, MemType::kHost, kRW, &changed).first == kFailed && !changed);
}

bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1;
}

void inbox() {
  Inbox in;
  CHECK_EQ(in.flag_fd(), -1);
  in.open("test");
  CHECK(in.flag_fd() >= 0 && !readable(in.flag_fd()));
  // Notifies: per-peer limit on unread ones, kept until they are read; oversize refused.
  for (size_t i = 0; i < kMaxUnreadNotifies; ++i) CHECK_EQ(in.offer_notify("a", "n", std::to_string(i)), kSuccess);
  CHECK_EQ(in.offer_notify("a", "n", "over"), kResourceExhausted);
  CHECK_EQ(in.offer_notify("b", "n", "other peer"), kSuccess);
  CHECK_EQ(in.offer_notify("b", std::string(kMaxNotifyBytes + 1, 'x'), "m"), kParamInvalid);
  auto got = in.take_notifies();
  CHECK(got.size() == kMaxUnreadNotifies + 1 && got.front().msg == "0" && got.back().msg == "other peer");
  CHECK_EQ(in.offer_notify("a", "n", "after reading"), kSuccess);
  CHECK(in.take_notifies().size() == 1 && in.take_notifies().empty());
  // Flags: the eventfd is readable exactly while flags are pending.
  in.push_flag("a", 1);
  in.push_flag("b", 2);
  CHECK(readable(in.flag_fd()));
  auto f = in.poll_flags(1);
  CHECK(f.size() == 1 && f[0].peer == "a" && f[0].value == 1 && readable(in.flag_fd()));
  f = in.poll_flags(10);
  CHECK(f.size() == 1 && f[0].value == 2 && !readable(in.flag_fd()));
  std::vector<FlagEvent> w;
  auto t0 = std::chrono::steady_clock::now();
  CHECK(in.wait_flags(4, 30, &w) && w.empty());  // timeout: nothing
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(25));
  std::thread pusher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    in.push_flag("c", 3);
  });
  CHECK(in.wait_flags(4, 10000, &w) && w.size() == 1 && w[0].value == 3);
  pusher.join();
  // close() wakes every waiter, and later waits return at once.
  std::atomic<int> woken{0};
  std::thread n([&] { in.wait_notifies(-1); ++woken; });
  std::thread fl([&] {
    std::vector<FlagEvent> x;
    if (!in.wait_flags(1, -1, &x)) ++woken;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  in.close();
  n.join();
  fl.join();
  CHECK_EQ(woken.load(), 2);
  CHECK(!in.wait_flags(1, -1, &w));
}

std::shared_ptr<Link> make_link(const std::string& key, uint64_t id, bool initiator, uint64_t instance = 7) {
  auto l = std::make_shared<Link>();
  l->key = key;
  l->id = id;
  l->initiator = initiator;
  l->peer_instance = instance;
  return l;
}

void link_table() {
  LinkTable t;
  const std::string self = "10.0.0.1:5000", peer = "10.0.0.2:5000";
  int code = 0;
  CHECK(t.claim_incoming(self, self, true, 1, &code).find("own name") != std::string::npos && code == kParamInvalid);
  // Our connect and the peer's at once: the smaller name's outgoing connect wins.
  CHECK_EQ(t.claim_outgoing(peer), kSuccess);
  CHECK_EQ(t.claim_outgoing(peer), kAlreadyConnected);
  CHECK(!t.claim_incoming(peer, self, true, 1, &code).empty() && code == kAlreadyConnected);  // self < peer
  CHECK(t.claim_incoming(self, peer, true, 1, &code).empty() && code == kSuccess);  // seen from the larger name
  t.release_incoming(self);
  t.release_outgoing(peer);
  // An incoming handshake holds the name until its link is published.
  CHECK(t.claim_incoming(peer, self, true, 7, &code).empty());
  CHECK(!t.claim_incoming(peer, self, true, 7, &code).empty() && code == kAlreadyConnected);
  CHECK_EQ(t.claim_outgoing(peer), kAlreadyConnected);
  auto l1 = make_link(peer, 11, false);
  CHECK(t.publish(l1, nullptr) && t.find(peer) == l1);
  CHECK(t.claim_incoming(peer, self, true, 7, &code).empty());  // claim ended: a reconnect supersedes
  auto l2 = make_link(peer, 12, false);
  CHECK(!t.publish(l2, nullptr));  // without a superseded slot: refused
  std::shared_ptr<Link> old;
  CHECK(t.publish(l2, &old) && old == l1 && t.find(peer) == l2);
  // A client-only peer: a second instance from the same address is refused.
  const std::string client = "10.0.0.3";
  CHECK(t.claim_incoming(client, self, false, 1, &code).empty());
  CHECK(t.publish(make_link(client, 21, false, 1), nullptr));
  CHECK(t.claim_incoming(client, self, false, 2, &code).find("client-only") != std::string::npos);
  // Unpublishing an old link does nothing to the current one; the peer's end is remembered once.
  t.unpublish(l1, "superseded", false);
  CHECK(t.find(peer) == l2);
  std::string why;
  CHECK(!t.take_closed(peer, &why));
  t.unpublish(l2, "peer disconnected", false);
  CHECK(!t.find(peer) && t.take_closed(peer, &why) && why == "peer disconnected" && !t.take_closed(peer, &why));
  // Our own disconnect leaves no record, and clears one the peer's goodbye left first.
  auto l3 = make_link(peer, 13, true);
  CHECK(t.publish(l3, nullptr));
  t.unpublish(l3, "peer's goodbye", false);
  t.unpublish(l3, "disconnected by us", true);
  CHECK(!t.take_closed(peer, &why));
  CHECK(t.keys() == std::vector<std::string>{client});
  // Closed: every link handed over, nothing published or claimed any more.
  auto all = t.close();
  CHECK(all.size() == 1 && t.empty());
  CHECK(!t.publish(make_link(peer, 14, true), nullptr));
  CHECK_EQ(t.claim_outgoing(peer), kFailed);
  CHECK(t.claim_incoming(peer, self, true, 7, &code).find("finalizing") != std::string::npos && code == kFailed);
}

// find() answers a caller's repeated lookup from its last answer (LinkLookup) while the table did not
// change: that answer never outlives a change, is never another table's, and keeps no link alive.
void link_table_lookups() {
  LinkTable t1, t2;
  LinkLookup last;  // this thread's, as the engine keeps one per thread
  const std::string peer = "10.0.0.2:5000";
  auto a = make_link(peer, 1, true), b = make_link(peer, 2, true);
  CHECK(t1.publish(a, nullptr) && t2.publish(b, nullptr));
  CHECK(t1.find(peer, &last) == a && last.key == peer && last.link.lock() == a);
  for (int i = 0; i < 3; ++i) CHECK(t1.find(peer, &last) == a && t2.find(peer, &last) == b);
  CHECK(!t1.find("10.0.0.9:5000", &last) && t1.find(peer, &last) == a);
  // Another thread's change is seen by this thread's next lookup.
  auto c = make_link(peer, 3, true);
  std::thread([&] {
    std::shared_ptr<Link> old;
    CHECK(t1.publish(c, &old) && old == a);
    t1.unpublish(a, "superseded", false);
  }).join();
  CHECK(t1.find(peer, &last) == c);
  std::thread([&] { t1.unpublish(c, "gone", false); }).join();
  CHECK(!t1.find(peer, &last));
  // A link taken out and dropped by everyone else is gone, though this thread looked it up last.
  std::weak_ptr<Link> wb = b;
  CHECK(t2.find(peer, &last) == b);
  t2.unpublish(b, "gone", true);
  b.reset();
  CHECK(wb.expired() && !t2.find(peer, &last));
  // Threads looking up while another publishes and unpublishes: each answer is a link of that name
  // that was in the table, never one of another table.
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r)
    readers.emplace_back([&] {
      LinkLookup mine;
      while (!stop) {
        auto l = t1.find(peer, &mine);
        if (l && (l->key != peer || l->id < 100)) ++bad;
      }
    });
  for (uint64_t i = 100; i < 2100; ++i) {
    auto l = make_link(peer, i, true);
    std::shared_ptr<Link> old;
    CHECK(t1.publish(l, &old));
    if (old) t1.unpublish(old, "superseded", false);
  }
  stop = true;
  for (auto& r : readers) r.join();
  CHECK_EQ(bad.load(), 0);
  auto newest = t1.find(peer, &last);
  CHECK(newest && newest->id == 2099);
}

// A data path whose requests end when the test says so.
class FakePath : public transport::DataPath {
 public:
  const char* name() const override { return "fake"; }
  uint64_t submit(transport::Op, const std::vector<transport::Desc>&, std::chrono::milliseconds, transport::Flag) override {
    std::lock_guard<std::mutex> g(mu);
    st[next] = TransferStatus::kWaiting;
    return next++;
  }
  rdma::RequestResult status(uint64_t req) override {
    std::lock_guard<std::mutex> g(mu);
    auto it = st.find(req);
    if (it == st.end()) return {TransferStatus::kFailed, "unknown"};
    rdma::RequestResult r{it->second, it->second == TransferStatus::kFailed ? "path failed" : ""};
    if (it->second != TransferStatus::kWaiting) st.erase(it);
    return r;
  }
  rdma::RequestResult wait(uint64_t req, std::chrono::milliseconds) override { return status(req); }
  bool wait_done(uint64_t req, std::chrono::milliseconds) override {
    std::lock_guard<std::mutex> g(mu);
    auto it = st.find(req);
    return it == st.end() || it->second != TransferStatus::kWaiting;
  }
  void close() override {
    std::lock_guard<std::mutex> g(mu);
    for (auto& [k, v] : st) v = TransferStatus::kFailed;
  }
  void end(uint64_t req, TransferStatus s) {
    std::lock_guard<std::mutex> g(mu);
    st[req] = s;
  }
  std::mutex mu;
  std::map<uint64_t, TransferStatus> st;
  uint64_t next = 1;
};

void metrics() {
  Metrics m;
  // Durations in cycle-counter ticks (util/ticks.h).
  auto microseconds = [](int64_t us) { return uint64_t(double(us) * 1000.0 / util::ns_per_tick()); };
  m.transfer_ended(TransferOp::kRead, wire::Transport::kRdma, TransferStatus::kCompleted, 4096, 2, microseconds(7));
  m.transfer_ended(TransferOp::kRead, wire::Transport::kRdma, TransferStatus::kFailed, 4096, 2, microseconds(30));
  m.transfer_ended(TransferOp::kWrite, wire::Transport::kShm, TransferStatus::kTimeout, 8, 1, microseconds(60000000));
  // WAITING is not an end:
  m.transfer_ended(TransferOp::kWrite, wire::Transport::kShm, TransferStatus::kWaiting, 8, 1, microseconds(1));
  m.transfer_ended(TransferOp::kWrite, wire::Transport::kNone, TransferStatus::kCompleted, 8, 1, microseconds(1));
  m.link_closed(Metrics::Cause::kHeartbeat);
  m.refused(Metrics::Refused::kParam);
  m.refused(Metrics::Refused::kLimit);
  m.refused(Metrics::Refused::kAccess);
  m.notify_sent();
  const Metrics::Snapshot s = m.snapshot();
  CHECK(s.transfers[0][0][0] == 1 && s.transfers[0][0][1] == 1 && s.transfers[1][1][2] == 1);
  CHECK(s.bytes[0][0] == 4096);  // completed bytes only
  CHECK(s.descriptors[0][0] == 4 && s.descriptors[1][1] == 1);
  uint64_t writes = 0;
  for (auto& per_status : s.transfers[1])
    for (uint64_t v : per_status) writes += v;
  CHECK(writes == 1);  // neither WAITING nor a link without a transport counted
  CHECK(s.seconds_buckets[0][0] == 1 && s.seconds_buckets[0][2] == 1);  // 7 us <= 10 us; 30 us in (25, 50]
  CHECK(s.seconds_buckets[1][Metrics::kBuckets.size()] == 1);          // 60 s: +Inf
  CHECK(s.seconds_sum[0] > 36e-6 && s.seconds_sum[0] < 38e-6);
  CHECK(s.links_closed[int(Metrics::Cause::kHeartbeat)] == 1);
  CHECK(s.refused[int(Metrics::Refused::kParam)] == 1 && s.refused[int(Metrics::Refused::kLimit)] == 1 &&
        s.refused[int(Metrics::Refused::kAccess)] == 1 && s.refused[int(Metrics::Refused::kRange)] == 0);
  CHECK(s.notifies_sent == 1 && s.notifies_received == 0);
  CHECK(std::string(Metrics::cause_name(int(Metrics::Cause::kAsyncEvent))) == "async_event");
  CHECK(std::string(Metrics::refused_name(int(Metrics::Refused::kRange))) == "range");
}

void requests() {
  Metrics m;
  Requests rq(m);
  auto link = make_link("10.0.0.2:5000", 1, true);
  auto path = std::make_shared<FakePath>();
  link->path = path;
  link->transport = wire::Transport::kTcp;
  const auto never = Clock::time_point::max();
  const uint64_t p1 = path->submit(transport::Op::kWrite, {}, std::chrono::milliseconds(-1), {});
  const uint64_t r1 = rq.add(link, p1, 42, 0, never, {TransferOp::kWrite, 3, 300, util::ticks()});
  CHECK(rq.status(r1)->status == TransferStatus::kWaiting);
  CHECK(rq.path_of(r1).first == path && rq.path_of(r1).second == p1);
  auto all = rq.all(10, false);
  CHECK(all.size() == 1 && all[0].user_data == 42 && all[0].status == int(TransferStatus::kWaiting));
  CHECK(rq.all(10, true).empty());  // skip_waiting
  // A terminal status is reported exactly once.
  path->end(p1, TransferStatus::kCompleted);
  CHECK(rq.status(r1)->status == TransferStatus::kCompleted);
  CHECK(!rq.status(r1).has_value() && !rq.path_of(r1).first);
  auto counted = [&] {  // the table's own counts (kept under its lock), as the engine merges them
    Metrics::Snapshot s = m.snapshot();
    rq.add_counts_to(&s);
    return s;
  };
  {  // counted once, when reported: write over tcp, completed, its bytes and descriptors
    const Metrics::Snapshot s = counted();
    CHECK(s.transfers[1][2][0] == 1 && s.bytes[1][2] == 300 && s.descriptors[1][2] == 3);
    CHECK(m.snapshot().transfers[1][2][0] == 0);  // not in Metrics' own atomics
  }
  // A failure says why, when its link went down.
  const uint64_t r2 = rq.add(link, path->submit(transport::Op::kRead, {}, std::chrono::milliseconds(-1), {}), 0, 0, never);
  {
    std::lock_guard<util::Mutex> g(link->mu);
    link->down = true;
    link->down_reason = "heartbeat";
  }
  path->close();
  auto f = rq.status(r2);
  CHECK(f->status == TransferStatus::kFailed && f->error.find("was closed: heartbeat") != std::string::npos);
  CHECK(counted().transfers[1][2][1] == 1 && counted().bytes[1][2] == 300);  // failed: no bytes
  // Deadlines: one that ended in time is left alone; the others expire, their link is aborted once,
  // they stay WAITING until the abort ends, then TIMEOUT (confirmed) or FAILED (not).
  auto link2 = make_link("10.0.0.3:5000", 2, true);
  auto path2 = std::make_shared<FakePath>();
  link2->path = path2;
  const auto past = Clock::now() - std::chrono::milliseconds(1);
  const uint64_t q_done = path2->submit(transport::Op::kWrite, {}, std::chrono::milliseconds(-1), {});
  path2->end(q_done, TransferStatus::kCompleted);
  const uint64_t a = rq.add(link2, q_done, 1, 10, past);
  const uint64_t b = rq.add(link2, path2->submit(transport::Op::kWrite, {}, std::chrono::milliseconds(-1), {}), 2, 10, past);
  const uint64_t c = rq.add(link2, path2->submit(transport::Op::kWrite, {}, std::chrono::milliseconds(-1), {}), 3, 10, past);
  const uint64_t later = rq.add(link2, path2->submit(transport::Op::kWrite, {}, std::chrono::milliseconds(-1), {}), 4, 60000,
                                Clock::now() + std::chrono::seconds(60));
  auto to_abort = rq.expire(Clock::now());
  CHECK(to_abort.size() == 1 && to_abort[0] == link2);
  CHECK(rq.expire(Clock::now()).empty());
  CHECK(rq.status(a)->status == TransferStatus::kCompleted);
  path2->close();  // the abort closes the path: the expired requests still wait for its verdict
  CHECK(rq.status(b)->status == TransferStatus::kWaiting);
  rq.finish_expired(link2, true);
  auto tb = rq.status(b);
  CHECK(tb->status == TransferStatus::kTimeout && tb->error.find("not complete within 10 ms") != std::string::npos &&
        tb->error.find("confirmed") != std::string::npos);
  CHECK(rq.status(c)->status == TransferStatus::kTimeout);
  CHECK(rq.status(later)->status == TransferStatus::kFailed);  // not expired: the closed path's FAILED
  // Unconfirmed abort: FAILED.
  auto link3 = make_link("10.0.0.4:5000", 3, true);
  auto path3 = std::make_shared<FakePath>();
  link3->path = path3;
  const uint64_t d = rq.add(link3, path3->submit(transport::Op::kWrite, {}, std::chrono::milliseconds(-1), {}), 5, 10, past);
  CHECK(rq.expire(Clock::now()).size() == 1);
  rq.finish_expired(link3, false);
  auto td = rq.status(d);
  CHECK(td->status == TransferStatus::kFailed && td->error.find("did not confirm") != std::string::npos);
  rq.clear();
  CHECK(rq.all(10, false).empty());
  // Ids keep growing across clear(): one issued before is never issued again.
  CHECK(rq.add(link3, path3->submit(transport::Op::kWrite, {}, std::chrono::milliseconds(-1), {}), 6, 0, never) > d);
}

// A path whose teardown takes long (the kernel holding a queue pair whose packets sit on a stalled
// NIC): it waits in its destructor until released, at most 10 s.
class SlowTeardownPath final : public FakePath {
 public:
  SlowTeardownPath(std::promise<void>* entered, std::shared_future<void> release, bool* released_in_time)
      : entered_(entered), release_(std::move(release)), released_in_time_(released_in_time) {}
  ~SlowTeardownPath() override {
    entered_->set_value();
    *released_in_time_ = release_.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  }

 private:
  std::promise<void>* entered_;
  std::shared_future<void> release_;
  bool* released_in_time_;
};

// The request that ends holds the last reference to its closed link: the link's teardown runs in
// that status call, and must not hold up the status of every other request meanwhile.
void requests_release_links_outside_the_lock() {
  Metrics m;
  Requests rq(m);
  const auto never = Clock::time_point::max();
  std::promise<void> entered, release;
  bool released_in_time = false;
  uint64_t slow_req;
  {
    auto link = make_link("10.0.0.5:5000", 5, true);
    auto path = std::make_shared<SlowTeardownPath>(&entered, release.get_future().share(), &released_in_time);
    link->path = path;
    const uint64_t p = path->submit(transport::Op::kWrite, {}, std::chrono::milliseconds(-1), {});
    path->end(p, TransferStatus::kFailed);
    slow_req = rq.add(link, p, 1, 0, never);
  }  // from here the request holds the link's last reference
  auto other = make_link("10.0.0.6:5000", 6, true);
  auto other_path = std::make_shared<FakePath>();
  other->path = other_path;
  const uint64_t p = other_path->submit(transport::Op::kWrite, {}, std::chrono::milliseconds(-1), {});
  other_path->end(p, TransferStatus::kCompleted);
  const uint64_t other_req = rq.add(other, p, 2, 0, never);
  std::thread ender([&] { CHECK(rq.status(slow_req)->status == TransferStatus::kFailed); });
  entered.get_future().wait();  // the ender is inside the link's teardown
  auto st = rq.status(other_req);  // before the teardown is released
  auto listed = rq.all(10, false);
  release.set_value();
  ender.join();
  CHECK(st && st->status == TransferStatus::kCompleted && listed.empty());
  CHECK(released_in_time);  // false: the calls above waited for the teardown
}

void handshakes() {
  Handshakes h;
  std::string refusal;
  for (int i = 0; i < kMaxHandshakesPerHost; ++i) CHECK(h.acquire("10.0.0.9", "10.0.0.9:1", "e", &refusal));
  CHECK(!h.acquire("10.0.0.9", "10.0.0.9:2", "e", &refusal));
  CHECK(refusal.find("too many handshakes") != std::string::npos && refusal.find("10.0.0.9") != std::string::npos);
  refusal.clear();
  CHECK(!h.acquire("10.0.0.9", "10.0.0.9:3", "e", &refusal) && refusal.empty());  // one warning a second
  CHECK(h.acquire("10.0.0.8", "10.0.0.8:1", "e", &refusal));  // another address still gets in
  h.release("10.0.0.9");
  CHECK(h.acquire("10.0.0.9", "10.0.0.9:4", "e", &refusal));
  CHECK_EQ(h.serving(), kMaxHandshakesPerHost + 1);
  // close() shuts down a socket in a handshake, and one that registers afterwards.
  int sv[2], sv2[2];
  CHECK(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0 && ::socketpair(AF_UNIX, SOCK_STREAM, 0, sv2) == 0);
  oob::Socket a(sv[0]), b(sv[1]), c(sv2[0]), d(sv2[1]);
  char byte;
  {
    Handshakes::Guard g(h, &a);
    h.close();
    CHECK(::recv(b.fd(), &byte, 1, 0) == 0);  // the peer sees the end at once
  }
  Handshakes::Guard g2(h, &c);
  CHECK(::recv(d.fd(), &byte, 1, 0) == 0);
}

// IdSlab: ids never repeat, grow with issue order, a stale id (its slot reused) is not found, and
// references stay valid while slots are added.
void id_slab() {
  util::IdSlab<std::string> s;
  const uint64_t a = s.add("a"), b = s.add("b");
  CHECK(a != 0 && b > a && s.size() == 2);
  std::string* pa = s.find(a);
  for (int i = 0; i < 10000; ++i) s.erase(s.add(std::to_string(i)));  // grows and reuses slots
  CHECK(pa == s.find(a) && *pa == "a");  // not moved by the adds
  s.erase(a);
  CHECK(!s.find(a) && s.size() == 1);
  const uint64_t c = s.add("c");  // reuses a's slot under a new id
  CHECK(c > b && (c & util::IdSlab<std::string>::kIndexMask) == (a & util::IdSlab<std::string>::kIndexMask));
  CHECK(!s.find(a) && *s.find(c) == "c");
  CHECK(!s.find(0) && !s.find(uint64_t(1) << 60));
  s.erase(a);  // stale: no effect
  CHECK(s.size() == 2 && *s.find(b) == "b");
  size_t seen = 0;
  s.for_each([&](uint64_t, std::string&) { ++seen; });
  CHECK_EQ(seen, size_t(2));
  // emplace(): filled in place; a reused slot holds what erase() left (here: T()).
  auto [d, pd] = s.emplace();
  CHECK(d > c && pd && pd->empty() && s.find(d) == pd && s.size() == 3);
  *pd = "d";
  s.erase(d);
  auto [e, pe] = s.emplace();
  CHECK(e > d && pe == pd && pe->empty());
  // Across many chunks of slots: every value found where it was put, none moved, all erased.
  std::vector<std::pair<uint64_t, std::string*>> many;
  for (int i = 0; i < 1000; ++i) {
    const uint64_t id = s.add(std::to_string(i));
    many.push_back({id, s.find(id)});
  }
  CHECK_EQ(s.size(), size_t(1003));
  bool all_there = true;
  for (size_t i = 0; i < many.size(); ++i)
    all_there &= s.find(many[i].first) == many[i].second && *many[i].second == std::to_string(i);
  CHECK(all_there);
  for (auto& [id, v] : many) s.erase(id);
  seen = 0;
  s.for_each([&](uint64_t, std::string&) { ++seen; });
  CHECK(seen == 3 && s.size() == 3 && !s.find(many[500].first));
  s.clear();
  CHECK(s.size() == 0 && !s.find(b) && s.add("again") != 0);
}

// util::RecentClock: never before steady_clock's now, at most kSlack after it, on one CPU and when
// the thread moves between CPUs, across sleeps, and when calls come just under and over kReuse
// apart; and back-to-back calls reuse one clock read (x86: the same value comes back).
void recent_clock() {
  using std::chrono::steady_clock;
  using std::chrono::microseconds;
  util::RecentClock rc;
  cpu_set_t all;
  const bool pin = sched_getaffinity(0, sizeof all, &all) == 0 && CPU_COUNT(&all) > 1;
  std::vector<int> cpus;
  for (int c = 0; pin && c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &all)) cpus.push_back(c);
  int reused = 0, bad = 0;
  steady_clock::time_point prev{};
  for (int i = 0; i < 20000 && bad < 3; ++i) {
    if (pin && i % 100 == 0) {  // move to another CPU: its counter may differ from the last one's
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[size_t(i / 100) % cpus.size()], &one);
      sched_setaffinity(0, sizeof one, &one);
    }
    if (i % 1000 == 999) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (i % 50 == 3) {  // calls about kReuse apart
      const auto until = steady_clock::now() + microseconds(i % 2 ? 400 : 600);
      while (steady_clock::now() < until) {
      }
    }
    const auto before = steady_clock::now();
    const auto t = rc.now_at_least();
    const auto after = steady_clock::now();
    if (t == prev) ++reused;
    prev = t;
    if (t < before || t > after + util::RecentClock::kSlack) ++bad;
  }
  if (pin) sched_setaffinity(0, sizeof all, &all);
  CHECK(bad == 0);
#if defined(__x86_64__)
  CHECK(reused > 1000);
#endif
}

// util::Mutex: mutual exclusion under contention (more threads than cores, so holders are
// preempted and waiters sleep on the futex), try_lock, and a condition_variable_any over it.
void mutex() {
  util::Mutex mu;
  uint64_t counter = 0;  // plain: only the lock keeps the increments whole
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 200000; ++i) {
        std::lock_guard<util::Mutex> g(mu);
        ++counter;
      }
    });
  for (auto& t : ts) t.join();
  CHECK_EQ(counter, uint64_t(800000));
  CHECK(mu.try_lock());
  bool other_got_it = true;
  std::thread([&] { other_got_it = mu.try_lock(); }).join();
  CHECK(!other_got_it);
  mu.unlock();
  std::thread([&] {
    other_got_it = mu.try_lock();
    if (other_got_it) mu.unlock();
  }).join();
  CHECK(other_got_it);
  // Ping-pong over a condition variable: every hand-over is seen, none lost.
  std::condition_variable_any cv;
  int turn = 0;
  const int rounds = 2000;
  std::thread pong([&] {
    for (int i = 0; i < rounds; ++i) {
      std::unique_lock<util::Mutex> lk(mu);
      cv.wait(lk, [&] { return turn % 2 == 1; });
      ++turn;
      cv.notify_all();
    }
  });
  for (int i = 0; i < rounds; ++i) {
    std::unique_lock<util::Mutex> lk(mu);
    cv.wait(lk, [&] { return turn % 2 == 0; });
    ++turn;
    cv.notify_all();
  }
  pong.join();
  CHECK_EQ(turn, 2 * rounds);
}

// A remote list resolves each block against the peer's regions by access, keeps going past a block
// without a region (only transfers using it are refused) and names the first such block.
void desc_lists() {
  Link link;
  link.remote.assign({{0x1000, 0x1000, 11, wire::kRemoteRead | wire::kRemoteWrite, 0},
                      {0x4000, 0x1000, 22, wire::kRemoteRead, 1}});
  link.remote_version = 7;
  auto l = std::make_shared<DescList>();
  l->remote = true;
  l->addr = {0x1000, 0x4800, 0x3000, 0x1ff8};
  l->len = {64, 64, 64, 16};
  CHECK_EQ(l->resolve_remote_locked(link), size_t(2));
  CHECK(l->flags[0] == (wire::kRemoteRead | wire::kRemoteWrite) && l->key[0] == 11 && l->wkey[0] == 11);
  CHECK(l->flags[1] == wire::kRemoteRead && l->key[1] == 22);  // read-only region: no write key
  CHECK(l->flags[2] == 0 && l->flags[3] == 0 && l->version == 7);  // none; crosses the region's end
  DescLists lists;
  const uint64_t h = lists.add(l);
  CHECK(h && lists.get(h) == l && lists.size() == 1);
  CHECK(lists.remove(h) && !lists.remove(h) && !lists.get(h));
}

}  // namespace

int main() {
  id_slab();
  mutex();
  recent_clock();
  desc_lists();
  fence();
  registry();
  inbox();
  link_table();
  link_table_lookups();
  handshakes();
  metrics();
  requests();
  requests_release_links_outside_the_lock();
  return report("test_engine_parts");
}
