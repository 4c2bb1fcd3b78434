#include "parallel/dp/bytes.h"

namespace tessel::parallel::dp {

SyncBytes step_bytes(const plan::Sharding& z, const SyncSize& s) {
  SyncBytes d;
  const double n = s.params, w = s.elem, mb = s.micro_batches, buckets = s.buckets;
  if (!z.state) d.all_reduce += 4 * n, d.ops += buckets;  // DDP: fp32 gradients, every bucket
  if (z.state && s.replicated)  // each piece summed over the replicas, once a step
    d.replica += 4 * n / static_cast<double>(s.shards), d.ops += buckets;
  if (z.state && s.shards == 1) return d;  // a shard group of one: nothing gathered or scattered
  // ZeRO-1: the gradients reduce-scattered after the step's last backward, the weights gathered
  // after the update.
  if (z.state_only()) d.gather_scatter += 4 * n + w * n, d.ops += 2 * buckets;
  if (s.reduces_once)  // inside a pipeline or kept gathered, fp32: once per step
    d.gather_scatter += 4 * n + w * n, d.ops += 2 * buckets;
  else if (z.grads && (!z.weights || s.keep_gathered))  // every micro-batch's, then the gather
    d.gather_scatter += mb * 4 * n + w * n, d.ops += (mb + 1) * buckets;
  if (z.weights && !s.keep_gathered) {  // reduced per micro-batch; units gathered as used
    d.gather_scatter += mb * 4 * n + w * s.gathered;
    d.ops += mb * 3 * s.units;
  }
  return d;
}

}  // namespace tessel::parallel::dp
