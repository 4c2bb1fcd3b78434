#include "engine/run/score.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "engine/checkpoint/checkpoint.h"
#include "engine/data/dataset.h"
#include "engine/data/vocabulary.h"
#include "engine/io/safetensors.h"
#include "engine/io/tokenizer.h"
#include "engine/io/weights.h"
#include "engine/run/build.h"
#include "models/registry.h"

namespace tessel::run {
namespace {

void check_ids(const torch::Tensor& tokens, int64_t vocab, const std::string& source) {
  auto bad = ((tokens < 0) | (tokens >= vocab)).nonzero();
  if (bad.size(0) == 0) return;
  int64_t r = bad[0][0].item<int64_t>(), k = bad[0][1].item<int64_t>();
  throw plan::UserError(source + ": token id " + std::to_string(tokens[r][k].item<int64_t>()) +
                        " at row " + std::to_string(r) + ", column " + std::to_string(k) +
                        " is outside model.vocab_size " + std::to_string(vocab));
}

// Mean loss of rows [B, T+1] (int64) in micro-batches of training.micro_batch.
// The model's mean next-token loss over `rows` (micro-batch by micro-batch); their logits to
// `logits_out` when given.
ScoreResult rows_loss(models::Decoder& model, const plan::Config& c, const torch::Tensor& rows,
                      const std::string& logits_out = "") {
  torch::NoGradGuard no_grad;
  const auto device = model->parameters().front().device();
  const int64_t b = rows.size(0), t = rows.size(1) - 1;
  const int64_t eod = data::document_eod(c);  // -1: no document mask
  double total = 0;
  std::vector<torch::Tensor> logits;
  for (int64_t first = 0; first < b; first += c.training.micro_batch) {
    const auto host = rows.narrow(0, first, std::min(c.training.micro_batch, b - first));
    const auto docs = micro_batch_documents(c, eod, host, device);  // data.document_mask
    auto part = to_device(host, device);
    total +=
        model->loss_sum(part, docs.empty() ? nullptr : &docs[0]).to(torch::kFloat64).item<double>();
    if (!logits_out.empty())
      logits.push_back(model->forward(part.narrow(1, 0, t), docs.empty() ? nullptr : &docs[0])
                           .narrow(-1, 0, c.model.vocab_size)
                           .to(torch::kFloat32)
                           .cpu());
  }
  if (!logits_out.empty())
    io::write_safetensors(logits_out, {{"logits", torch::cat(logits).contiguous()}}, {});
  return {total / static_cast<double>(b * t), b * t, b};
}

ScoreResult score_rows(const plan::Config& c, const std::string& weights, const torch::Tensor& rows,
                       const std::string& logits_out = "") {
  auto model = load_for_inference(c, weights);
  return rows_loss(model, c, rows, logits_out);
}

// The model keys of a Mixtral or Qwen3-MoE config.json beyond llama's: ", moe: {...}" (and
// Qwen3's per-head norms).
std::string moe_keys(const nlohmann::json& j, const std::string& path, bool mixtral) {
  auto key = [&](const char* name) -> const nlohmann::json& {
    if (!j.contains(name))
      throw plan::UserError(path + ": no \"" + std::string(name) + "\" (model_type " +
                            (mixtral ? "mixtral" : "qwen3_moe") + ")");
    return j.at(name);
  };
  std::string moe =
      "{experts: " + key(mixtral ? "num_local_experts" : "num_experts").dump() +
      ", top_k: " + key("num_experts_per_tok").dump() +
      ", ffn_hidden: " + key(mixtral ? "intermediate_size" : "moe_intermediate_size").dump() +
      ", aux_loss_coef: " + j.value("router_aux_loss_coef", nlohmann::json(0.0)).dump();
  if (mixtral) return ", moe: " + moe + "}";
  const auto heads = key("num_attention_heads").get<int64_t>();
  const auto hidden = key("hidden_size").get<int64_t>();
  if (j.contains("head_dim") && j["head_dim"].get<int64_t>() * heads != hidden)
    throw plan::UserError(fmt::format(
        "{}: head_dim {} x num_attention_heads {} != hidden_size {}: Tessel's heads split the "
        "hidden size",
        path, j["head_dim"].get<int64_t>(), heads, hidden));
  if (!j.value("mlp_only_layers", nlohmann::json::array()).empty())
    throw plan::UserError(path + ": mlp_only_layers " + j["mlp_only_layers"].dump() +
                          ": Tessel places MoE layers every decoder_sparse_step only");
  moe += ", every: " + j.value("decoder_sparse_step", nlohmann::json(1)).dump() +
         ", router: {norm_topk: " + j.value("norm_topk_prob", nlohmann::json(false)).dump() + "}";
  return ", qk_norm: true, moe: " + moe + "}";
}

// model.mlp from config.json's activation (activation_function for gpt2, its default gelu_new;
// hidden_act for the llama family, its default silu): the form whose Hugging Face name it is.
std::string mlp_of(const nlohmann::json& j, const std::string& path, bool gpt2) {
  const char* field = gpt2 ? "activation_function" : "hidden_act";
  const std::string act = j.value(field, gpt2 ? "gelu_new" : "silu");
  plan::Choice<plan::ModelArch> arch;
  arch.set_name(gpt2 ? "gpt2" : "llama");
  const auto& a = models::arch(arch);
  std::string held;
  for (const auto& [form, name] : models::hf_forms(a)) {
    if (act == name) return plan::name_of(form);
    held += (held.empty() ? "" : ", ") + name;
  }
  throw plan::UserError(fmt::format("{}: {} \"{}\" is not an MLP Tessel's {} builds ({})", path,
                                    field, act, a.name, held));
}

}  // namespace

plan::Config plan_from_hf_config(const std::string& path, const std::vector<std::string>& sets) {
  std::ifstream f(path);
  if (!f)
    throw plan::UserError(path + ": cannot open (no plan given: the model comes from config.json)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    throw plan::UserError(path + ": not valid JSON (" + e.what() + ")");
  }
  const std::string type = j.value("model_type", "");
  const bool mixtral = type == "mixtral", qwen3_moe = type == "qwen3_moe";
  if (type != "gpt2" && type != "llama" && !mixtral && !qwen3_moe)
    throw plan::UserError(
        path + ": model_type '" + type +
        "' is not one Tessel builds (gpt2, llama, mixtral, qwen3_moe); give a plan "
        "instead");
  auto key = [&](const char* name) -> const nlohmann::json& {
    if (!j.contains(name))
      throw plan::UserError(path + ": no \"" + std::string(name) + "\" (model_type " + type + ")");
    return j.at(name);
  };
  // The model section as YAML, so that the plan's own checks validate it.
  std::string m = std::string("arch: ") + (type == "gpt2" ? "gpt2" : "llama");
  auto put = [&](const char* plan_key, const nlohmann::json& v) {
    m += std::string(", ") + plan_key + ": " + v.dump();
  };
  const bool gpt2 = type == "gpt2";
  put("layers", key(gpt2 ? "n_layer" : "num_hidden_layers"));
  put("hidden", key(gpt2 ? "n_embd" : "hidden_size"));
  put("heads", key(gpt2 ? "n_head" : "num_attention_heads"));
  put("vocab_size", key("vocab_size"));
  put("max_seq_len", key(gpt2 ? "n_positions" : "max_position_embeddings"));
  put("norm_eps", key(gpt2 ? "layer_norm_epsilon" : "rms_norm_eps"));
  if (gpt2 && j.contains("n_inner") && !j["n_inner"].is_null()) put("ffn_hidden", j["n_inner"]);
  if (!gpt2) {
    put("kv_heads", j.value("num_key_value_heads", key("num_attention_heads")));
    put("ffn_hidden", key("intermediate_size"));
    if (j.contains("rope_theta")) put("rope_theta", j["rope_theta"]);
  }
  put("mlp", mlp_of(j, path, gpt2));
  if (mixtral || qwen3_moe) m += moe_keys(j, path, mixtral);
  put("tie_embeddings", nlohmann::json(j.value("tie_word_embeddings", gpt2)));
  // seq_len: the model's whole context (score's windows, generate's limit).
  const auto ctx = key(gpt2 ? "n_positions" : "max_position_embeddings").dump();
  return plan::load_config_text("model: {" + m + "}\ntraining: {seq_len: " + ctx +
                                    ", micro_batch: 1, global_batch: 1}\ndata: {path: [unused]}\n",
                                path, sets);
}

models::Decoder load_for_inference(const plan::Config& c, const std::string& weights) {
  // --weights replaces every parameter, so the plan's init_from is not read first.
  plan::Config plan = c;
  plan.model.init_from.clear();
  auto model =
      make_model(plan, resolve_device(c.training.device), models::resolve_dtype(c.training.dtype));
  namespace fs = std::filesystem;
  // A file, or an export's or a Hugging Face folder; else a checkpoint.
  if (!fs::is_directory(weights) || !io::weights_in_folder(weights).empty()) {
    load_weights_file(model, weights, "--weights");
  } else {  // a checkpoint: a step_<N> folder, or a checkpoint.dir (its latest)
    std::string dir;
    try {
      dir = checkpoint::resolve_checkpoint(weights);
    } catch (const plan::UserError& e) {
      throw plan::UserError(
          "--weights " + weights +
          ": a folder with no model.safetensors (an export's folder) that is not a "
          "complete checkpoint either (" +
          e.what() + ")");
    }
    models::assign_weights(
        model, checkpoint::checkpoint_model_weights(dir, models::model_shape(plan.model)), dir);
  }
  model->eval();
  return model;
}

ScoreResult score(const plan::Config& c, const std::string& weights, const std::string& tokens_path,
                  ScoreTokens token_dtype, const std::string& logits_out) {
  const int64_t row = c.training.seq_len + 1;
  const auto type = token_dtype == ScoreTokens::kUint16   ? torch::kUInt16
                    : token_dtype == ScoreTokens::kUint32 ? torch::kUInt32
                                                          : torch::kInt32;
  const int64_t elem = c10::elementSize(type);
  std::ifstream f(tokens_path, std::ios::binary | std::ios::ate);
  if (!f) throw plan::UserError(tokens_path + ": cannot open the tokens file");
  const int64_t bytes = f.tellg();
  if (bytes == 0 || bytes % (elem * row) != 0)
    throw plan::UserError(
        tokens_path + ": " + std::to_string(bytes) +
        " bytes is not a whole number of rows of training.seq_len+1 = " + std::to_string(row) +
        " " + score_token_names()[static_cast<size_t>(token_dtype)] + " tokens (" +
        std::to_string(elem * row) + " bytes; --token-dtype says which type)");
  const int64_t b = bytes / (elem * row);
  auto tokens = torch::empty({b, row}, type);
  f.seekg(0);
  f.read(static_cast<char*>(tokens.data_ptr()), bytes);
  auto rows = tokens.to(torch::kInt64);
  check_ids(rows, c.model.vocab_size, tokens_path);
  return score_rows(c, weights, rows, logits_out);
}

ScoreResult score_data(const plan::Config& c, const std::string& weights, const std::string& data,
                       const std::string& tokenizer, int64_t max_rows) {
  data::TokenStream stream;
  std::vector<int64_t> ids;
  if (std::filesystem::exists(data + ".idx")) {
    data::add_megatron(stream, data);
  } else if (!tokenizer.empty()) {  // text files, one document each, ended by the tokenizer's eos
    auto eos = io::special_tokens(tokenizer).eos;
    io::TokenizerProcess tok(tokenizer);
    for (const auto& file : data::expand(data)) {
      std::ifstream f(file, std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      const auto encoded = tok.encode({text}, true);  // kept: [0] of a temporary would dangle
      ids.insert(ids.end(), encoded[0].begin(), encoded[0].end());
      if (eos) ids.push_back(*eos);
    }
  } else {
    plan::DataConfig d;
    d.format = plan::DataFormat::kText;
    d.path = {data};
    stream = data::open_stream(d);
  }
  const int64_t t = c.training.seq_len;
  if (ids.empty()) {  // only the windows scored are read (a corpus may be larger than memory)
    const int64_t want = max_rows > 0 ? std::min(stream.size(), max_rows * t + 1) : stream.size();
    ids.resize(static_cast<size_t>(want));
    if (!ids.empty()) stream.read(0, want, ids.data());
  }
  const int64_t n = static_cast<int64_t>(ids.size());
  int64_t b = n > t ? (n - 1) / t : 0;
  if (max_rows > 0) b = std::min(b, max_rows);
  if (b == 0)
    throw plan::UserError(data + ": " + std::to_string(n) + " tokens do not fill one window of " +
                          "training.seq_len+1 = " + std::to_string(t + 1) + " tokens");
  auto all = torch::from_blob(ids.data(), {n}, torch::kInt64);
  auto rows = all.as_strided({b, t + 1}, {t, 1}).clone();  // window i starts at token i·T
  check_ids(rows, c.model.vocab_size, data);
  return score_rows(c, weights, rows);
}

std::vector<int64_t> generate(models::Decoder& model, const plan::Config& c,
                              const std::vector<int64_t>& prompt, const SampleOptions& o) {
  if (prompt.empty()) throw plan::UserError("generate: the prompt has no tokens");
  const int64_t limit = c.model.max_seq_len;
  // Compared as room left, not as a sum: --max-new-tokens near INT64_MAX would overflow it.
  if (o.max_new_tokens > limit - static_cast<int64_t>(prompt.size()))
    throw plan::UserError("generate: the prompt's " + std::to_string(prompt.size()) +
                          " tokens + --max-new-tokens " + std::to_string(o.max_new_tokens) +
                          " exceed model.max_seq_len " + std::to_string(limit));
  for (auto id : prompt)
    if (id < 0 || id >= c.model.vocab_size)
      throw plan::UserError("generate: prompt token " + std::to_string(id) +
                            " is outside model.vocab_size " + std::to_string(c.model.vocab_size));
  torch::NoGradGuard no_grad;
  const auto device = model->parameters().front().device();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<int64_t> out;
  int64_t start = 0;
  auto next_input = torch::tensor(prompt, torch::kInt64).view({1, -1});
  if (!std::isfinite(o.temperature) || o.temperature < 0 || o.top_k < 0)
    throw plan::UserError("generate: --temperature must be a finite number >= 0 and --top-k >= 0");
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    // The prompt once, then one token per step over the cached keys and values.
    auto all = model->decode(next_input.to(device), start);
    start += next_input.size(1);
    // [V] fp32: the last position's logits, padding columns of the vocabulary dropped.
    auto logits = all[0][-1].narrow(0, 0, c.model.vocab_size).to(torch::kFloat32);
    int64_t next;
    if (o.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      // In fp64 and shifted by the maximum first: (l - max) / T is <= 0 everywhere and 0 at the
      // maximum, so a tiny T (1e-300) tends to greedy instead of overflowing to inf and NaN.
      auto l = logits.cpu().to(torch::kFloat64);
      l = (l - l.max()) / o.temperature;
      if (o.top_k > 0 && o.top_k < l.size(0)) {
        auto kth = std::get<0>(l.topk(o.top_k)).min();
        l = l.masked_fill(l < kth, -std::numeric_limits<float>::infinity());
      }
      next = torch::multinomial(l.softmax(0), 1, false, gen).item<int64_t>();
    }
    next_input = torch::tensor({next}, torch::kInt64).view({1, 1});
    out.push_back(next);
    if (o.stop && next == *o.stop) break;
  }
  return out;
}

SplitScore score_split(const plan::Config& c, const std::string& weights, data::SampleSplit split,
                       int64_t max_rows) {
  data::Dataset data(c, {split});
  const auto& sets = data.sources(split);
  if (sets.empty())
    throw plan::UserError(fmt::format(
        "score --split {}: {} holds no {} data: give data.split (e.g. 969,30,1) or data.{}",
        data::split_name(split), c.source, data::split_name(split), data::split_name(split)));
  auto model = load_for_inference(c, weights);
  SplitScore out;
  out.all = {0, 0, 0};
  for (size_t d = 0; d < sets.size(); ++d) {
    const int64_t n = max_rows > 0 ? std::min(max_rows, sets[d].samples) : sets[d].samples;
    ScoreResult r{0, 0, 0};
    for (int64_t first = 0; first < n; first += 1024) {  // a block of rows at a time
      const auto part = rows_loss(model, c,
                                  data.split_batch(split, static_cast<int64_t>(d), first,
                                                   std::min<int64_t>(1024, n - first)));
      r.loss += part.loss * static_cast<double>(part.tokens);
      r.tokens += part.tokens;
      r.rows += part.rows;
    }
    r.loss /= static_cast<double>(r.tokens);
    out.all.loss += data.weights(split)[d] * r.loss;
    out.all.tokens += r.tokens;
    out.all.rows += r.rows;
    out.by_dataset.push_back({sets[d].key, r});
  }
  return out;
}

}  // namespace tessel::run
