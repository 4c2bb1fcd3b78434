#include "launcher/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>

#include "engine/run/stop.h"
#include "launcher/coordinator.h"
#include "parallel/world.h"

extern char** environ;

namespace tessel::launcher {
namespace {

volatile std::sig_atomic_t g_signal = 0;
void on_signal(int s) { g_signal = s; }

using Clock = std::chrono::steady_clock;

struct Worker {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  int out = -1;         // read end of the worker's stdout+stderr
  std::string partial;  // output after the last newline
  FILE* log = nullptr;
  bool running = false;
  int status = 0;
};

std::string host_name() {
  char h[256] = {0};
  gethostname(h, sizeof h - 1);
  return h;
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  return "stopped (status " + std::to_string(status) + ")";
}

// Exit code 2 is Tessel's error in the plan or the input (a UserError): the same command fails the
// same way again, so it ends the job at once whatever --max-restarts says. The failure the
// launchers share says so in these words.
constexpr int kExitUserError = 2;
constexpr const char* kNoRestart = "an error in the plan or its inputs: restarting cannot help";
bool user_error(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == kExitUserError; }

// A worker that saved a checkpoint on a signal and exited kExitStopped did not fail.
bool stopped(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == run::kExitStopped; }
bool failed(int status) {
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0) && !stopped(status);
}

// The worker's environment: ours, with torchrun's contract on top.
std::vector<std::string> worker_env(const Options& o, const Worker& w, int round) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  env["RANK"] = std::to_string(w.rank);
  env["LOCAL_RANK"] = std::to_string(w.local_rank);
  env["WORLD_SIZE"] = std::to_string(o.nnodes * o.nproc_per_node);
  env["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc_per_node);
  env["GROUP_RANK"] = std::to_string(o.node_rank);
  env["MASTER_ADDR"] = o.master_addr;
  env["MASTER_PORT"] = std::to_string(o.master_port);
  env["TESSEL_RESTART_COUNT"] = std::to_string(round);
  // Which job the workers belong to: rank 0 posts it in the rendezvous store and the others
  // check it, so that a worker meeting another job's store (one port given to two jobs) stops,
  // naming the port, instead of joining it (parallel/mesh.cpp rendezvous).
  if (!o.job_id.empty()) env["TESSEL_JOB_ID"] = o.job_id;
  // As torchrun: one intra-op thread per worker when several share a node, unless the user chose.
  if (!env.count("OMP_NUM_THREADS") && o.nproc_per_node > 1) env["OMP_NUM_THREADS"] = "1";
  // NCCL runs keep c10d's flight recorder (the last collectives of every group) and dump it when
  // a collective times out, next to the logs when there are logs; Gloo runs ignore these.
  if (!env.count("TORCH_NCCL_TRACE_BUFFER_SIZE")) env.emplace("TORCH_FR_BUFFER_SIZE", "2000");
  env.emplace("TORCH_NCCL_DUMP_ON_TIMEOUT", "1");
  if (!o.log_dir.empty()) env.emplace("TORCH_FR_DUMP_TEMP_FILE", o.log_dir + "/nccl_trace_rank_");
  std::vector<std::string> out;
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

void spawn(const Options& o, Worker& w, int round) {
  // Everything the child needs is prepared before fork (the launcher has threads).
  auto env = worker_env(o, w, round);
  std::vector<char*> envp, argv;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = o.command;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
    if (getppid() != parent) _exit(127);
    setpgid(0, 0);  // the terminal's Ctrl-C reaches the launcher, which forwards it once
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int s : {SIGINT, SIGTERM, SIGUSR1, SIGUSR2}) signal(s, SIG_DFL);
    execvpe(argv[0], argv.data(), envp.data());
    dprintf(STDERR_FILENO, "tessel-launch: cannot start %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  w.pid = pid;
  w.out = fds[0];
  w.running = true;
  w.partial.clear();
}

void emit(Worker& w, const std::string& line) {
  std::printf("[rank %d] %s\n", w.rank, line.c_str());
  if (w.log) std::fprintf(w.log, "%s\n", line.c_str());
}

// Reads whatever the worker wrote; prints whole lines with their rank prefix.
void drain(Worker& w, bool final) {
  char buf[65536];
  while (w.out >= 0) {
    ssize_t n = read(w.out, buf, sizeof buf);
    if (n > 0) {
      w.partial.append(buf, static_cast<size_t>(n));
      size_t nl;
      while ((nl = w.partial.find('\n')) != std::string::npos) {
        emit(w, w.partial.substr(0, nl));
        w.partial.erase(0, nl + 1);
      }
      continue;
    }
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
      close(w.out);
      w.out = -1;
    }
    break;
  }
  if ((final || w.out < 0) && !w.partial.empty()) {
    emit(w, w.partial);
    w.partial.clear();
  }
  std::fflush(stdout);
  if (w.log) std::fflush(w.log);
}

void signal_all(std::vector<Worker>& ws, int sig) {
  for (auto& w : ws)
    if (w.running) kill(w.pid, sig);
}

enum class RoundEnd { kSuccess, kFailure, kSignal, kStopped };

Clock::time_point after_grace(const Options& o) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.grace_s));
}

