// Save on signal: the signals in checkpoint.on_signal (SIGTERM and SIGUSR1 by default, what Slurm
// sends before preemption) make every rank finish its current step, save a checkpoint and exit
// with kExitStopped. A signal reaches the ranks at different moments, so they agree on the step
// through the rendezvous store: the first rank to see one publishes "stop after step s+2". Every
// step's collectives link any two ranks within two hops (the model-parallel group, then the
// data group), so no rank can finish step s+2 before that key exists, and every rank stops after
// the same step. The per-step check is one store lookup (no device sync).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace tessel {

/// Exit code of a run stopped by a signal after saving a checkpoint (sysexits' EX_TEMPFAIL: run
/// the same command again to resume).
constexpr int kExitStopped = 75;

class StopOnSignal {
 public:
  /// Installs handlers for `signals` (names as in checkpoint.on_signal). `store`: null in a
  /// one-process run.
  StopOnSignal(const std::vector<std::string>& signals, c10d::Store* store);
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  /// After step `step`: true when every rank stops after this step.
  bool stop_after(int64_t step);
  /// The signal that asked (0: none seen by this rank).
  int signal() const;

 private:
  std::vector<int> signals_;
  c10d::Store* store_;
  int64_t stop_at_ = -1;
};

}  // namespace tessel
