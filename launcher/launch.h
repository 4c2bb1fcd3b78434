// tessel-launch: starts the workers of one node (torchrun's environment contract), prefixes and
// logs their output, and supervises them: when any worker fails, every worker of the job gets
// SIGTERM, then SIGKILL after a grace period, and the whole job restarts (all nodes together) until
// --max-restarts is spent. Nodes agree on failures and restarts through a c10d TCPStore hosted by
// node 0's launcher at MASTER_PORT+1.
#pragma once

#include <string>
#include <vector>

namespace tessel::launcher {

struct Options {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int max_restarts = 0;
  double grace_s = 10.0;                // between SIGTERM and SIGKILL
  double rdzv_timeout_s = 900.0;        // waits for the other nodes' launchers
  std::string log_dir;                  // empty: no log files
  std::string source = "command line";  // or "Slurm"
  std::vector<std::string> command;
  std::string job_id;  // TESSEL_JOB_ID for the workers: this job's, empty when none is known
};

/// Fills node count, node rank and master address from SLURM_* when inside an allocation and
/// they were not given (one launcher per node: srun --ntasks-per-node=1 tessel-launch ...).
void apply_slurm(Options& o, bool nnodes_given, bool node_rank_given, bool master_given);

/// A port P on this host with P and P + 1 both free now (the workers' rendezvous and the
/// launchers' store), as torchrun --standalone picks one: two jobs on one node then never meet at
/// the default 29500.
int free_port_pair();
/// Whether `port` can be bound on this host now (nothing listens there).
bool port_free(int port);
/// The GPUs this node shows (/dev/nvidiaN), without loading CUDA.
int gpus_on_node();

/// Runs the job; returns the launcher's exit code (0 when every worker of the last round exited 0).
int run(const Options& o);

}  // namespace tessel::launcher
