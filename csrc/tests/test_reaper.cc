// verbs::Reaper alone (no device): release() returns at once while an object's destructor blocks
// (as ibv_destroy_qp does on Soft-RoCE while the link is stuck); objects are released in the order
// handed over, in one thread that is not the caller's; pending() and drain() tell where it is; a
// slow release (logged to stderr) does not hold up the next; a test reaper's destructor releases what
// is left.
#include <chrono>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "check.h"
#include "verbs/reaper.h"

using namespace hixl;
using std::chrono::milliseconds;

namespace {

struct Log {
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
};

struct Blocker {  // its destructor waits for `go`, then notes itself
  Blocker(std::shared_future<void> g, Log* l, int i) : go(std::move(g)), log(l), id(i) {}
  Blocker(const Blocker&) = delete;
  std::shared_future<void> go;
  Log* log;
  int id;
  ~Blocker() {
    go.wait();
    std::lock_guard<std::mutex> g(log->mu);
    log->order.push_back(id);
    log->threads.push_back(std::this_thread::get_id());
  }
};

void releases_in_the_background_in_order() {
  Log log;
  std::promise<void> go;
  std::shared_future<void> f = go.get_future().share();
  verbs::Reaper r;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) r.release(std::make_shared<Blocker>(f, &log, i), "blocker " + std::to_string(i));
  r.release(nullptr, "nothing");  // ignored
  // The caller is not held up by the blocked destructor.
  CHECK(std::chrono::steady_clock::now() - t0 < milliseconds(500));
  CHECK_EQ(r.pending(), size_t(3));
  CHECK(!r.drain(milliseconds(100)));  // still blocked
  {
    std::lock_guard<std::mutex> g(log.mu);
    CHECK(log.order.empty());
  }
  go.set_value();
  CHECK(r.drain(milliseconds(10000)));
  CHECK_EQ(r.pending(), size_t(0));
  std::lock_guard<std::mutex> g(log.mu);
  CHECK((log.order == std::vector<int>{0, 1, 2}));
  CHECK_EQ(log.threads.size(), size_t(3));
  for (auto id : log.threads) CHECK(id != std::this_thread::get_id() && id == log.threads[0]);
}

void a_reapers_destructor_releases_what_is_left() {
  Log log;
  std::promise<void> go;
  go.set_value();
  std::shared_future<void> f = go.get_future().share();
  {
    verbs::Reaper r;
    for (int i = 0; i < 50; ++i) r.release(std::make_shared<Blocker>(f, &log, i), "b");
  }
  std::lock_guard<std::mutex> g(log.mu);
  CHECK_EQ(log.order.size(), size_t(50));
}

void a_slow_release_does_not_hold_up_the_next() {
  // The warning goes to stderr; here only that a release slower than kSlow still completes and the
  // reaper goes on with the next one.
  Log log;
  std::promise<void> go;
  std::shared_future<void> f = go.get_future().share();
  verbs::Reaper r;
  r.release(std::make_shared<Blocker>(f, &log, 7), "ibv_destroy_qp(qpn 7, device test)");
  std::promise<void> now;
  now.set_value();
  r.release(std::make_shared<Blocker>(now.get_future().share(), &log, 8), "next");
  std::this_thread::sleep_for(verbs::Reaper::kSlow + milliseconds(100));
  go.set_value();
  CHECK(r.drain(milliseconds(10000)));
  std::lock_guard<std::mutex> g(log.mu);
  CHECK((log.order == std::vector<int>{7, 8}));
}

void the_process_reaper_is_one() {
  CHECK(&verbs::Reaper::instance() == &verbs::Reaper::instance());
  Log log;
  std::promise<void> go;
  go.set_value();
  verbs::Reaper::instance().release(std::make_shared<Blocker>(go.get_future().share(), &log, 1), "one");
  CHECK(verbs::Reaper::instance().drain(milliseconds(10000)));
  std::lock_guard<std::mutex> g(log.mu);
  CHECK_EQ(log.order.size(), size_t(1));
}

}  // namespace

int main() {
  releases_in_the_background_in_order();
  a_reapers_destructor_releases_what_is_left();
  a_slow_release_does_not_hold_up_the_next();
  the_process_reaper_is_one();
  return report("test_reaper");
}
