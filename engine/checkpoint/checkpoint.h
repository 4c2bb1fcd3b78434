// Checkpoints: <checkpoint.dir>/step_<N>/ holding one safetensors file per rank
// (rank_<r>.safetensors), index.json (every tensor's global shape and which file holds which
// slice), config.yaml (the resolved plan) and COMPLETE, written last. Files are written under
// temporary names, fsynced and renamed; <checkpoint.dir>/latest is replaced atomically after the
// marker. A directory without COMPLETE is never read.
#pragma once

#include <set>
#include <string>

#include "core/optim/loss_scale.h"
#include "core/optim/optim.h"
#include "core/plan/config.h"
#include "models/from_plan.h"
#include "models/registry.h"
#include "parallel/mesh.h"

namespace tessel::checkpoint {

struct CheckpointState {
  int64_t step;
  int64_t consumed_samples;  // the data position: one counter
};

/// Writes step_<N>: model weights by global name, fp32 master weights and AdamW moments
/// (optim.*), the fp16 loss scale, and the run state. Prunes beyond checkpoint.keep. Returns the
/// folder. The first data replica's tp×pp ranks write what replicas share; under ZeRO every data
/// rank writes its pieces (a piece is a range of the flattened tensor-parallel slice: the index
/// records it as "flat": [begin, end) beside the slice). Every rank then meets at a barrier, so
/// none goes on (or resumes) before the checkpoint is published.
std::string save_checkpoint(const plan::Config& c, const parallel::Mesh& mesh,
                            models::Decoder& model, const optim::FlatAdamW& opt,
                            const optim::LossScaler& scaler, const CheckpointState& st);

/// The bytes one checkpoint of this plan takes on disk, all ranks' files together: each
/// parameter in the run's dtype, its fp32 master copy and two fp32 AdamW moments.
double checkpoint_bytes(const plan::Config& c);

/// Start-up (rank 0): the filesystem of checkpoint.dir has room for one more checkpoint (the
/// previous one is pruned only after the next is complete); UserError naming the folder, the
/// free space and the estimate otherwise.
void check_room_for_checkpoint(const plan::Config& c);

/// The checkpoint folder a user named: a step_<N> folder, or a checkpoint.dir (then its latest).
/// Throws UserError unless the folder is complete.
std::string resolve_checkpoint(const std::string& dir);

/// Global tensors of a complete checkpoint whose names start with `prefix` (slices assembled).
models::Weights read_checkpoint_tensors(const std::string& step_dir,
                                        const std::string& prefix = "");

/// Those of `names` (the others are not read).
models::Weights read_checkpoint_tensors(const std::string& step_dir,
                                        const std::set<std::string>& names);

/// The model weights of a complete checkpoint by global name, fp32 (the master copy where held).
/// `m`: the checkpoint's model; every one of its parameters must be in the index with its
/// global size (a UserError naming the missing or misshapen ones, before anything is read).
models::Weights checkpoint_model_weights(const std::string& step_dir, const models::ModelShape& m);

/// The checkpoint a run continues from, per checkpoint.resume: "" when it starts afresh.
std::string checkpoint_to_resume(const plan::Config& c);

/// Restores model weights, optimizer state (into this rank's ZeRO pieces, whatever layout wrote
/// it), the fp16 loss scale (when `scaler` is given) and run state from a complete checkpoint.
CheckpointState load_checkpoint(const std::string& step_dir, models::Decoder& model,
                                optim::FlatAdamW& opt, optim::LossScaler* scaler = nullptr);

/// save_pretrained's default max_shard_size, "5GB": 5·10^9 bytes.
inline constexpr int64_t kDefaultMaxShardBytes = 5'000'000'000;

/// A shard size as save_pretrained's max_shard_size takes it: bytes, or a number with KB, MB, GB
/// (powers of 10) or KiB, MiB, GiB (powers of 2): "5GB", "200MiB". UserError naming `what`.
int64_t parse_shard_size(const std::string& text, const std::string& what);

/// `tessel-train export`: Hugging Face-named weights + config.json into out_dir: one
/// model.safetensors, or above `max_shard_bytes` the shards model-0000K-of-0000N.safetensors and
/// model.safetensors.index.json, as save_pretrained writes them.
/// `tokenizer` (a tokenizer.json or its folder; empty: none): copied beside the weights with
/// tokenizer_config.json and special_tokens_map.json (written when the source has none), and its
/// bos/eos ids go into config.json and generation_config.json.
/// `what` names the setting in errors (export --out, checkpoint.export_hf).
void export_hf(const std::string& checkpoint_dir, const std::string& out_dir,
               const std::string& tokenizer = "", const std::string& what = "export --out",
               int64_t max_shard_bytes = kDefaultMaxShardBytes);

/// The checks export_hf makes of out_dir before writing, made at start-up for
/// checkpoint.export_hf: a UserError when out_dir lies inside checkpoint_dir or holds files an
/// export does not write.
void check_export_folder(const std::string& out_dir, const std::string& checkpoint_dir,
                         const std::string& what);

}  // namespace tessel::checkpoint