// Waits up to 100 ms for output, then prints what the workers wrote.
void pump_output(std::vector<Worker>& ws) {
  std::vector<pollfd> fds;
  for (auto& w : ws)
    if (w.out >= 0) fds.push_back({w.out, POLLIN, 0});
  poll(fds.data(), fds.size(), 100);
  for (auto& w : ws) drain(w, false);
}

// Reaps exited workers; with `report`, a failure is reported to the whole job.
void reap(std::vector<Worker>& ws, Coordinator& coord, int round, bool report) {
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
    for (auto& w : ws)
      if (w.pid == pid && w.running) {
        w.running = false;
        w.status = status;
        drain(w, true);
        if (failed(status) && report)
          coord.report_failure(
              round, "rank " + std::to_string(w.rank) + " (host " + host_name() + ", local rank " +
                         std::to_string(w.local_rank) + ") " + describe(status) +
                         (user_error(status) ? std::string(" (") + kNoRestart + ")" : ""));
      }
}

// Signals: forward; INT/TERM also end the job without restart.
void forward_signal(const Options& o, std::vector<Worker>& ws, int& signal_code,
                    std::optional<Clock::time_point>& kill_at) {
  const int sig = g_signal;
  if (sig == 0) return;
  g_signal = 0;
  signal_all(ws, sig);
  if (sig == SIGINT || sig == SIGTERM) {
    signal_code = 128 + sig;
    if (!kill_at) kill_at = after_grace(o);
  }
}

// Any failure anywhere in the job tears this node down: SIGTERM now, SIGKILL after the grace.
void tear_down(const Options& o, Coordinator& coord, std::vector<Worker>& ws, int round,
               std::string& failure, std::optional<Clock::time_point>& kill_at) {
  if (!kill_at) {
    if (auto f = coord.failure(round)) {
      failure = *f;
      signal_all(ws, SIGTERM);
      kill_at = after_grace(o);
    }
  } else if (Clock::now() >= *kill_at) {
    signal_all(ws, SIGKILL);
  }
}

// Once every local worker has exited: how the round ended, or nothing while the other nodes
// still run.
std::optional<RoundEnd> round_end(const Options& o, Coordinator& coord, std::vector<Worker>& ws,
                                  int round, std::string& failure, int signal_code,
                                  bool& reported_done) {
  for (auto& w : ws) drain(w, true);
  bool saved = false;  // workers saved a checkpoint on a signal and stopped
  for (const auto& w : ws) saved = saved || stopped(w.status);
  if (saved && !coord.failure(round)) return RoundEnd::kStopped;
  if (signal_code != 0) return RoundEnd::kSignal;
  if (auto f = coord.failure(round)) {
    failure = *f;
    return RoundEnd::kFailure;
  }
  // Every local worker exited 0: wait for the other nodes (or a failure among them).
  if (!reported_done) coord.report_done(round), reported_done = true;
  if (coord.done_count(round) >= o.nnodes) return RoundEnd::kSuccess;
  return std::nullopt;
}

