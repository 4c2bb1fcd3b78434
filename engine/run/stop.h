// Save on signal: the signals in checkpoint.on_signal (SIGTERM and SIGUSR1 by default, what Slurm
// sends before preemption) make every rank save a checkpoint after the same step and exit with
// kExitStopped. A signal may reach only some ranks, at different moments, and under NCCL the host
// of one rank may be steps ahead of another's (collectives return before they finish), so no rank
// can decide alone, and no side channel (the store) can say "stop after step s" in time for a
// rank already past s.
//
// The ranks agree through a collective every rank joins on every step: the gradient-norm
// all-reduce carries each rank's vote (1 when it has seen a signal). The summed votes of step t
// are the same number on every rank; each rank reads them after step t+1 and, when positive,
// stops after step t+1. Reading them needs no host sync on step t+1's work: on CUDA the sum is
// copied to pinned memory behind an event when step t is queued, and the host waits for that
// event only once step t+1 has been queued (it has long fired by then).
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

namespace tessel::run {

/// Exit code of a run stopped by a signal after saving a checkpoint (sysexits' EX_TEMPFAIL: run
/// the same command again to resume).
constexpr int kExitStopped = 75;

/// Notes `signals` (names as in checkpoint.on_signal) from now on instead of acting on them, and
/// gives back their default action to the ones watched before but not named now (a signal of
/// those already seen is raised again). Called first thing with the default list and again once
/// the plan is read. A signal that arrives during start-up (loading the plan, waiting for the
/// other ranks, reading and indexing the data, building the model, reading a checkpoint) stops
/// every rank at the next piece of start-up work, before step 1, with nothing to save and
/// kExitStopped (core/observe/interrupt.h); one that arrives after start-up's last look is seen by
/// the first step's vote, and the run stops after its first steps with a checkpoint. Either way
/// the exit code is kExitStopped, so that Slurm requeues the job.
void watch_stop_signals(const std::vector<std::string>& signals);

class StopOnSignal {
 public:
  /// Installs handlers for `signals` (names as in checkpoint.on_signal); the votes live on
  /// `device`.
  StopOnSignal(const std::vector<std::string>& signals, const torch::Device& device);
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  /// This rank's vote for the step being built: 1 when it has seen a signal, else 0 (an fp32
  /// scalar on the device, to add into an all-reduce over every rank). No host sync.
  torch::Tensor vote() const;
  /// After a step whose all-reduced votes are `votes` (undefined: no vote was taken): true when
  /// every rank stops after this step, i.e. when the previous step's votes were positive. The
  /// same answer on every rank, since every rank passes the same sums.
  bool stop_after(const torch::Tensor& votes);
  /// The signal that asked (0: none seen by this rank).
  int signal() const;

 private:
  struct Readback;  // the previous step's votes: pinned host copy and event (CUDA)
  std::vector<int> signals_;
  torch::Device device_;
  std::unique_ptr<Readback> previous_;
};

}  // namespace tessel::run
