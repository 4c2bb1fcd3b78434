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

namespace tessel::parallel::pp {

enum class Op { kRecvAct, kForward, kSendAct, kRecvGrad, kBackward, kSendGrad };

struct Action {
  Op op;
  int64_t microbatch;
  int64_t chunk;  // model chunk on this rank (0 unless interleaved)
  bool operator==(const Action& o) const {
    return op == o.op && microbatch == o.microbatch && chunk == o.chunk;
  }
};

struct Schedule {
  std::string name;                                          // gpipe | 1f1b | interleaved | ...
  int64_t stages = 1, microbatches = 1, virtual_stages = 1;  // p, m, v
  std::vector<std::vector<Action>> ranks;                    // [p] lists
  bool backward = true;                                      // false: forward passes only
};

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
/// Forward passes only (evaluation): each rank runs its chunks in order, every micro-batch
/// through chunk 0, then through chunk 1, ...
Schedule forward_only(int64_t p, int64_t m, int64_t v);
/// By name (gpipe | 1f1b | interleaved), after checking the schedule's needs; throws UserError
/// naming the values (1f1b and interleaved need m >= p; interleaved also m % p == 0 and v >= 2).
Schedule make_schedule(const std::string& name, int64_t p, int64_t m, int64_t v);

struct Simulation {
  bool deadlock = false;
  std::string problem;                         // what blocks, when deadlocked or inconsistent
  double forward_time = 1, backward_time = 2;  // per full stage; a chunk takes 1/v of it
  double makespan = 0;                         // finish time of the last action
  double bubble = 0;                           // (makespan − ideal) / ideal, ideal = m·(F + B)
  std::vector<int64_t>
      peak_activations;  // per rank: micro-batch chunks forwarded, not yet backwarded
  struct Slot {
    double start, end;
    Action action;
  };
  std::vector<std::vector<Slot>> timeline;  // per rank, compute actions only
  /// Whether every rank receives from each peer in the order the peer sends to it (what
  /// backends that match point-to-point messages by order, like NCCL, need).
  bool ordered_messages = true;
};

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
