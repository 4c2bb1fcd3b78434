// Typed collectives over one process group. Every call gets a sequence number; a failed or
// timed-out operation is rethrown naming the group, its ranks, the operation, the sequence
// number and this rank. Groups of one process skip communication (identity).
#pragma once

#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/plan/choices.h"

namespace tessel::parallel {

/// A collective or point-to-point transfer that failed or timed out (names the operation, its
/// group, sequence number and this rank).
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A pending collective; wait() blocks (Gloo) or orders the current stream (NCCL).
class Work {
 public:
  Work() = default;  // already complete
  Work(c10::intrusive_ptr<c10d::Work> w, std::string what)
      : w_(std::move(w)), what_(std::move(what)) {}
  void wait();
  bool defined() const { return static_cast<bool>(w_); }
  /// Finished (or nothing to wait for); never blocks.
  bool completed() const { return !w_ || w_->isCompleted(); }

 private:
  c10::intrusive_ptr<c10d::Work> w_;
  std::string what_;
};

/// One point-to-point transfer of a batch (see Group::send_recv).
struct P2POp {
  enum Kind { kSend, kRecv } kind;
  torch::Tensor tensor;
  int64_t peer;  // rank within the group
  int tag = 0;   // tells apart messages between the same pair (Gloo; NCCL and channels match
                 // by order)
};

class Group {
 public:
  /// `backend`: null for a group of one, or for a group that is described but not connected
  /// (every operation on it throws). `owner`: false when the communicator is another group's of
  /// the same members (Mesh::create), which shuts it down.
  Group(std::string name, std::vector<int64_t> ranks, int64_t global_rank,
        c10::intrusive_ptr<c10d::Backend> backend, bool owner = true);

  const std::string& name() const { return name_; }
  const std::vector<int64_t>& ranks() const { return ranks_; }
  int64_t rank() const { return rank_; }  // index of this process in ranks()
  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }
  /// Payload bytes this rank handed to collectives so far (nccl-tests' "size": the buffer of an
  /// all-reduce, the whole output of an all-gather, the whole input of a reduce-scatter or an
  /// all-to-all), its
  /// side channel's included.
  int64_t bytes() const;
  /// Bytes this rank sent point-to-point (send_recv) so far, its side channel's, its
  /// point-to-point channels' and its split's included.
  int64_t sent_bytes() const;
  /// A second channel between the same ranks, with a communicator of its own (on NCCL its own
  /// stream, on Gloo its own threads), for collectives that run beside this group's instead of
  /// queueing behind them (ZeRO-3's weight gathers beside the gradient reduce-scatters); this
  /// group itself when it has none. Its bytes count as this group's.
  Group& side() { return side_ ? *side_ : *this; }
  bool has_side() const { return static_cast<bool>(side_); }
  /// `side`: the same ranks, in the same order.
  void set_side(std::unique_ptr<Group> side);
  /// Point-to-point channels: a two-rank group with a communicator of its own for each ordered
  /// pair (from, to) of this group's ranks that exchange messages. A channel carries messages one
  /// way only, matched in order (its tag is always 0), so on NCCL each direction runs on its own
  /// stream and a wait on a receive never waits on a send. `channel`: ranks {global rank of
  /// from, global rank of to}.
  void add_channel(int64_t from, int64_t to, std::unique_ptr<Group> channel);
  int64_t channels() const { return static_cast<int64_t>(channels_.size()); }
  /// A two-level split of this group (hybrid context parallelism, hybrid sharding): `inner`, the
  /// block of consecutive ranks this rank belongs to, and `outer`, the ranks at this rank's place
  /// in every block. Null until set. Their bytes count as this group's.
  void set_split(std::unique_ptr<Group> inner, std::unique_ptr<Group> outer);
  Group* inner() const { return inner_.get(); }
  Group* outer() const { return outer_.get(); }
  /// Whether operations reach the other ranks: a communicator, or a group of one.
  bool connected() const { return size() == 1 || backend_; }
  /// "gloo", "nccl", or "none" for a group of one (or not connected).
  std::string backend_name() const { return backend_ ? backend_->getBackendName() : "none"; }
  /// NCCL: collectives run in place and their waits order the stream instead of blocking.
  bool is_nccl() const { return kind_ == plan::Backend::kNccl; }
  /// Gloo: CUDA tensors go through host copies (staged).
  bool is_gloo() const { return kind_ == plan::Backend::kGloo; }

