// tessel-launch [--nproc-per-node N] [--nnodes N --node-rank R --master-addr A --master-port P]
//               [--max-restarts K] [--log-dir D] -- COMMAND ...
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

#include <fmt/format.h>

#include "engine/cli/cli_checks.h"
#include "engine/cli/exit.h"
#include "launcher/launch.h"

namespace {

// What this node can take, before any fork: 0, or the exit code after saying why.
int check_node(const tessel::launcher::Options& o, bool port_given, bool oversubscribe) {
  // Bounded by the machine before any fork: a typo (--nproc-per-node 10000) would start that
  // many processes. Gloo tests on CPU run a few ranks per core, hence 4 per core.
  const int cores = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  const int limit = std::max(4 * cores, tessel::launcher::gpus_on_node());
  if (!oversubscribe && o.nproc_per_node > limit) {
    std::fprintf(stderr,
                 "tessel-launch: error: --nproc-per-node %d is more than this node runs (%d cores, "
                 "%d GPUs: at most %d workers); give --oversubscribe to start them anyway\n",
                 o.nproc_per_node, cores, tessel::launcher::gpus_on_node(), limit);
    return 2;
  }
  // Two jobs on one node given one --master-port: the second's workers would meet the first's
  // store (and stop it). Refused before anything starts, naming the port.
  if (port_given && o.nnodes == 1) {
    for (int p : {o.master_port, o.master_port + 1})
      if (!tessel::launcher::port_free(p)) {
        std::fprintf(stderr,
                     "tessel-launch: error: --master-port %d: port %d is in use on this node "
                     "(another job's rendezvous?); give another port, or omit --master-port on "
                     "one node and a free pair is chosen\n",
                     o.master_port, p);
        return 2;
      }
  }
  return 0;
}

// On one node without --master-port, a free pair of ports (said in the start-up line); and the
// job's identity for the workers' rendezvous: one node makes its own, several nodes share Slurm's
// job and step ids where they have them (each node's launcher sees the same).
void choose_port_and_job(tessel::launcher::Options& o, bool port_given) {
  if (!port_given && o.nnodes == 1) {
    o.master_port = tessel::launcher::free_port_pair();
    o.source += ", free port chosen";
  }
  if (o.nnodes == 1) {
    std::random_device rd;
    o.job_id = fmt::format("{}-{:08x}{:08x}", ::getpid(), rd(), rd());
  } else if (const char* job = std::getenv("SLURM_JOB_ID")) {
    const char* step = std::getenv("SLURM_STEP_ID");
    o.job_id = fmt::format("slurm-{}-{}", job, step ? step : "");
  }
}

int launch(int argc, char** argv) {
  tessel::launcher::Options o;
  CLI::App app{
      "tessel-launch: start and supervise the workers of one node (torchrun's environment "
      "contract)",
      "tessel-launch"};
  app.add_option("--nproc-per-node", o.nproc_per_node, "Workers on this node")
      ->check(tessel::cli::whole_at_least(1));
  auto* nnodes = app.add_option("--nnodes", o.nnodes, "Nodes in the job (Slurm: SLURM_NNODES)")
                     ->check(tessel::cli::whole_at_least(1));
  auto* node_rank =
      app.add_option("--node-rank", o.node_rank, "This node's index (Slurm: SLURM_NODEID)")
          ->check(tessel::cli::whole_at_least(0));
  auto* master = app.add_option("--master-addr", o.master_addr,
                                "Host of rank 0 (Slurm: first node of the allocation)");
  auto* port = app.add_option("--master-port", o.master_port,
                              "Rendezvous port; the launchers use the next one. Default: on one "
                              "node a free pair of ports, found at start (and said); on several "
                              "nodes 29500")
                   ->check(CLI::Range(1, 65534));
  app.add_option("--max-restarts", o.max_restarts,
                 "Restart the whole job this many times after a failure")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--grace-s", o.grace_s,
                 "Seconds between SIGTERM and SIGKILL when tearing workers down")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--rdzv-timeout-s", o.rdzv_timeout_s,
                 "Seconds to wait for the other nodes' launchers (at start and before a restart)")
      ->check(CLI::PositiveNumber);
  bool oversubscribe = false;
  app.add_flag("--oversubscribe", oversubscribe,
               "Allow more workers than 4 per core (or one per GPU where there are more GPUs)");
  app.add_option("--log-dir", o.log_dir, "Write each rank's output to DIR/rank_<N>.log too");
  app.add_option("command", o.command, "The worker command (after --)")->required();
  TESSEL_CLI_PARSE(app, argc, argv);
  // c10d's own log lines about the launchers' store (connection retries, with C++ backtraces)
  // are noise: the launcher says what happened. TORCH_CPP_LOG_LEVEL brings them back.
  if (!std::getenv("TORCH_CPP_LOG_LEVEL")) FLAGS_caffe2_log_level = 3;
  tessel::launcher::apply_slurm(o, nnodes->count() > 0, node_rank->count() > 0,
                                master->count() > 0);
  if (const int code = check_node(o, port->count() > 0, oversubscribe)) return code;
  choose_port_and_job(o, port->count() > 0);
  if (o.node_rank >= o.nnodes) {
    std::fprintf(stderr, "tessel-launch: error: --node-rank %d must be < --nnodes %d\n",
                 o.node_rank, o.nnodes);
    return 2;
  }
  try {
    return tessel::launcher::run(o);
  } catch (const c10::Error& e) {  // rendezvous of the launchers (TCPStore)
    std::fprintf(stderr, "tessel-launch: error: node %d: %s\n", o.node_rank,
                 e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel-launch: error: %s\n", e.what());
    return 2;
  }
}

}  // namespace

int main(int argc, char** argv) { tessel::cli::exit_without_teardown(launch(argc, argv)); }
