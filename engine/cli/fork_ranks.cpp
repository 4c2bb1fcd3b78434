#include "engine/cli/fork_ranks.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace tessel::cli {
namespace {

[[noreturn]] void refuse(const std::string& why) {
  std::fprintf(stderr, "tessel-train: error: TESSEL_TEST_FORK_RANKS: %s\n", why.c_str());
  std::exit(2);
}

// In the child: the rank's environment and output, then back to main.
void become_rank(int rank, pid_t parent) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(137);  // the parent died before the line above
  const std::string r = std::to_string(rank);
  setenv("RANK", r.c_str(), 1);
  setenv("LOCAL_RANK", r.c_str(), 1);
  unsetenv("TESSEL_TEST_FORK_RANKS");
  if (const char* dir = std::getenv("TESSEL_TEST_FORK_LOGS")) {
    const std::string path = std::string(dir) + "/rank" + r + ".log";
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      std::perror(path.c_str());
      _exit(2);
    }
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
  }
}

int exit_code(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// In the parent: waits for every rank; the first failure's code, the rest killed 60 s after it.
[[noreturn]] void wait_for(std::vector<pid_t> ranks) {
  using Clock = std::chrono::steady_clock;
  int code = 0;
  bool killed = false;
  Clock::time_point deadline{};
  for (size_t left = ranks.size(); left > 0;) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, code == 0 ? 0 : WNOHANG);  // blocks until a failure
    if (pid < 0) break;
    if (pid > 0) {
      --left;
      for (size_t r = 0; r < ranks.size(); ++r)
        if (ranks[r] == pid) {
          ranks[r] = 0;
          if (exit_code(status) != 0)
            std::fprintf(stderr, "tessel-train: rank %zu exited %d\n", r, exit_code(status));
        }
      if (exit_code(status) != 0 && code == 0) {
        code = exit_code(status);
        deadline = Clock::now() + std::chrono::seconds(60);
      }
    } else if (!killed && Clock::now() >= deadline) {
      for (pid_t p : ranks)
        if (p > 0) kill(p, SIGKILL);
      killed = true;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::fflush(nullptr);
  _exit(code);
}

}  // namespace

void fork_ranks_if_asked() {
  const char* n = std::getenv("TESSEL_TEST_FORK_RANKS");
  if (!n) return;
  char* end = nullptr;
  const long world = std::strtol(n, &end, 10);
  if (*n == '\0' || *end != '\0' || world < 1 || world > 4096)
    refuse(std::string("'") + n + "' is not a number of ranks from 1 to 4096");
  std::fflush(nullptr);
  const pid_t parent = getpid();
  std::vector<pid_t> ranks;
  for (long r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) return become_rank(static_cast<int>(r), parent);
    if (pid < 0) {
      std::perror("tessel-train: fork");
      for (pid_t p : ranks) kill(p, SIGKILL);
      std::exit(1);
    }
    ranks.push_back(pid);
  }
  wait_for(std::move(ranks));
}

}  // namespace tessel::cli
