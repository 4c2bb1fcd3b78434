// A stop signal during start-up. The run's handlers (engine/run/stop.h) note a signal here; once
// the run steps, the ranks agree on it through the step's vote and save before stopping. Before
// that nothing is trained and nothing needs saving, so start-up's long parts (waiting for the
// other ranks, scanning and indexing the data, reading a checkpoint) look here between pieces of
// work and end the process at once with the stop's exit code, rather than finish minutes of
// start-up only to stop after the first step.
#pragma once

#include <stdexcept>
#include <string>

namespace tessel::observe {

/// Notes signal `s` (async-signal-safe: called from a signal handler).
void note_signal(int s);
/// The last stop signal noted (0: none).
int signal_seen();
/// Forgets a noted signal (a signal the plan does not stop on, given back its default action).
void forget_signal();

/// Whether the process is still starting: stop_if_signalled acts only then. True from the start;
/// the run ends it just before its first step's vote exists.
bool starting();
void end_start_up();

/// A stop signal seen during start-up: main exits with the stop's code, nothing saved.
class Interrupted : public std::runtime_error {
 public:
  Interrupted(int signal, const std::string& what);
  int signal() const { return signal_; }

 private:
  int signal_;
};

/// During start-up, throws Interrupted naming `doing` (e.g. "indexing data.path a.bin") when a
/// stop signal was noted. Cheap (one load): call it between pieces of long work.
void stop_if_signalled(const std::string& doing);
/// The same, for a signal another rank saw (`what`: its message): every rank stops alike.
[[noreturn]] void stop_as_another_rank_did(const std::string& what);

/// "SIGTERM" for SIGTERM, etc.
std::string signal_name(int s);

}  // namespace tessel::observe
