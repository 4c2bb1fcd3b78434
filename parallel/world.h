// Who this process is, from the environment of whoever started it (tessel-launch, torchrun,
// srun or mpirun). Free of LibTorch so the launcher shares it.
#pragma once

#include <string>
#include <vector>

namespace tessel::parallel {

struct WorldInfo {
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "single process";  // tessel-launch, torchrun-style, Slurm, Open MPI
};

/// torchrun-style RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT first, then
/// Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, first host of SLURM_JOB_NODELIST; the
/// local world from the first of SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE and
/// SLURM_TASKS_PER_NODE that is set, at this node's index SLURM_NODEID), then
/// Open MPI (OMPI_COMM_WORLD_*), else a single process. Throws UserError on inconsistent values.
WorldInfo discover_world();

/// First host name of a Slurm node list ("n[3-5,7],m1" -> "n3").
std::string first_slurm_host(const std::string& nodelist);

/// The tasks on each node of a Slurm task count ("8(x2)", "2(x3),1", "4,3,4": the form of
/// SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE and SLURM_NTASKS_PER_NODE), node by node.
/// `variable` names the source in the UserError a malformed value gets.
std::vector<int> slurm_tasks_per_node(const std::string& spec, const std::string& variable);

}  // namespace tessel::parallel
