// `tessel-train export`: a checkpoint's global weights under Hugging Face's names, with
// config.json (and the tokenizer when given), into a folder of their own.
#include <c10/util/accumulate.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "core/optim/state_names.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/index.h"
#include "engine/io/safetensors.h"
#include "engine/io/tokenizer.h"
#include "engine/io/weights.h"

namespace fs = std::filesystem;

namespace tessel::checkpoint {

namespace {

// Copies the tokenizer files into `out` and returns its special tokens.
io::SpecialTokens export_tokenizer(const std::string& tokenizer, const fs::path& out,
                                   const plan::ModelConfig& m) {
  fs::path src = tokenizer;
  if (fs::is_directory(src)) src /= "tokenizer.json";
  if (!fs::is_regular_file(src))
    throw plan::UserError("--tokenizer: " + src.string() + " does not exist");
  auto s = io::special_tokens(src.string());
  if (s.vocab_size > m.vocab_size)
    throw plan::UserError("--tokenizer " + src.string() + " has " + std::to_string(s.vocab_size) +
                          " ids but the model's vocabulary (model.vocab_size) is " +
                          std::to_string(m.vocab_size));
  fs::copy_file(src, out / "tokenizer.json", fs::copy_options::overwrite_existing);
  for (const char* extra : {"tokenizer_config.json", "special_tokens_map.json"})
    if (fs::exists(src.parent_path() / extra))
      fs::copy_file(src.parent_path() / extra, out / extra, fs::copy_options::overwrite_existing);
  nlohmann::json specials = nlohmann::json::object();
  if (s.bos) specials["bos_token"] = s.bos_text;
  if (s.eos) specials["eos_token"] = s.eos_text;
  if (!fs::exists(out / "tokenizer_config.json")) {
    auto cfg = specials;
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast";
    cfg["model_max_length"] = m.max_seq_len;
    // Decoder-only: no token_type_ids, which the fast tokenizer would otherwise return and
    // transformers' generate(**tokenizer(text)) would pass on to a model that takes none.
    cfg["model_input_names"] = {"input_ids", "attention_mask"};
    io::write_file_atomic((out / "tokenizer_config.json").string(), cfg.dump(2) + "\n");
  }
  if (!fs::exists(out / "special_tokens_map.json"))
    io::write_file_atomic((out / "special_tokens_map.json").string(), specials.dump(2) + "\n");
  return s;
}

}  // namespace

models::Weights checkpoint_model_weights(const std::string& step_dir, const models::ModelShape& m) {
  // The plan's parameters, from the plan alone, against the index before any tensor is read.
  const auto tensors = read_index(step_dir).at("tensors");
  std::set<std::string> names;
  std::vector<std::string> wrong;
  for (const auto& p : models::param_entries(m, /*tp=*/1)) {
    names.insert(p.name);
    names.insert(optim::kSlotPrefixes[0] + p.name);
    if (!tensors.contains(p.name)) {
      wrong.push_back(p.name + " (missing)");
      continue;
    }
    const auto shape = tensors.at(p.name).at("shape").get<std::vector<int64_t>>();
    if (c10::multiply_integers(shape) != p.numel)  // read_index bounds it at 2^53: exact
      wrong.push_back(fmt::format("{} is [{}], the model's has {} elements", p.name,
                                  fmt::join(shape, ", "), p.numel));
  }
  if (!wrong.empty())
    throw plan::UserError(fmt::format(
        "{}: the index does not hold the model its config.yaml describes ({} of {} parameters: "
        "{}{})",
        (fs::path(step_dir) / "index.json").string(), wrong.size(), names.size() / 2,
        fmt::join(wrong.begin(), wrong.begin() + std::min<size_t>(wrong.size(), 4), "; "),
        wrong.size() > 4 ? "; ..." : ""));
  // The fp32 master copy is exact for bf16 runs too (their model weights are its rounding).
  auto all = read_checkpoint_tensors(step_dir, names);
  models::Weights w;
  for (auto& [name, t] : all)
    if (!optim::is_optimizer_state(name)) {
      auto master = all.find(optim::kSlotPrefixes[0] + name);
      w[name] = (master != all.end() ? master->second : t).to(torch::kFloat32);
    }
  return w;
}

namespace {

// The files an export writes: a folder holding only these is a previous export.
const std::set<std::string> kExportFiles = {"model.safetensors",      "config.json",
                                            "generation_config.json", "tokenizer.json",
                                            "tokenizer_config.json",  "special_tokens_map.json",
                                            io::kShardIndex};

bool export_file(const std::string& name) {  // one of kExportFiles, or a shard
  static const std::regex shard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  return kExportFiles.count(name) > 0 || std::regex_match(name, shard);
}

// The weights as save_pretrained writes them: one model.safetensors, or shards filled in order up
// to `max_bytes` (a tensor larger than that alone in its own) and the index naming each tensor's.
void write_hf_weights(const fs::path& out,
                      const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      int64_t max_bytes) {
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> shards(1);
  int64_t size = 0, total = 0;
  for (const auto& [name, t] : tensors) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (!shards.back().empty() && size + bytes > max_bytes) shards.emplace_back(), size = 0;
    shards.back().emplace_back(name, t);
    size += bytes, total += bytes;
  }
  if (shards.size() == 1) {
    io::write_safetensors((out / "model.safetensors").string(), tensors, {{"format", "pt"}});
    return;
  }
  nlohmann::json map = nlohmann::json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    const auto file = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size());
    io::write_safetensors((out / file).string(), shards[k], {{"format", "pt"}});
    for (const auto& [name, t] : shards[k]) map[name] = file;
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
  io::write_file_atomic((out / io::kShardIndex).string(), index.dump(2) + "\n");
}