// Runs one round of the job on this node; `failure` gets the job's first failure.
RoundEnd run_round(const Options& o, Coordinator& coord, std::vector<Worker>& ws, int round,
                   std::string& failure, int& signal_code) {
  for (auto& w : ws) spawn(o, w, round);
  std::optional<Clock::time_point> kill_at;  // set once teardown starts
  bool reported_done = false;
  while (true) {
    pump_output(ws);
    reap(ws, coord, round, !kill_at && signal_code == 0);
    forward_signal(o, ws, signal_code, kill_at);
    tear_down(o, coord, ws, round, failure, kill_at);
    bool any_running = false;
    for (auto& w : ws) any_running = any_running || w.running;
    if (any_running) continue;
    if (auto end = round_end(o, coord, ws, round, failure, signal_code, reported_done)) return *end;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void install_signal_handlers() {
  for (int s : {SIGINT, SIGTERM, SIGUSR1, SIGUSR2}) {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigaction(s, &sa, nullptr);
  }
}

// This node's workers, each with its log file under --log-dir when there is one.
std::vector<Worker> make_workers(const Options& o) {
  std::vector<Worker> ws(static_cast<size_t>(o.nproc_per_node));
  for (int i = 0; i < o.nproc_per_node; ++i) {
    ws[i].local_rank = i;
    ws[i].rank = o.node_rank * o.nproc_per_node + i;
  }
  if (!o.log_dir.empty()) {
    std::filesystem::create_directories(o.log_dir);
    for (auto& w : ws) {
      auto path = o.log_dir + "/rank_" + std::to_string(w.rank) + ".log";
      w.log = std::fopen(path.c_str(), "a");
      if (!w.log) throw std::runtime_error(path + ": cannot write: " + std::strerror(errno));
    }
  }
  return ws;
}

// A name that does not resolve would otherwise be retried until the timeout.
void check_master_resolves(const Options& o) {
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(o.master_addr.c_str(), nullptr, nullptr, &found); rc != 0)
    throw std::runtime_error(
        "master address '" + o.master_addr + "' (" +
        (o.source == "command line" ? "--master-addr" : "first host of SLURM_JOB_NODELIST") +
        ") does not resolve: " + gai_strerror(rc) +
        "; pass --master-addr with an address every node can reach");
  freeaddrinfo(found);
}

void requeue_under_slurm(const Options& o) {
  // Under Slurm the job goes back to the queue and resumes from the checkpoint when it runs
  // again (TESSEL_SLURM_REQUEUE=0 leaves that to the user). Node 0's launcher asks, once.
  const char* job = std::getenv("SLURM_JOB_ID");
  const char* want = std::getenv("TESSEL_SLURM_REQUEUE");
  if (!job || o.node_rank != 0 || (want && std::string(want) == "0")) return;
  const std::string cmd = std::string("scontrol requeue ") + job + " 2>&1";
  std::fprintf(stderr, "tessel-launch: %s\n", cmd.c_str());
  const int rc = std::system(cmd.c_str());
  if (rc != 0)
    std::fprintf(stderr,
                 "tessel-launch: scontrol requeue %s failed (status %d): requeue the job by "
                 "hand, or submit it again; it resumes from the checkpoint\n",
                 job, rc);
}

// After a round that did not succeed: the launcher's exit code, or nothing to restart.
std::optional<int> after_round(const Options& o, RoundEnd end, int round,
                               const std::string& failure, int signal_code,
                               const std::vector<Worker>& ws) {
  if (end == RoundEnd::kStopped) {
    std::fprintf(stderr,
                 "tessel-launch: the workers stopped on a signal (exit %d: after saving a "
                 "checkpoint, or during start-up with nothing trained): run the same command "
                 "again to resume\n",
                 run::kExitStopped);
    requeue_under_slurm(o);
    return run::kExitStopped;
  }
  if (end == RoundEnd::kSignal) {
    std::fprintf(stderr, "tessel-launch: stopped by signal; workers terminated\n");
    return signal_code;
  }
  std::fprintf(stderr, "tessel-launch: failure: %s\n", failure.c_str());
  bool no_restart = failure.find(kNoRestart) != std::string::npos;
  for (const auto& w : ws) no_restart = no_restart || user_error(w.status);
  if (no_restart) {
    if (o.max_restarts > 0)
      std::fprintf(stderr, "tessel-launch: not restarting (%s)\n", kNoRestart);
    return kExitUserError;
  }
  if (round >= o.max_restarts) {
    std::fprintf(stderr, "tessel-launch: giving up after %d restart%s (--max-restarts %d)\n", round,
                 round == 1 ? "" : "s", o.max_restarts);
    return 1;
  }
  std::fprintf(stderr, "tessel-launch: restarting every worker (restart %d of %d)\n", round + 1,
               o.max_restarts);
  return std::nullopt;
}

// Rounds until one succeeds, stops, or no restart is left; returns the launcher's exit code.
int run_rounds(const Options& o, Coordinator& coord, std::vector<Worker>& ws) {
  for (int round = 0;; ++round) {
    try {
      coord.barrier(round);
    } catch (const Interrupted& i) {
      std::fprintf(stderr, "tessel-launch: %s while waiting for the other nodes; %s\n",
                   strsignal(i.signal), round == 0 ? "nothing started" : "not restarting");
      return 128 + i.signal;
    }
    for (auto& w : ws)
      if (w.log) std::fprintf(w.log, "=== tessel-launch: start (restart %d) ===\n", round);
    std::string failure;
    int signal_code = 0;
    const auto end = run_round(o, coord, ws, round, failure, signal_code);
    if (end == RoundEnd::kSuccess) return 0;
    if (auto code = after_round(o, end, round, failure, signal_code, ws)) return *code;
  }
}

// Binds `port` on loopback (0: any); returns the bound port, or 0 when taken.
int bind_port(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof a;
  int got = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    got = ntohs(a.sin_port);
  ::close(fd);
  return got;
}

}  // namespace

