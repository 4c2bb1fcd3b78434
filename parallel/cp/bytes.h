// What each context-parallel method (attention.h) moves over the cp group, declared beside the
// methods: per attention layer and micro-batch on one rank, as attention.cpp issues its
// collectives. --dry-run adds these up over a rank's layers and micro-batches
// (engine/planner/traffic.cpp); the parity table holds them to the bytes every run counts,
// exactly, for every method.
#pragma once

#include <cstdint>

#include "core/plan/choices.h"

namespace tessel::parallel::cp {

/// Ranks of one all-to-all: cp (alltoall), the group's size (hybrid: parallel.context
/// .alltoall_size), else 1 (allgather, ring, and any method over a cp of 1).
int64_t alltoall_ranks(plan::CpMethod method, int64_t cp, int64_t alltoall_size);

/// One rank's attention in one layer and micro-batch.
struct AttentionSize {
  int64_t cp = 1;        // the context-parallel group
  int64_t alltoall = 1;  // alltoall_ranks
  double sequence = 0;   // tokens of the micro-batch's whole sequences (micro_batch × seq_len)
  double tokens = 0;     // this rank's share of them (sequence / cp)
  double kv_width = 0;   // keys' (and values') width on this tp rank: kv_heads × head_dim / tp
  int64_t heads = 0;     // query heads on this tp rank
  int64_t kv_heads = 0;  // key/value heads on this tp rank (at least 1)
  int64_t head_dim = 0;
  double elem = 4;              // bytes per element of the compute dtype
  bool recompute_full = false;  // training.recompute full: forward's collectives run again
};

/// Bytes by how a ring moves them (the planner times them apart) and the collectives issued.
struct LayerBytes {
  double gather_scatter = 0, p2p = 0, ops = 0;
};

/// The bytes `method` moves for `a`, forward and backward.
LayerBytes layer_bytes(plan::CpMethod method, const AttentionSize& a);

/// Bytes `method` keeps for backward in one layer and micro-batch beyond what the attention keeps
/// without context parallelism: all-gather, the whole sequence's keys and values; all-to-all
/// (alone or inside a hybrid's groups), the key/value heads it repeats to a multiple of the
/// group (alltoall_kv_heads), over its tokens; ring, none (its blocks pass through). Nothing under
/// full recomputation, which keeps a block's input only.
double kept_bytes(plan::CpMethod method, const AttentionSize& a);

}  // namespace tessel::parallel::cp
