#include "parallel/cp/bytes.h"

#include "parallel/cp/attention.h"

namespace tessel::parallel::cp {

int64_t alltoall_ranks(plan::CpMethod method, int64_t cp, int64_t alltoall_size) {
  if (cp == 1) return 1;
  if (method == plan::CpMethod::kAllToAll) return cp;
  return method == plan::CpMethod::kHybrid ? alltoall_size : 1;
}

double kept_bytes(plan::CpMethod method, const AttentionSize& a) {
  if (a.recompute_full || a.cp == 1) return 0.0;
  if (method == plan::CpMethod::kAllGather) return a.elem * a.sequence * 2 * a.kv_width;
  if (a.alltoall == 1) return 0.0;
  const auto repeated = static_cast<double>(alltoall_kv_heads(a.kv_heads, a.alltoall) - a.kv_heads);
  return repeated * 2 * static_cast<double>(a.head_dim) * a.elem * a.tokens;
}

LayerBytes layer_bytes(plan::CpMethod method, const AttentionSize& a) {
  LayerBytes out;
  const double full = a.recompute_full ? 1 : 0;
  if (method == plan::CpMethod::kAllGather) {
    // Keys and values gathered, their gradients reduce-scattered in fp32 (reduced before they
    // are rounded); full recomputation gathers again.
    const double kv = a.sequence * 2 * a.kv_width * a.elem;
    out.gather_scatter = kv * (1 + full + 4 / a.elem);
    out.ops = 2 + full;
    return out;
  }
  // alltoall (and hybrid inside its groups): each pass through attention sends q, k, v out
  // (key/value heads repeated to a multiple of the group) and the output back; backward the
  // same two all-to-alls reversed, and full recomputation reruns forward's. Each all-to-all's
  // size is this rank's whole input.
  const double kv = static_cast<double>(alltoall_kv_heads(a.kv_heads, a.alltoall));
  const double head = a.tokens * static_cast<double>(a.head_dim) * a.elem;  // one head's tokens
  if (a.alltoall > 1) {
    out.gather_scatter = head * (2 * static_cast<double>(a.heads) + 2 * kv) * (2 + full);
    out.ops = 2 * (2 + full);
  }
  // ring (and hybrid across its groups): each ring member's keys/values (its group's tokens of
  // its heads) go round ring-1 times forward and again in backward (plus once more when full
  // recompute reruns forward); dK/dV go round ring times, in fp32.
  const double ring = static_cast<double>(a.cp / a.alltoall);
  if (ring > 1) {
    out.p2p = 2 * kv * head * ((2 + full) * (ring - 1) + ring * 4 / a.elem);
    out.ops += (2 + full) * (ring - 1) + ring;
  }
  return out;
}

}  // namespace tessel::parallel::cp
