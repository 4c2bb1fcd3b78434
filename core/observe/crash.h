// A crash that says where: on a fatal signal the process writes which program and rank died, of
// which signal, and its native stack to stderr, then dies of the same signal (its exit status
// and core dump are what they would have been). A crash on one rank of many, in CI or on a
// cluster, leaves a stack to read instead of a bare "Segmentation fault".
#pragma once

#include <string>

namespace tessel::observe {

/// Installs the report for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT (abort: also an uncaught
/// exception's std::terminate), naming `who` (the program, and its rank under a launcher). The
/// frames are written as glibc's backtrace_symbols_fd gives them (the binary's own as
/// offsets: `addr2line -Cfpe BINARY OFFSET` names them); nothing is allocated in the handler.
void install_crash_report(const std::string& who);

}  // namespace tessel::observe