// The files of out_dir an export would replace (a previous export's), in name order. An export
// never writes into a checkpoint (`guarded`: a step folder or a checkpoint folder, and the folder
// above it) and never mixes with other files: either is refused, naming the folder. `what` names
// the setting in the message (export --out, checkpoint.export_hf).
std::vector<std::string> export_folder_previous(const std::string& out_dir,
                                                const std::string& guarded_dir,
                                                const std::string& what) {
  std::error_code ec;
  const auto out = fs::weakly_canonical(out_dir, ec);
  const auto step = fs::weakly_canonical(guarded_dir, ec);
  for (const auto& guarded : {step, step.parent_path()})
    for (auto p = out; !p.empty(); p = p.parent_path()) {
      if (p == guarded)
        throw plan::UserError(
            fmt::format("{} {}: inside the checkpoint folder {}; export into a folder of its own",
                        what, out_dir, guarded.string()));
      if (p == p.parent_path()) break;
    }
  std::vector<std::string> previous, other;
  if (!fs::is_directory(out_dir, ec)) return previous;
  for (const auto& e : fs::directory_iterator(out_dir, ec))
    (export_file(e.path().filename().string()) && e.is_regular_file() ? previous : other)
        .push_back(e.path().filename().string());
  std::sort(other.begin(), other.end());
  if (!other.empty())
    throw plan::UserError(fmt::format(
        "{} {}: the folder holds files an export does not write ({}); export into a new or "
        "empty folder, or a previous export's",
        what, out_dir, fmt::join(other, ", ")));
  std::sort(previous.begin(), previous.end());
  return previous;
}

// A folder holding only export files is emptied first (said in the log), so that no stale
// tokenizer stays beside new weights.
void prepare_export_folder(const std::string& out_dir, const std::string& step_dir,
                           const std::string& what) {
  const auto previous = export_folder_previous(out_dir, step_dir, what);
  if (previous.empty()) return;
  for (const auto& f : previous) fs::remove(fs::path(out_dir) / f);
  spdlog::info("export: replacing the previous export in {} (removed {})", out_dir,
               fmt::join(previous, ", "));
}

