#include "engine/run/stop.h"

#include <ATen/cuda/CUDAEvent.h>
#include <torch/torch.h>

#include <algorithm>
#include <csignal>
#include <map>
#include <optional>

#include "core/observe/interrupt.h"
#include "core/plan/config.h"

namespace tessel::run {
namespace {

// A second Ctrl-C while a stop is pending ends the process at once (the user means it), as
// Python's and torchrun's do; other signals repeat harmlessly. Async-signal-safe calls only.
void on_signal(int s) {
  if (s == SIGINT && observe::signal_seen() == SIGINT) {
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
    return;
  }
  observe::note_signal(s);  // start-up's long parts look there too (core/observe/interrupt.h)
}

int signal_number(const std::string& name) {
  static const std::map<std::string, int> known = {
      {"SIGTERM", SIGTERM}, {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGINT", SIGINT}};
  auto it = known.find(name);
  if (it == known.end())
    throw plan::UserError("checkpoint.on_signal: unknown signal '" + name +
                          "' (SIGTERM, SIGUSR1, SIGUSR2 or SIGINT)");
  return it->second;
}

std::vector<int>& watched() {
  static std::vector<int> w;
  return w;
}

}  // namespace

void watch_stop_signals(const std::vector<std::string>& signals) {
  std::vector<int> now;
  for (const auto& name : signals) now.push_back(signal_number(name));
  for (int s : watched())
    if (std::find(now.begin(), now.end(), s) == now.end()) {
      std::signal(s, SIG_DFL);
      if (observe::signal_seen() == s) {  // seen, but this plan does not stop on it: its default
        observe::forget_signal();         // action now
        std::raise(s);
      }
    }
  for (int s : now) {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigaction(s, &sa, nullptr);
  }
  watched() = now;
}

// One step's summed votes on their way to the host. On the CPU the sum is already there; on CUDA
// a copy into pinned memory is queued behind the all-reduce, and an event marks its end.
struct StopOnSignal::Readback {
  torch::Tensor host;
  std::optional<at::cuda::CUDAEvent> done;

  explicit Readback(const torch::Tensor& votes) {
    if (!votes.is_cuda()) {
      host = votes.detach().clone();
      return;
    }
    host = torch::empty({}, votes.options().device(torch::kCPU).pinned_memory(true));
    host.copy_(votes.detach(), /*non_blocking=*/true);
    done.emplace();
    done->record();
  }
  double read() {
    if (done) done->synchronize();
    return host.item<double>();
  }
};

StopOnSignal::StopOnSignal(const std::vector<std::string>& signals, const torch::Device& device)
    : device_(device) {
  for (const auto& name : signals) signals_.push_back(signal_number(name));
  watch_stop_signals(signals);  // a signal seen during start-up stays seen
}

StopOnSignal::~StopOnSignal() {
  // The default actions back, without raising a signal already acted on (the run saved and stops).
  for (int s : watched()) std::signal(s, SIG_DFL);
  watched().clear();
}

int StopOnSignal::signal() const { return observe::signal_seen(); }

torch::Tensor StopOnSignal::vote() const {
  return torch::full({}, observe::signal_seen() != 0 ? 1.0 : 0.0,
                     torch::TensorOptions().dtype(torch::kFloat32).device(device_));
}

bool StopOnSignal::stop_after(const torch::Tensor& votes) {
  if (signals_.empty()) return false;
  // Read the previous step's sum first (its event fired long ago), then queue this step's.
  const bool stop = previous_ && previous_->read() > 0;
  previous_ = votes.defined() ? std::make_unique<Readback>(votes) : nullptr;
  return stop;
}

}  // namespace tessel::run
