// The flat layout of this rank's parameters, shared by the optimizer, the gradient reduction and
// ZeRO. Parameters sit in one flat buffer in reverse registration order (the order backward
// produces gradients in), cut into buckets: a bucket never straddles two pipeline chunks, and
// under ZeRO-3 never two layer units (a unit is gathered as its buckets). With `shards` > 1
// (ZeRO over the dp×cp group) each bucket is zero-padded to a multiple of `shards` and shard
// rank r owns piece r of every bucket (an MoE layer's experts' buckets: of `expert_shards`, over
// the ranks holding the same experts), as Megatron's distributed optimizer does: one
// reduce-scatter per bucket leaves each rank the summed gradient of exactly the elements whose
// AdamW state it keeps. This rank's pieces, bucket after bucket, form its shard buffer.
//
//   flat:   | bucket 0 (piece 0 | piece 1) | bucket 1 (piece 0 | piece 1) | ...   [numel]
//   shard:  | bucket 0 piece r | bucket 1 piece r | ...                            [shard_numel]
//
// Every slot, bucket and piece starts on a multiple of kAlignElements (zero padding between
// them): each parameter view, ZeRO shard boundary and communication bucket is then aligned for
// any dtype's vector loads, and CUDA's grouped matmul (at::_grouped_mm, the MoE experts) refuses
// operands that are not 16-byte aligned. Without it, an odd shard count (dp×cp = 3, 6, ...) left
// later parameters at odd offsets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/plan/layout.h"

namespace tessel::optim {

/// The alignment of every slot, bucket and piece, in elements (128 bytes of bf16, 256 of fp32).
constexpr int64_t kAlignElements = 64;

struct Slot {
  std::string name;       // global parameter name
  int64_t offset, numel;  // range of the flat buffer
  int64_t bucket;
};

struct FlatBucket {
  int64_t begin, end;    // range of the flat buffer, padded: a multiple of kAlignElements·shards
  int64_t chunk;         // the pipeline chunk whose backward fills it
  int64_t params;        // parameters in it
  std::string unit;      // ZeRO-3 gather unit: "layers.<i>" or "root" (everything else)
  int64_t shard_offset;  // where this rank's piece starts in the shard buffer
  bool expert = false;   // MoE experts only: reduced over the expert data group
  int64_t shards = 1, shard_rank = 0;  // its ZeRO split: the data group's, or (experts) the
                                       // expert data group's
};

/// One contiguous part of a parameter that this rank's shard holds.
struct Piece {
  int64_t param_offset;  // first element, within the flattened parameter
  int64_t flat;          // position in the flat buffer
  int64_t shard;         // position in the shard buffer
  int64_t numel;
};

/// What the layout is built from: each parameter's name, element count and pipeline chunk, in
/// the order they take in the flat buffer.
struct ParamEntry {
  std::string name;
  int64_t numel, chunk;
  bool expert = false;  // an MoE layer's experts: never in a bucket with other parameters
};

struct LayoutOptions {
  int64_t bucket_elements = 1;  // cap (ignored under ZeRO-3, where a bucket is a unit)
  int64_t shards = 1, shard_rank = 0;
  plan::Sharding sharding;         // what ZeRO shards (at 3, the weights: a bucket is a unit)
  bool isolate_embedding = false;  // "embed.weight" in a bucket of its own (tied table under pp)
  int64_t expert_shards = 1, expert_shard_rank = 0;  // MoE experts' buckets (expert data group)
};

class FlatLayout {
 public:
  FlatLayout(const std::vector<ParamEntry>& params, const LayoutOptions& o);

  const std::vector<Slot>& slots() const { return slots_; }
  const std::vector<FlatBucket>& buckets() const { return buckets_; }
  int64_t numel() const { return numel_; }  // the flat buffer, padding included
  int64_t shard_numel() const { return shard_numel_; }
  int64_t shards() const { return o_.shards; }
  int64_t shard_rank() const { return o_.shard_rank; }
  /// Whether any bucket is split over several ranks (ZeRO over more than one).
  bool sharded() const { return o_.shards > 1 || o_.expert_shards > 1; }
  const plan::Sharding& sharding() const { return o_.sharding; }
  /// Elements of one piece of bucket `b` (its length / shards).
  int64_t piece_numel(const FlatBucket& b) const { return (b.end - b.begin) / b.shards; }
  /// The flat position of this rank's piece of `b`.
  int64_t piece_flat(const FlatBucket& b) const { return b.begin + b.shard_rank * piece_numel(b); }
  /// The part of `slot` in this rank's shard (none, or one range: a parameter lies in one bucket).
  std::vector<Piece> pieces(const Slot& slot) const;
  /// The slot of a parameter (throws std::out_of_range for a name this rank does not hold).
  const Slot& slot(const std::string& name) const;

 private:
  LayoutOptions o_;
  std::vector<Slot> slots_;
  std::vector<FlatBucket> buckets_;
  int64_t numel_ = 0, shard_numel_ = 0;
};

/// The ZeRO-3 unit of a parameter: "layers.<i>" for a block's parameters, else "root".
std::string unit_of(const std::string& name);

}  // namespace tessel::optim
