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

/// Which CUDA device a process uses, and why (for the start-up log).
struct DeviceChoice {
  int index = 0;
  std::string why;
};
/// From the number of devices this process sees (after CUDA_VISIBLE_DEVICES, which Slurm's
/// --gpus-per-task or a site's binding sets per task): exactly one -> device 0 whatever the local
/// rank (each process was given its own); at least local_world -> the local rank's; otherwise a
/// UserError naming both counts (several processes would share, or miss, a device).
/// `visible_env`: CUDA_VISIBLE_DEVICES as set (null: unset), named in the reason.
DeviceChoice choose_cuda_device(int visible, int local_rank, int local_world,
                                const char* visible_env);

/// First host name of a Slurm node list ("n[3-5,7],m1" -> "n3").
std::string first_slurm_host(const std::string& nodelist);

/// The tasks on each node of a Slurm task count ("8(x2)", "2(x3),1", "4,3,4": the form of
/// SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE and SLURM_NTASKS_PER_NODE), node by node.
/// `variable` names the source in the UserError a malformed value gets.
std::vector<int> slurm_tasks_per_node(const std::string& spec, const std::string& variable);

}  // namespace tessel::parallel
