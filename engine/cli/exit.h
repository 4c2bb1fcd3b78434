// How Tessel's programs end: with their status, without the static destructors. Every file,
// thread and communicator of the command is closed by the time main() has its status, and
// LibTorch's destructors deregister its thousands of operators one by one: a quarter of a second
// of a core for each process (27% of the CPU time of an 8-rank test run, 2026-11-30), and a test
// suite starts hundreds.
#pragma once

#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>

namespace tessel::cli {

/// Flushes stdio and spdlog, then ends the process with `status`.
[[noreturn]] inline void exit_without_teardown(int status) {
  std::fflush(nullptr);
  spdlog::shutdown();
  std::_Exit(status);
}

}  // namespace tessel::cli
