#include "core/observe/interrupt.h"

#include <fmt/format.h>

#include <atomic>
#include <csignal>

namespace tessel::observe {
namespace {

volatile std::sig_atomic_t g_signal = 0;
std::atomic<bool> g_starting{true};

}  // namespace

void note_signal(int s) { g_signal = s; }
int signal_seen() { return g_signal; }
void forget_signal() { g_signal = 0; }

bool starting() { return g_starting.load(); }
void end_start_up() { g_starting.store(false); }

Interrupted::Interrupted(int signal, const std::string& what)
    : std::runtime_error(what), signal_(signal) {}

std::string signal_name(int s) {
  switch (s) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGUSR2:
      return "SIGUSR2";
    default:
      return fmt::format("signal {}", s);
  }
}

void stop_if_signalled(const std::string& doing) {
  const int s = g_signal;
  if (s == 0 || !starting()) return;
  throw Interrupted(s, fmt::format("stopped on {} during start-up ({}), before step 1: nothing was "
                                   "trained, so nothing is saved; run the same command again",
                                   signal_name(s), doing));
}

void stop_as_another_rank_did(const std::string& what) {
  throw Interrupted(g_signal != 0 ? g_signal : SIGTERM, "stopping because " + what);
}

}  // namespace tessel::observe
