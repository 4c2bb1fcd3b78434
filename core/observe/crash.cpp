#include "core/observe/crash.h"

#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>

namespace tessel::observe {

namespace {

char g_head[512];  // "<who>: fatal signal "
size_t g_head_len = 0;
// The handler's own stack, so that a stack overflow is reported too.
alignas(16) char g_alt_stack[1 << 16];

void write_all(const char* s, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w, n -= static_cast<size_t>(w);
  }
}
void write_str(const char* s) { write_all(s, std::strlen(s)); }

const char* name_of(int s) {
  switch (s) {
    case SIGSEGV:
      return "SIGSEGV, a bad memory access";
    case SIGBUS:
      return "SIGBUS, a bad memory access";
    case SIGILL:
      return "SIGILL, an instruction this CPU does not have";
    case SIGFPE:
      return "SIGFPE, an arithmetic fault";
    case SIGABRT:
      return "SIGABRT, aborted";
  }
  return "?";
}

void on_fatal(int s) {
  char num[16];
  int n = 0;
  for (int v = s; v > 0 && n < 15; v /= 10) num[n++] = static_cast<char>('0' + v % 10);
  write_all(g_head, g_head_len);
  while (n > 0) write_all(&num[--n], 1);
  write_str(" (");
  write_str(name_of(s));
  write_str("); native stack (addr2line -Cfpe BINARY OFFSET names a frame given as an offset):\n");
  void* frames[64];
  const int depth = backtrace(frames, 64);
  backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  std::signal(s, SIG_DFL);  // SA_RESETHAND did so already; the default action ends the process
  std::raise(s);
}

}  // namespace

void install_crash_report(const std::string& who) {
  std::snprintf(g_head, sizeof(g_head), "%s: fatal signal ", who.c_str());
  g_head_len = std::strlen(g_head);
  void* prime[1];
  backtrace(prime, 1);  // loads the unwinder now: the handler must not load a library
  stack_t alt{};
  alt.ss_sp = g_alt_stack, alt.ss_size = sizeof(g_alt_stack);
  sigaltstack(&alt, nullptr);
  struct sigaction sa {};
  sa.sa_handler = on_fatal;
  sa.sa_flags = SA_RESETHAND | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int s : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) sigaction(s, &sa, nullptr);
}

}  // namespace tessel::observe
