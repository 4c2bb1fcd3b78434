#include "engine/stop.h"

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "engine/config.h"
#include "parallel/comm.h"

namespace tessel {
namespace {

volatile std::sig_atomic_t g_signal = 0;
void on_signal(int s) { g_signal = s; }

constexpr const char* kKey = "tessel/stop_after_step";

int signal_number(const std::string& name) {
  static const std::map<std::string, int> known = {
      {"SIGTERM", SIGTERM}, {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGINT", SIGINT}};
  auto it = known.find(name);
  if (it == known.end())
    throw UserError("checkpoint.on_signal: unknown signal '" + name +
                    "' (SIGTERM, SIGUSR1, SIGUSR2 or SIGINT)");
  return it->second;
}

int64_t parse(const std::vector<uint8_t>& v) { return std::stoll(std::string(v.begin(), v.end())); }

}  // namespace

// One thread, one connection, the lookups in order. Shared with the thread, so that a thread
// blocked on a silent store can be left behind when this rank fails.
struct StopOnSignal::Asker {
  c10::intrusive_ptr<c10d::Store> store;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::packaged_task<int64_t()>> jobs;
  bool stop = false;

  static void loop(const std::shared_ptr<Asker>& a) {
    std::unique_lock<std::mutex> lock(a->mu);
    while (true) {
      a->cv.wait(lock, [&] { return a->stop || !a->jobs.empty(); });
      if (a->jobs.empty()) return;  // stopped
      auto job = std::move(a->jobs.front());
      a->jobs.pop_front();
      lock.unlock();
      job();  // an exception goes to the job's future
      lock.lock();
    }
  }
  std::future<int64_t> ask(std::function<int64_t(c10d::Store&)> fn) {
    std::packaged_task<int64_t()> job([s = store, fn = std::move(fn)] { return fn(*s); });
    auto f = job.get_future();
    {
      std::lock_guard<std::mutex> lock(mu);
      jobs.push_back(std::move(job));
    }
    cv.notify_one();
    return f;
  }
};

StopOnSignal::StopOnSignal(const std::vector<std::string>& signals, c10d::Store* store,
                           double timeout_s)
    : timeout_s_(timeout_s) {
  for (const auto& name : signals) {
    signals_.push_back(signal_number(name));
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigaction(signals_.back(), &sa, nullptr);
  }
  if (store && !signals_.empty()) {
    asker_ = std::make_shared<Asker>();
    asker_->store = store->clone();  // a connection of its own
    std::thread([a = asker_] { Asker::loop(a); }).detach();
  }
}

StopOnSignal::~StopOnSignal() {
  for (int s : signals_) std::signal(s, SIG_DFL);
  if (!asker_) return;
  {
    std::lock_guard<std::mutex> lock(asker_->mu);
    asker_->stop = true;
  }
  asker_->cv.notify_one();  // the thread ends after its current lookup (it owns what it uses)
}

int StopOnSignal::signal() const { return g_signal; }

int64_t StopOnSignal::answer(std::future<int64_t> f, int64_t step, const char* what) {
  if (f.wait_for(std::chrono::duration<double>(timeout_s_)) != std::future_status::ready)
    throw parallel::CommError(fmt::format(
        "after step {}: the rendezvous store did not answer {} within parallel.timeout_s ({} s)",
        step, what, timeout_s_));
  try {
    return f.get();
  } catch (const std::exception& e) {
    throw parallel::CommError(
        fmt::format("after step {}: the rendezvous store failed {}: {}", step, what, e.what()));
  }
}

bool StopOnSignal::stop_after(int64_t step, bool last) {
  if (signals_.empty()) return false;
  if (!asker_) return g_signal != 0;  // one process: now
  if (stop_at_ < 0 && g_signal != 0) {
    // The first rank to ask sets the step; a later one keeps it (compare-and-set on absence).
    // This rank waits for it: the key must exist before this rank starts the next step.
    const std::string mine = std::to_string(step + 3);
    stop_at_ = answer(asker_->ask([mine](c10d::Store& s) {
      return parse(s.compareSet(kKey, {}, std::vector<uint8_t>(mine.begin(), mine.end())));
    }),
                      step, "the stop-on-signal request");
  } else if (stop_at_ < 0 && pending_.valid()) {
    stop_at_ = answer(std::move(pending_), step, "the stop-on-signal lookup");
  }
  if (stop_at_ < 0 && !last)
    pending_ =
        asker_->ask([](c10d::Store& s) { return s.check({kKey}) ? parse(s.get(kKey)) : -1; });
  return stop_at_ >= 0 && step >= stop_at_;
}

}  // namespace tessel