  Work all_reduce(torch::Tensor& t, c10d::ReduceOp op = c10d::ReduceOp::SUM);
  /// Sums `tensors` (one dtype and device; any shapes, views allowed) with one all-reduce: they
  /// are packed into `staging` (a flat buffer kept by the caller, grown when too small), summed
  /// and unpacked in place. Blocks until done on Gloo; stream-ordered on NCCL.
  void all_reduce_coalesced(const std::vector<torch::Tensor>& tensors, torch::Tensor& staging);
  /// Collectives issued on this group so far (tests count them).
  int64_t calls() const { return seq_; }
  Work broadcast(torch::Tensor& t, int64_t root);
  Work reduce(torch::Tensor& t, int64_t root, c10d::ReduceOp op = c10d::ReduceOp::SUM);
  /// out: [size·n] <- every rank's in: [n] (contiguous), in rank order.
  Work all_gather(torch::Tensor& out, torch::Tensor& in);
  /// out: [n] <- reduction of every rank's slice r of in: [size·n]. `scratch_input`: the caller
  /// drops `in` after the wait, so its contents may be overwritten (Gloo, which has no
  /// reduce-scatter, then all-reduces `in` itself rather than a copy of it).
  Work reduce_scatter(torch::Tensor& out, torch::Tensor& in,
                      c10d::ReduceOp op = c10d::ReduceOp::SUM, bool scratch_input = false);
  /// out and in: [size·n]; slice j of in goes to rank j, slice r of out comes from rank r.
  /// With split sizes (rows of dim 0, one per rank): in_rows[j] rows of `in` go to rank j, and
  /// out_rows[r] rows of `out` come from rank r.
  Work all_to_all(torch::Tensor& out, torch::Tensor& in, const std::vector<int64_t>& out_rows = {},
                  const std::vector<int64_t>& in_rows = {});
  void barrier();
  /// Shuts down this group's communicators (its own unless another group owns it, its side
  /// channel, channels and split), each once: NCCL frees them after their queued work; Gloo has
  /// nothing to free. Returns how many.
  /// No collective may be issued on the group afterwards (Mesh::shutdown calls it).
  int64_t shutdown();
  /// Posts every send and receive of `ops`; returns their works (wait on all of them). With
  /// channels, each goes on its own direction's channel and has a work of its own; without, they
  /// are posted together (one grouped NCCL launch, one work), so that neighbours that both send
  /// first cannot deadlock.
  std::vector<Work> send_recv(const std::vector<P2POp>& ops);

 private:
  std::string what(const char* op);
  // The communicator, for operation `op` (throws naming the group when it is not connected).
  c10d::Backend& backend(const char* op) const;
  // Gloo never sees a CUDA tensor: staged() says when a host copy stands in for `t`, host() makes
  // it, and finish() wraps the work so that wait() copies the host result back (comm.cpp).
  bool staged(const torch::Tensor& t) const;
  torch::Tensor host(const torch::Tensor& t) const;
  Work finish(c10::intrusive_ptr<c10d::Work> w, const torch::Tensor& device,
              const torch::Tensor& host_copy, const char* op);
  std::string name_;
  std::vector<int64_t> ranks_;
  int64_t rank_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  plan::Backend kind_ = plan::Backend::kAuto;  // the communicator's kind (kAuto: none)
  bool owner_ = true;
  int64_t seq_ = 0;
  int64_t bytes_ = 0, sent_bytes_ = 0;
  bool shut_down_ = false;
  std::unique_ptr<Group> side_, inner_, outer_;
  struct Channel {
    int64_t from, to;
    std::unique_ptr<Group> group;
  };
  std::vector<Channel> channels_;
  Group& channel_of(int64_t from, int64_t to);
  Work post(const P2POp& op);               // one send or receive on this group
  std::vector<const Group*> parts() const;  // side channel, channels, split: bytes counted here
};

}  // namespace tessel::parallel
