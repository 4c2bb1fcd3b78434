// What each data-parallel synchronisation (grad_sync.h: DDP, ZeRO-1/2, ZeRO-3) moves over its
// data group in one step, declared beside the implementations: gradients all-reduced (DDP) or
// reduce-scattered (ZeRO), weights all-gathered (ZeRO-1/2 after the update, ZeRO-3 before each
// use), and under hybrid sharding each piece summed over the replicas once a step. --dry-run adds
// these up per group (engine/planner/traffic.cpp); the parity table holds them to the bytes every
// run counts (within 15%: bucket padding and expert routing the plan alone cannot know).
#pragma once

#include <cstdint>

#include "core/plan/layout.h"

namespace tessel::parallel::dp {

/// One rank's parameters in one data group (dp×cp, or the experts' own) and how a step uses them.
struct SyncSize {
  double params = 0;           // elements this rank holds in the group (whole, before sharding)
  double buckets = 0;          // gradient buckets they fill (each one collective)
  double micro_batches = 1;    // per step
  double elem = 4;             // bytes per weight element (the compute dtype)
  int64_t shards = 1;          // ranks each bucket is sharded over (ZeRO's shard group)
  bool replicated = false;     // hybrid sharding: replicas of the shard group besides
  bool reduces_once = false;   // reduces_once (grad_reducer.h): one reduce-scatter a step
  bool keep_gathered = false;  // ZeRO-3: units gathered once a step
  double gathered = 0;         // ZeRO-3 without kept units: weight elements gathered in the step
  double units = 0;            // ZeRO-3: units gathered per micro-batch (the blocks and the root)
};

/// Bytes by how a ring moves them (the planner times them apart) and collectives issued.
struct SyncBytes {
  double all_reduce = 0, gather_scatter = 0, replica = 0, ops = 0;
};

/// The bytes the synchronisation of `sharding` moves in one step for `s`.
SyncBytes step_bytes(const plan::Sharding& sharding, const SyncSize& s);

}  // namespace tessel::parallel::dp