bool port_free(int port) {
  // SO_REUSEADDR as c10d's TCPStore binds: a port left in TIME_WAIT by an earlier job is free,
  // one with a listener is not.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;  // cannot tell: the rendezvous says
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

int gpus_on_node() {
  namespace fs = std::filesystem;
  int n = 0;
  std::error_code ec;
  for (fs::directory_iterator it("/dev", fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("nvidia", 0) == 0 && name.size() > 6 &&
        name.find_first_not_of("0123456789", 6) == std::string::npos)
      ++n;
  }
  return n;
}

int free_port_pair() {
  for (int attempt = 0; attempt < 64; ++attempt) {
    const int p = bind_port(0);
    if (p > 0 && p < 65535 && bind_port(p + 1) == p + 1) return p;
  }
  throw std::runtime_error("no free pair of ports on this host; pass --master-port");
}

void apply_slurm(Options& o, bool nnodes_given, bool node_rank_given, bool master_given) {
  const char* job = std::getenv("SLURM_JOB_ID");
  if (!job) return;
  auto get = [](const char* k) -> const char* {
    const char* v = std::getenv(k);
    return v && *v ? v : nullptr;
  };
  if (!nnodes_given && (get("SLURM_NNODES") || get("SLURM_JOB_NUM_NODES")))
    o.nnodes = std::atoi(get("SLURM_NNODES") ? get("SLURM_NNODES") : get("SLURM_JOB_NUM_NODES"));
  if (!node_rank_given && get("SLURM_NODEID")) o.node_rank = std::atoi(get("SLURM_NODEID"));
  // One node: the job is local, loopback is the master (a node name need not resolve).
  if (!master_given && o.nnodes > 1 && get("SLURM_JOB_NODELIST"))
    o.master_addr = parallel::first_slurm_host(get("SLURM_JOB_NODELIST"));
  o.source = std::string("Slurm job ") + job;
}

int run(const Options& o) {
  install_signal_handlers();
  std::vector<Worker> ws = make_workers(o);
  std::fprintf(stderr,
               "tessel-launch: node %d/%d (%s), %d workers per node, world %d, master %s:%d\n",
               o.node_rank, o.nnodes, o.source.c_str(), o.nproc_per_node,
               o.nnodes * o.nproc_per_node, o.master_addr.c_str(), o.master_port);
  if (o.nnodes > 1) check_master_resolves(o);
  std::unique_ptr<Coordinator> coord;
  try {
    coord = make_coordinator(o.nnodes, o.node_rank, o.master_addr, o.master_port + 1,
                             o.rdzv_timeout_s, &g_signal);
  } catch (const Interrupted& i) {
    std::fprintf(stderr, "tessel-launch: %s while waiting for node 0 at %s:%d; nothing started\n",
                 strsignal(i.signal), o.master_addr.c_str(), o.master_port + 1);
    return 128 + i.signal;
  }
  const int code = run_rounds(o, *coord, ws);
  coord->leave(60.0);
  for (auto& w : ws)
    if (w.log) std::fclose(w.log);
  return code;
}

}  // namespace tessel::launcher
