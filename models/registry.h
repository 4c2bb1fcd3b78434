// Architecture registry: arch name -> how to build it and how its weights map to and from
// Hugging Face transformers' names (GPT2LMHeadModel, LlamaForCausalLM).
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/optim/optim.h"
#include "models/layers.h"

namespace tessel::models {

using Weights = std::map<std::string, torch::Tensor>;  // global name -> global tensor

struct Arch {
  std::string name;
  DecoderOptions (*options)(const ModelShape&);
  /// Hugging Face names and layouts -> Tessel names; throws UserError naming missing keys. The
  /// tensors are views of the files where the names map one to one; `keep`
  /// (null: every one) the names wanted, so that what must be copied (stacked experts) is copied
  /// only for the parameters a rank holds. Every Hugging Face name must be used either way.
  Weights (*from_hf)(const Weights& hf, const ModelShape&, const std::string& source,
                     const std::set<std::string>* keep);
  /// Tessel -> Hugging Face names and layouts (what save_pretrained writes).
  std::vector<std::pair<std::string, torch::Tensor>> (*to_hf)(const Weights&, const ModelShape&);
  /// config.json for transformers' from_pretrained.
  nlohmann::json (*hf_config)(const ModelShape&);
  /// The activation config.json names for an MLP form (activation_function, hidden_act), or
  /// null where the Hugging Face class cannot hold that form.
  const char* (*hf_activation)(plan::Mlp);
};

const Arch& arch(plan::ModelArch a);

/// The parts model `m`'s architecture builds (DecoderOptions without groups or stages): what
/// code above models/ asks about a model instead of its architecture's name.
DecoderOptions features(const ModelShape& m);

/// The activation name config.json gives model `m`'s MLP form in its architecture's Hugging Face
/// class; throws UserError naming model.mlp, the class and the forms it holds where it cannot hold
/// this one. `use`: what needs the Hugging Face form (named in the error).
std::string hf_activation(const ModelShape& m, const std::string& use);
/// The MLP forms architecture `a`'s Hugging Face class holds, each with config.json's name for it.
std::vector<std::pair<plan::Mlp, std::string>> hf_forms(const Arch& a);

/// Throws UserError naming every tensor of `hf` that was not used, except buffers that carry no
/// weights (attention masks, rotary tables) and a tied head's duplicate.
void check_all_used(const Weights& hf, const std::set<std::string>& used,
                    const std::string& source);

/// Builds the model of a validated plan, every weight drawn from the generator keyed by
/// (seed, global parameter name): the same global model whatever the layout.
/// `tp` (optional) is the tensor-parallel group: the model then holds this rank's shards;
/// `stages` the pipeline stages this rank holds (default: all); `cp` (optional) the
/// context-parallel group, whose attention runs by `cp_method`.
Decoder build_model(const ModelShape& m, int64_t seed, parallel::Group* tp = nullptr,
                    bool sequence_parallel = false, const StagePart& stages = {},
                    parallel::Group* cp = nullptr,
                    plan::CpMethod cp_method = plan::CpMethod::kAllGather,
                    parallel::Group* ep = nullptr);

/// Every trained parameter a rank holds (its tensor-parallel shards of the stages in `stages`, E/ep
/// experts of each MoE layer), in registration order, with its pipeline chunk and whether it is
/// an expert's: named_params' names, sizes, chunks and flags, from the plan alone (--dry-run lays
/// out ZeRO's buckets with it; tests/unit/model_test.cpp checks it against built models).
std::vector<optim::ParamEntry> param_entries(const ModelShape& m, int64_t tp,
                                             const StagePart& stages = {}, int64_t ep = 1);
/// Elements of transformer block `layer` on a tensor-parallel rank (an MoE layer: E/ep experts),
/// from the plan alone.
int64_t block_parameters(const ModelShape& m, int64_t tp, int64_t layer = 0, int64_t ep = 1);
/// Elements a rank holds (its tensor-parallel shards of the stages in `stages`), from the plan
/// alone, without building anything (`--dry-run` sizes plans larger than this machine with it).
/// Equal to the built model's count (tests/unit/model_test.cpp checks).
int64_t parameters_on_rank(const ModelShape& m, int64_t tp, const StagePart& stages,
                           int64_t ep = 1);
/// Of those, the MoE experts' (E/ep per MoE layer of `stages`): what ZeRO splits over the ranks
/// holding the same experts rather than over the data group.
int64_t expert_parameters_on_rank(const ModelShape& m, const StagePart& stages, int64_t ep = 1);
/// Fills every parameter from the keyed generator (see init.cpp for the rules).
void init_weights(Decoder& model, int64_t seed);

/// Loads the tensors of a weights file (read by the layer above: models know no file format),
/// with Tessel names or Hugging Face names (detected), checking that names and shapes match the
/// model exactly; `source` (the file) is named in every error.
void load_weights(Decoder& model, const Weights& tensors, const std::string& source);

/// This rank's parameter tensors by global name (CPU copies in their dtype; shards under tp).
Weights model_weights(Decoder& model);

/// Every parameter of `model` in registration order, with its pipeline chunk and replica count
/// (from the specs), for the optimizer and gradient reduction.
std::vector<optim::NamedParam> named_params(Decoder& model);

/// Checks global tensors `w` against the model (names and global shapes) and copies this rank's
/// slices in.
void assign_weights(Decoder& model, const Weights& w, const std::string& source);

}  // namespace tessel::models
