// NCCL communicators' own device memory, per rank. Each communicator keeps, per channel and per
// peer it connects to, FIFO buffers for its protocols: NVIDIA/nccl#1685 logs 10 MiB and 2 MiB per
// channel and peer pair, and 32 channels, on 8 H100s (an all-to-all took 3.3 GB beside PyTorch's
// own memory); NVIDIA/nccl#986: memory grows with channels and peers, a ring connects two peers
// whatever the group's size, all-to-all and send/receive every peer they address. The profile's
// nccl_peer_mib (32 channels x 12 MiB = 384 MiB by default) is that figure per peer; a site
// that measured its own sets it. Gloo (the CPU) keeps nothing on a device: 0.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "engine/planner/planner.h"
#include "parallel/mesh.h"

namespace tessel::planner {
namespace {

// Peers a communicator connects to: a point-to-point channel one, an expert or all-to-all context
// group every other member, any other group its ring's two neighbours (one in a pair).
int64_t peers_of(const parallel::Communicator& comm, const plan::Config& c) {
  const int64_t n = static_cast<int64_t>(comm.ranks.size());
  if (n <= 1) return 0;
  std::vector<std::string> users = comm.shared_by;
  users.push_back(comm.name);
  bool all_pairs = false, p2p = false;
  for (const auto& u : users) {
    const std::string kind = u.substr(0, u.find('.'));
    p2p = p2p || u.find(".p2p.") != std::string::npos;
    all_pairs = all_pairs || kind == "ep" ||
                (kind == "cp" && c.parallel.context_method != plan::CpMethod::kAllGather);
  }
  if (all_pairs) return n - 1;
  if (p2p) return 1;
  return std::min<int64_t>(n - 1, 2);
}

}  // namespace

bool uses_nccl(const plan::Config& c, const DeviceProfile& dev) {
  if (c.parallel.backend == plan::Backend::kNccl) return true;
  if (c.parallel.backend != plan::Backend::kAuto) return false;
  return !dev.cpu && c.training.device != plan::TrainDevice::kCpu;
}

CommBuffers communicator_buffers(const plan::Config& c, const plan::Layout& l, int64_t stage,
                                 const DeviceProfile& dev) {
  CommBuffers out;
  if (l.world() <= 1 || !uses_nccl(c, dev)) return out;
  parallel::WorldInfo w;
  w.world = static_cast<int>(l.world());
  w.rank = static_cast<int>(stage * (l.world() / l.pp));  // the stage's first rank (pp outermost)
  w.local_world = 0;  // planned for another machine: this one's devices are not checked
  const auto mesh = parallel::Mesh::plan(c, w);
  for (const auto& comm : mesh->communicators()) {
    const int64_t peers = peers_of(comm, c);
    if (peers == 0) continue;
    ++out.communicators;
    out.peers += peers;
  }
  out.bytes = static_cast<double>(out.peers) * dev.nccl_peer_mib * 1024 * 1024;
  return out;
}

}  // namespace tessel::planner
