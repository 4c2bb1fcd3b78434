// Pipeline schedules as data: pure functions give each rank its ordered list of actions; one
// executor will run any list, and the simulator here checks them (every dependency met, no
// deadlock), measures the bubble and the activations each stage holds, and draws the rank × time
// grid that --dry-run prints.
//
// Stages: with v virtual stages per rank (interleaved), model chunk c on rank r is pipeline stage
// c·p + r of p·v; otherwise chunk 0 on rank r is stage r.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/plan/config.h"

namespace tessel::parallel::pp {

/// kBackward: a whole backward. Zero-bubble schedules split it (weight_grad.h): kBackwardInput
/// (B, the input's gradient, which the previous stage waits for) and kBackwardWeight (W, the
/// weights' gradients, run where the pipeline would otherwise idle).
enum class Op {
  kRecvAct,
  kForward,
  kSendAct,
  kRecvGrad,
  kBackward,
  kSendGrad,
  kBackwardInput,
  kBackwardWeight
};

struct Action {
  Op op;
  int64_t microbatch;
  int64_t chunk;  // model chunk on this rank (0 unless interleaved)
  bool operator==(const Action& o) const {
    return op == o.op && microbatch == o.microbatch && chunk == o.chunk;
  }
};

struct Schedule {
  std::string name;  // gpipe | 1f1b | interleaved | zb-h1 | zbv | ...
  int64_t stages = 1, microbatches = 1, virtual_stages = 1;  // p, m, v
  std::vector<std::vector<Action>> ranks;                    // [p] lists
  bool backward = true;                                      // false: forward passes only
  /// V-shaped placement (zbv): chunk 0 of rank r is stage r, chunk 1 is stage 2p−1−r, so the
  /// first and the last stage share rank 0 and stages p−1 and p share rank p−1. Otherwise chunk
  /// c of rank r is stage c·p + r.
  bool v_shape = false;

