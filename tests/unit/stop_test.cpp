#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "engine/stop.h"
#include "parallel/comm.h"

namespace tessel {
namespace {

using Clock = std::chrono::steady_clock;

void put(c10d::Store& s, const std::string& key, const std::string& v) {
  s.set(key, std::vector<uint8_t>(v.begin(), v.end()));
}

// Another rank published "stop after step 7" before this rank's lookup after step 5: the lookup
// sent after step t is read after step t+1, so this rank learns it after step 6 and stops after
// step 7, not one step early or late.
TEST(StopOnSignal, ReadsTheAgreedStepThroughTheStore) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  StopOnSignal stop({"SIGUSR2"}, store.get(), 5.0);
  for (int64_t step = 1; step <= 4; ++step) EXPECT_FALSE(stop.stop_after(step)) << step;
  put(*store, "tessel/stop_after_step", "7");
  EXPECT_FALSE(stop.stop_after(5));
  EXPECT_FALSE(stop.stop_after(6));
  EXPECT_TRUE(stop.stop_after(7));
  EXPECT_EQ(stop.signal(), 0);
}

// A store that stops answering lookups (rank 0 stopped with SIGSTOP, or its host hung) until
// released.
class SilentStore : public c10d::HashStore {
 public:
  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::intrusive_ptr<c10d::Store>::reclaim_copy(this);
  }
  bool check(const std::vector<std::string>& keys) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return released_; });
    return HashStore::check(keys);
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
};

// It used to wait for ever (a plain TCPStore lookup has no deadline): now parallel.timeout_s at
// most, then a communication error that the failure path diagnoses.
TEST(StopOnSignal, ASilentStoreFailsTheStepWithinTheTimeout) {
  auto store = c10::make_intrusive<SilentStore>();
  {
    StopOnSignal stop({"SIGUSR2"}, store.get(), 0.5);
    EXPECT_FALSE(stop.stop_after(1));  // sends the lookup; nothing waits yet
    const auto t0 = Clock::now();
    try {
      stop.stop_after(2);
      FAIL() << "no error";
    } catch (const parallel::CommError& e) {
      EXPECT_NE(
          std::string(e.what()).find("after step 2: the rendezvous store did not answer the "
                                     "stop-on-signal lookup within parallel.timeout_s (0.5 s)"),
          std::string::npos)
          << e.what();
    }
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_GE(took, 0.45);
    EXPECT_LT(took, 3.0);
  }  // the destructor does not wait for the blocked lookup
  store->release();
}

}  // namespace
}  // namespace tessel
