// Save on signal: the signals in checkpoint.on_signal (SIGTERM and SIGUSR1 by default, what Slurm
// sends before preemption) make every rank finish its current step, save a checkpoint and exit
// with kExitStopped. A signal reaches the ranks at different moments, so they agree on the step
// through the rendezvous store: the first rank to see one publishes "stop after step s+3" before
// it starts step s+1. Every step's collectives link any two ranks within two hops (the
// model-parallel group, then the data group), so no rank finishes step s+2 before that key exists.
// Each rank looks the key up once per step, overlapped with the next step: the lookup sent after
// step t is read after step t+1, so a rank reads the key by step s+3 at the latest, and every rank
// stops after the same step.
//
// The lookups run on a thread with a connection of its own, and this rank waits for an answer at
// most parallel.timeout_s: a rank 0 that stopped (SIGSTOP, a hung host) leaves its store silent,
// and a plain TCPStore call would wait for it for ever.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

namespace tessel {

/// Exit code of a run stopped by a signal after saving a checkpoint (sysexits' EX_TEMPFAIL: run
/// the same command again to resume).
constexpr int kExitStopped = 75;

class StopOnSignal {
 public:
  /// Installs handlers for `signals` (names as in checkpoint.on_signal). `store`: null in a
  /// one-process run; `timeout_s`: the longest wait for the store's answer (parallel.timeout_s).
  StopOnSignal(const std::vector<std::string>& signals, c10d::Store* store, double timeout_s);
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  /// After step `step` (`last`: the run's last step, no lookup is sent after it): true when
  /// every rank stops after this step. Throws parallel::CommError when the store does not answer
  /// within the timeout.
  bool stop_after(int64_t step, bool last = false);
  /// The signal that asked (0: none seen by this rank).
  int signal() const;

 private:
  struct Asker;  // the lookup thread and its connection
  int64_t answer(std::future<int64_t> f, int64_t step, const char* what);
  std::vector<int> signals_;
  std::shared_ptr<Asker> asker_;  // null in a one-process run or without signals
  double timeout_s_;
  std::future<int64_t> pending_;  // the lookup sent after the previous step
  int64_t stop_at_ = -1;
};

}  // namespace tessel