  int64_t stage_of(int64_t rank, int64_t chunk) const {
    return v_shape && chunk % 2 == 1 ? (chunk + 1) * stages - 1 - rank : chunk * stages + rank;
  }
  int64_t rank_of(int64_t stage) const {
    const int64_t c = stage / stages, r = stage % stages;
    return v_shape && c % 2 == 1 ? stages - 1 - r : r;
  }
  int64_t chunk_of(int64_t stage) const { return stage / stages; }
};

/// Chunk c of rank r's pipeline stage under the named schedule's placement (see Schedule).
int64_t stage_of(plan::PipelineSchedule schedule, int64_t p, int64_t rank, int64_t chunk);

/// Global layer range [begin, end) of each of the `stages` (p·v) pipeline stages: `per_stage`
/// when given (already checked against the plan), else an even split in which the first
/// layers % stages stages get one layer more.
std::vector<std::pair<int64_t, int64_t>> stage_layers(int64_t layers, int64_t stages,
                                                      const std::vector<double>& per_stage = {});
/// The layer count of each stage, as printed: "3 2 2 1".
std::string stage_layer_counts(int64_t layers, int64_t stages,
                               const std::vector<double>& per_stage = {});

/// GPipe: every forward, then every backward. Holds m micro-batches of activations per stage.
Schedule gpipe(int64_t p, int64_t m);
/// 1F1B (PipeDream-flush): p−r−1 warm-up forwards, then one forward / one backward. At most p.
Schedule one_f_one_b(int64_t p, int64_t m);
/// Interleaved 1F1B (Narayanan et al. 2021, arXiv:2104.04473) with v chunks per rank; m % p == 0.
Schedule interleaved(int64_t p, int64_t m, int64_t v);
/// The same passes in the same order per rank, with every send and receive moved to a tick
/// boundary. A tick is one pass; a pass starts one tick after the passes it needs. After tick t
/// each rank sends what its tick-t pass produced and receives what its neighbours' tick-t passes
/// produced. Neighbours' batches then pair up one to one, and no batch waits on a later one of
/// a peer, even when sends block until received (NCCL).
Schedule lockstep(const Schedule& s);
/// ZB-H1 (Qi et al. 2023, arXiv:2401.10241): 1F1B's warm-up (p − r forwards on rank r before
/// its first B), each backward split into B and W, W deferred into the bubbles, and no rank
/// holding more micro-batches from F to W than 1F1B's first rank (p). With F, B and W alike:
/// (p−1)/(3m) of the ideal step, a third of 1F1B's bubble (schedule_test checks the figure).
Schedule zero_bubble_h1(int64_t p, int64_t m);
/// ZBV: two chunks per rank in a V (Schedule::v_shape), B and W split, at most 1F1B's activation
/// memory (2p half-stage chunks per rank, from F to W). With F, B and W alike: (p−1)/(6m), half
/// of ZB-H1's bubble.
Schedule zero_bubble_v(int64_t p, int64_t m);
/// The papers' bubble of `schedule` with backward = 2 forwards (B = W = 1), as a share of the
/// ideal step m·(F + B + W): gpipe and 1f1b (p−1)/m, interleaved (p−1)/(v·m), zb-h1 (p−1)/(3m),
/// zbv (p−1)/(6m).
double theory_bubble(plan::PipelineSchedule schedule, int64_t p, int64_t m, int64_t v);
/// Forward passes only (evaluation): each rank runs its chunks in order, every micro-batch
/// through chunk 0, then through chunk 1, ..., placed as `like` places them.
Schedule forward_only(int64_t p, int64_t m, int64_t v, bool v_shape = false);
/// The plan's schedule, after checking its needs (schedule_problem, core/plan/layout.h): throws
/// UserError naming the values.
Schedule make_schedule(plan::PipelineSchedule schedule, int64_t p, int64_t m, int64_t v);

struct Simulation {
  bool deadlock = false;
  std::string problem;                         // what blocks, when deadlocked or inconsistent
  double forward_time = 1, backward_time = 2;  // per full stage; a chunk takes 1/v of it
                                               // (B and W: half of backward_time each)
  double makespan = 0;                         // finish time of the last action
  double bubble = 0;                           // (makespan − ideal) / ideal, ideal = m·(F + B)
  std::vector<int64_t>
      peak_activations;  // per rank: micro-batch chunks forwarded, not yet backwarded (W)
  std::vector<int64_t> peak_deferred;  // per rank: micro-batch chunks past B, not yet past W
  struct Slot {
    double start, end;
    Action action;
  };
  std::vector<std::vector<Slot>> timeline;  // per rank, compute actions only
  /// Whether every rank receives from each peer in the order the peer sends to it (what
  /// backends that match point-to-point messages by order, like NCCL, need).
  bool ordered_messages = true;
};

/// A gradient pass's peak (a backward, or a W: the passes that hand parameters their gradients)
/// above what is held once the micro-batch's bytes it frees are freed. Where the chunk's
/// gradients accumulate in its parameters and are reduced at its last pass of the step
/// (ChunkBytes::grads > 0), its first, middle and last passes differ; a chunk with one pass
/// reduces at once, as `during`.
struct GradPass {
  double during = 0, during_first = 0, during_middle = 0, during_last = 0;
};

/// What one micro-batch of a rank's local chunk holds: `whole` from its forward to its backward
/// (or B), `deferred` from its B to its W; what its forward and backward send (kept to the step's
/// end, when sends are waited for only then); what a forward works on above what it keeps
/// (`during_forward`), what a B works on above what is held once `whole` is freed
/// (`during_input`), and the peaks of its gradient passes. `grads`: held from the end of
/// the chunk's first gradient pass of the step to the end of its last, where they accumulate in
/// the parameters.
struct ChunkBytes {
  double whole = 0, deferred = 0, sent_forward = 0, sent_backward = 0;
  double during_forward = 0, during_input = 0, grads = 0;
  GradPass backward, weight;
};

/// The most rank `rank` holds at once in `timeline` (a simulated run's, or any list of a rank's
/// actions in order), chunks[c] being its local chunk c's bytes; `beside[k]`, when given, what
/// the rank holds besides at slot k's peak (ZeRO-3's gathered blocks). `at`: the peak's slot.
double peak_held(const std::vector<Simulation::Slot>& timeline,
                 const std::vector<ChunkBytes>& chunks, const std::vector<double>& beside = {},
                 size_t* at = nullptr);

/// Runs the lists with the given unit times as the executor runs them over Gloo: sends never
/// block, a receive is posted where it stands, and a pass waits for its inputs: a forward for its
/// activation's send, a backward for its forward and its gradient's send.
Simulation simulate(const Schedule& s, double forward_time = 1, double backward_time = 2);

/// Runs the lists grouped as the executor posts them (the sends and receives between two
/// computations form one batch, and a rank posts its next batch only once the previous one is
/// complete), with sends that complete only when the peer has posted the matching receive: NCCL's
/// rendezvous for large messages. Returns "" when every rank finishes, else what blocks.
std::string rendezvous_deadlock(const Schedule& s);

/// The rank × time grid (one column per unit of forward time), e.g. "rank 0 | F0 F1 B0 B0 ...".
std::string render(const Schedule& s, const Simulation& sim);

}  // namespace tessel::parallel::pp
