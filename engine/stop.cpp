#include "engine/stop.h"

#include <csignal>
#include <cstring>
#include <map>

#include "engine/config.h"

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

}  // namespace

StopOnSignal::StopOnSignal(const std::vector<std::string>& signals, c10d::Store* store)
    : store_(store) {
  for (const auto& name : signals) {
    signals_.push_back(signal_number(name));
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigaction(signals_.back(), &sa, nullptr);
  }
}

StopOnSignal::~StopOnSignal() {
  for (int s : signals_) std::signal(s, SIG_DFL);
}

int StopOnSignal::signal() const { return g_signal; }

bool StopOnSignal::stop_after(int64_t step) {
  if (signals_.empty()) return false;
  if (!store_) return g_signal != 0;  // one process: now
  if (stop_at_ < 0 && g_signal != 0) {
    // The first rank to ask sets the step; a later one keeps it (compare-and-set on absence).
    const std::string mine = std::to_string(step + 2);
    store_->compareSet(kKey, {}, std::vector<uint8_t>(mine.begin(), mine.end()));
  }
  if (stop_at_ < 0 && (g_signal != 0 || store_->check({kKey}))) {
    const auto got = store_->get(kKey);
    stop_at_ = std::stoll(std::string(got.begin(), got.end()));
  }
  return stop_at_ >= 0 && step >= stop_at_;
}

}  // namespace tessel
