#include "parallel/world.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "core/plan/config.h"

namespace tessel::parallel {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

int env_int(const char* name, const char* from) {
  const char* v = env(name);
  char* end = nullptr;
  long x = v ? std::strtol(v, &end, 10) : -1;
  if (!v || *end || x < 0)
    throw plan::UserError(
        fmt::format("{}: {}={} is not a non-negative integer", from, name, v ? v : "(unset)"));
  return static_cast<int>(x);
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // "pre[3-5,7]suf,other" -> "pre3suf"; "a,b" -> "a"; "n1" -> "n1".
  std::string first;
  int depth = 0;
  for (char ch : nodelist) {
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    if (ch == ',' && depth == 0) break;
    first += ch;
  }
  auto open = first.find('[');
  if (open == std::string::npos) return first;
  auto close = first.find(']', open);
  std::string range = first.substr(open + 1, close - open - 1);
  std::string lo = range.substr(0, range.find_first_of(",-"));
  return first.substr(0, open) + lo + first.substr(close + 1);
}

std::vector<int> slurm_tasks_per_node(const std::string& spec, const std::string& variable) {
  // Comma-separated counts, each optionally "(xN)": N consecutive nodes with that count.
  std::vector<int> out;
  auto bad = [&](const std::string& why) {
    return plan::UserError(fmt::format(
        "Slurm: {}='{}' {} (expected counts such as 8(x2) or 2(x3),1)", variable, spec, why));
  };
  size_t i = 0;
  while (i < spec.size()) {
    size_t used = 0;
    int count = 0, repeat = 1;
    try {
      count = std::stoi(spec.substr(i), &used);
    } catch (const std::exception&) {
      throw bad("has no task count at character " + std::to_string(i + 1));
    }
    i += used;
    if (spec.compare(i, 2, "(x") == 0) {
      const auto close = spec.find(')', i);
      try {
        repeat = close == std::string::npos ? -1 : std::stoi(spec.substr(i + 2, close - i - 2));
      } catch (const std::exception&) {
        repeat = -1;
      }
      if (repeat < 1) throw bad("has a malformed (xN) repeat");
      i = close + 1;
    }
    if (count < 1) throw bad("counts " + std::to_string(count) + " tasks on a node");
    out.insert(out.end(), static_cast<size_t>(repeat), count);
    if (i < spec.size() && spec[i++] != ',') throw bad("has a stray character");
  }
  if (out.empty()) throw bad("is empty");
  return out;
}

namespace {

// The tasks on this node. srun sets SLURM_STEP_TASKS_PER_NODE for the step it runs (the job's
// SLURM_TASKS_PER_NODE may count another distribution); SLURM_NTASKS_PER_NODE only exists with
// --ntasks-per-node. Each lists the nodes in order; SLURM_NODEID is this node's index.
int slurm_local_world() {
  for (const char* variable :
       {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    if (!env(variable)) continue;
    const auto counts = slurm_tasks_per_node(env(variable), variable);
    if (std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts[0]; }))
      return counts[0];  // the same on every node: no need to know which node this is
    if (!env("SLURM_NODEID"))
      throw plan::UserError(
          fmt::format("Slurm: {}='{}' differs between nodes, and SLURM_NODEID (this "
                      "node's index) is not set",
                      variable, env(variable)));
    const int node = env_int("SLURM_NODEID", "Slurm environment");
    if (node < 0 || node >= static_cast<int>(counts.size()))
      throw plan::UserError(fmt::format("Slurm: SLURM_NODEID {} is outside {}='{}' ({} nodes)",
                                        node, variable, env(variable), counts.size()));
    return counts[static_cast<size_t>(node)];
  }
  return 1;
}

}  // namespace

WorldInfo discover_world() {
  WorldInfo w;
  if (env("RANK") || env("WORLD_SIZE")) {
    const char* from = "torchrun-style environment";
    w.rank = env_int("RANK", from);
    w.world = env_int("WORLD_SIZE", from);
    w.local_rank = env("LOCAL_RANK") ? env_int("LOCAL_RANK", from) : 0;
    w.local_world = env("LOCAL_WORLD_SIZE") ? env_int("LOCAL_WORLD_SIZE", from) : 1;
    w.source = env("TESSEL_RESTART_COUNT") ? "tessel-launch" : "torchrun-style environment";
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    const char* from = "Slurm environment";
    w.rank = env_int("SLURM_PROCID", from);
    w.world = env_int("SLURM_NTASKS", from);
    w.local_rank = env("SLURM_LOCALID") ? env_int("SLURM_LOCALID", from) : 0;
    w.local_world = slurm_local_world();
    if (env("SLURM_JOB_NODELIST")) w.master_addr = first_slurm_host(env("SLURM_JOB_NODELIST"));
    if (!env("MASTER_PORT") && env("SLURM_JOB_ID"))
      w.master_port =
          20000 + static_cast<int>(std::strtoul(env("SLURM_JOB_ID"), nullptr, 10) % 20000);
    w.source = "Slurm";
  } else if (env("OMPI_COMM_WORLD_RANK")) {
    const char* from = "Open MPI environment";
    w.rank = env_int("OMPI_COMM_WORLD_RANK", from);
    w.world = env_int("OMPI_COMM_WORLD_SIZE", from);
    w.local_rank =
        env("OMPI_COMM_WORLD_LOCAL_RANK") ? env_int("OMPI_COMM_WORLD_LOCAL_RANK", from) : 0;
    w.local_world =
        env("OMPI_COMM_WORLD_LOCAL_SIZE") ? env_int("OMPI_COMM_WORLD_LOCAL_SIZE", from) : 1;
    if (w.local_world != w.world && !env("MASTER_ADDR"))
      throw plan::UserError(
          "Open MPI across nodes: set MASTER_ADDR to the host of rank 0 (mpirun -x "
          "MASTER_ADDR=...)");
    w.source = "Open MPI";
  }
  if (env("MASTER_ADDR")) w.master_addr = env("MASTER_ADDR");
  if (env("MASTER_PORT")) w.master_port = env_int("MASTER_PORT", "environment");
  if (w.world < 1 || w.rank >= w.world || w.local_rank >= std::max(w.local_world, 1))
    throw plan::UserError(fmt::format(
        "{}: rank {} / world size {} / local rank {} / local world size {} are inconsistent",
        w.source, w.rank, w.world, w.local_rank, w.local_world));
  return w;
}

}  // namespace tessel::parallel
