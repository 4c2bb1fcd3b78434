// The portable bundle's binaries ask for no C library symbol newer than glibc 2.28 (torch 2.11's
// own floor), although they are built against Debian 11's glibc 2.31 (tools/portable/bundle.sh).
// Built only with TESSEL_GLIBC_COMPAT, whose link options (--wrap) send every reference the
// binaries make to these symbols here:
//  - exp, exp2, log, log2, pow: glibc 2.29 gave them new symbol versions (faster code, no SVID
//    error handling); their first versions, present in every glibc, compute the same values.
//  - pthread_cond_clockwait (glibc 2.30), which GCC 10's std::condition_variable calls for a
//    steady-clock deadline: the real one where the running glibc has it, else the deadline moved
//    to the realtime clock and pthread_cond_timedwait, as libstdc++ did before 2.30.
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <time.h>

// Every glibc's first version of these: 2.2.5 on x86-64, 2.17 (its first release) on aarch64.
#if defined(__aarch64__)
#define TESSEL_GLIBC_BASE "GLIBC_2.17"
#else
#define TESSEL_GLIBC_BASE "GLIBC_2.2.5"
#endif
__asm__(".symver exp,exp@" TESSEL_GLIBC_BASE);
__asm__(".symver exp2,exp2@" TESSEL_GLIBC_BASE);
__asm__(".symver log,log@" TESSEL_GLIBC_BASE);
__asm__(".symver log2,log2@" TESSEL_GLIBC_BASE);
__asm__(".symver pow,pow@" TESSEL_GLIBC_BASE);

extern "C" {

double __wrap_exp(double x) { return exp(x); }
double __wrap_exp2(double x) { return exp2(x); }
double __wrap_log(double x) { return log(x); }
double __wrap_log2(double x) { return log2(x); }
double __wrap_pow(double x, double y) { return pow(x, y); }

int __wrap_pthread_cond_clockwait(pthread_cond_t* cond, pthread_mutex_t* mutex, clockid_t clock,
                                  const struct timespec* deadline) {
  using Clockwait = int (*)(pthread_cond_t*, pthread_mutex_t*, clockid_t, const struct timespec*);
  static const auto real =
      reinterpret_cast<Clockwait>(dlvsym(RTLD_DEFAULT, "pthread_cond_clockwait", "GLIBC_2.30"));
  if (real != nullptr) return real(cond, mutex, clock, deadline);
  if (clock == CLOCK_REALTIME) return pthread_cond_timedwait(cond, mutex, deadline);
  constexpr long long kNs = 1000000000LL;
  struct timespec on_clock {
  }, now{};
  clock_gettime(clock, &on_clock);
  clock_gettime(CLOCK_REALTIME, &now);
  long long left =
      (deadline->tv_sec - on_clock.tv_sec) * kNs + (deadline->tv_nsec - on_clock.tv_nsec);
  long long at = now.tv_sec * kNs + now.tv_nsec + (left > 0 ? left : 0);
  struct timespec real_deadline {};
  real_deadline.tv_sec = static_cast<time_t>(at / kNs);
  real_deadline.tv_nsec = static_cast<long>(at % kNs);
  return pthread_cond_timedwait(cond, mutex, &real_deadline);
}

}  // extern "C"
