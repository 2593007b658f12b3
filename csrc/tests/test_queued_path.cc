// A queued data path (transport/data_path.h) behind a request that does not end: a synchronous
// request waits for the one before it until its own deadline, never longer, and ends TIMEOUT.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "check.h"
#include "transport/data_path.h"

using namespace hixl;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// A queued path whose first request runs until released.
class StuckPath : public transport::QueuedPath {
 public:
  ~StuckPath() override { stop_worker(); }
  const char* name() const override { return "stuck"; }
  void release() {
    std::lock_guard<std::mutex> g(mu);
    go = true;
    cv.notify_all();
  }
  std::atomic<int> ran{0};

 protected:
  transport::Result execute(transport::Op, const std::vector<transport::Desc>&, Clock::time_point deadline) override {
    if (ran++ == 0) {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait_until(lk, deadline, [&] { return go; });
    }
    return transport::Result(transport::Status::kCompleted);
  }

 private:
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
};

void a_request_waits_for_the_one_before_until_its_own_deadline() {
  StuckPath p;
  std::vector<transport::Desc> d(1);
  const uint64_t first = p.submit(transport::Op::kWrite, d, milliseconds(-1), std::nullopt);  // async: no deadline
  while (p.ran.load() == 0) std::this_thread::sleep_for(milliseconds(1));
  auto t0 = Clock::now();
  const uint64_t second = p.submit(transport::Op::kWrite, d, milliseconds(200), std::nullopt);  // sync
  const double took = ms_since(t0);
  transport::Result r = p.status(second);
  CHECK(r.status == transport::Status::kTimeout);
  CHECK(r.error.find("the link's request before this one still ran") != std::string::npos);
  CHECK(took >= 190 && took < 2000);
  p.release();
  CHECK(p.wait(first, milliseconds(2000)).status == transport::Status::kCompleted);
}

}  // namespace

int main() {
  a_request_waits_for_the_one_before_until_its_own_deadline();
  return report("test_queued_path");
}