// What the exported class (MixtralForCausalLM without per-head norms, else Qwen3MoeForCausalLM)
// would not compute as Tessel does: each named, or empty.
std::vector<std::string> moe_differences(const models::ModelShape& m) {
  std::vector<std::string> d;
  const auto& e = m.moe;
  if (e.experts == 0) return d;
  const bool mixtral = !m.qk_norm;
  if (e.shared > 0)
    d.push_back("shared experts (written as mlp.shared_experts.*, DeepSeek's names)");
  if (e.score != plan::RouterScore::kSoftmax) d.push_back("router.score " + plan::name_of(e.score));
  if (mixtral && e.every != 1) d.push_back("dense layers between MoE layers (moe.every)");
  if (mixtral && !e.norm_topk) d.push_back("router.norm_topk false");
  if (e.bias_update_rate > 0)
    d.push_back("the balance bias of expert choice (model.moe.bias_update_rate; not written)");
  return d;
}

}  // namespace

void check_export_folder(const std::string& out_dir, const std::string& checkpoint_dir,
                         const std::string& what) {
  // A step folder's guard covers the checkpoint folder too (its parent).
  export_folder_previous(out_dir, (fs::path(checkpoint_dir) / "step_0").string(), what);
}

int64_t parse_shard_size(const std::string& text, const std::string& what) {
  static const std::regex form(R"(\s*([0-9]+(?:\.[0-9]+)?)\s*(|B|KB|MB|GB|KiB|MiB|GiB)\s*)");
  std::smatch m;
  double bytes = 0;
  if (std::regex_match(text, m, form)) {
    static const std::map<std::string, double> unit = {
        {"", 1},     {"B", 1},         {"KB", 1e3},      {"MB", 1e6},
        {"GB", 1e9}, {"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", double(1 << 30)}};
    bytes = std::stod(m[1].str()) * unit.at(m[2].str());
  }
  if (!(bytes >= 1 && bytes <= 1e15))
    throw plan::UserError(fmt::format(
        "{}: '{}' is not a shard size: bytes, or a number with KB, MB, GB (powers of 10) or "
        "KiB, MiB, GiB (powers of 2), from 1 byte to 1 PB, as save_pretrained's max_shard_size",
        what, text));
  return static_cast<int64_t>(bytes);
}

void export_hf(const std::string& checkpoint_dir, const std::string& out_dir,
               const std::string& tokenizer, const std::string& what, int64_t max_shard_bytes) {
  const std::string dir = resolve_checkpoint(checkpoint_dir);
  plan::Config c = plan::load_config((fs::path(dir) / "config.yaml").string());
  const auto w = checkpoint_model_weights(dir, models::model_shape(c.model));
  const auto& arch = models::arch(c.model.arch);
  prepare_export_folder(out_dir, dir, what);  // once the checkpoint has been read
  fs::create_directories(out_dir);
  write_hf_weights(out_dir, arch.to_hf(w, models::model_shape(c.model)), max_shard_bytes);
  auto config = arch.hf_config(models::model_shape(c.model));
  if (!tokenizer.empty()) {
    auto s = export_tokenizer(tokenizer, out_dir, c.model);
    nlohmann::json gen = {{"_from_model_config", true}};
    for (auto [key, id] : {std::pair{"bos_token_id", s.bos}, std::pair{"eos_token_id", s.eos}})
      if (id) config[key] = gen[key] = *id;
    io::write_file_atomic((fs::path(out_dir) / "generation_config.json").string(),
                          gen.dump(2) + "\n");
  }
  io::write_file_atomic((fs::path(out_dir) / "config.json").string(), config.dump(2) + "\n");
  if (const auto d = moe_differences(models::model_shape(c.model)); !d.empty())
    spdlog::warn(
        "export: {} has no {} in transformers: the weights are all written, but its "
        "from_pretrained would not compute this model",
        config["architectures"][0].get<std::string>(), fmt::join(d, ", "));
  spdlog::info("exported {} ({} tensors{}) to {}", dir, w.size(),
               tokenizer.empty() ? "" : ", with the tokenizer", out_dir);
}

}  // namespace tessel::checkpoint
