// tessel-train: train a plan, score sequences, or export a checkpoint. main() is the boundary
// where errors become one clear message and a non-zero exit.
#include <c10/util/Logging.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/device/cpu.h"
#include "core/device/cuda.h"
#include "core/observe/crash.h"
#include "core/observe/interrupt.h"
#include "core/optim/optim.h"
#include "core/plan/config.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/cli/cli_checks.h"
#include "engine/cli/exit.h"
#include "engine/cli/fork_ranks.h"
#include "engine/data/dataset.h"
#include "engine/io/safetensors.h"
#include "engine/io/tokenizer.h"
#include "engine/planner/cpu_profile.h"
#include "engine/planner/planner.h"
#include "engine/run/init_plan.h"
#include "engine/run/score.h"
#include "engine/run/startup.h"
#include "engine/run/stop.h"
#include "engine/run/train.h"
#include "models/registry.h"
#include "parallel/mesh.h"
#include "parallel/pp/schedule.h"

namespace {

struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  bool dry_run = false, help_config = false, details = false;
  int64_t world_size = 0;
  std::string profile, plan_json, profile_steps;
  std::vector<std::string> profile_sets;
};

void add_train_options(CLI::App& app, TrainArgs& a) {
  app.add_option("config", a.config, "YAML plan");
  app.add_option("--set", a.sets, "Override a plan key: section.key=value (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
  app.add_flag("--dry-run", a.dry_run,
               "Validate the plan against the world and print what it costs (memory per rank, "
               "step time, tokens/s, MFU, a faster layout when there is one); start nothing");
  app.add_flag("--details", a.details,
               "With --dry-run: also print the resolved plan (every key, as YAML) and the rank "
               "grid (each rank's coordinates and groups)");
  app.add_option("--world-size", a.world_size,
                 "With --dry-run: the number of processes to plan for")
      ->check(tessel::cli::whole_at_least(1));
  app.add_option("--device-profile", a.profile,
                 "With --dry-run: the device the step time is predicted for: h100, h100-pcie, "
                 "h100-nvl, h200, a100, "
                 "cpu (this machine, measured now), or a YAML file (base, peak_tflops, "
                 "fp32_tflops, intra_node_gbps, inter_node_gbps, gpus_per_node, memory_gib, "
                 "efficiency, ...). Default: cpu for a CPU plan without --world-size, else h100");
  app.add_option("--profile-set", a.profile_sets,
                 "With --dry-run: override a device profile field: key=value (repeatable)")
      ->take_all()
      ->allow_extra_args(false);
  app.add_option("--plan-json", a.plan_json,
                 "With --dry-run: also write the planner's figures (per-rank bytes, "
                 "communication, FLOPs, predicted step time) to this JSON file");
  app.add_option("--profile", a.profile_steps,
                 "Profile training steps (logging.profile): N (N steps after 3 warm-up steps) or "
                 "A-B; writes a trace per rank to <run.output_dir>/profile and prints the "
                 "operators by self time");
  app.add_flag("--help-config", a.help_config,
               "Print the reference of every plan key (Markdown) and exit");
  app.footer(
      "Subcommands:\n  tessel-train score CONFIG --weights W.safetensors (--tokens T.bin | --data "
      "PREFIX|FILES | --split test|valid)\n"
      "  tessel-train generate [CONFIG] --weights W.safetensors|EXPORT_DIR|CHECKPOINT --prompt "
      "TEXT\n"
      "  tessel-train export CHECKPOINT_DIR --format hf --out DIR [--tokenizer tokenizer.json] "
      "[--max-shard-size 5GB]\n"
      "  tessel-train samples CONFIG --out FILE [--split train|valid|test] [--count N] [--skip K] "
      "[--force]");
}

int run_training(const TrainArgs& a, const tessel::parallel::WorldInfo& world) {
  {  // checkpoint.on_signal's default, watched until the plan says which (engine/run/stop.h)
    tessel::plan::Config defaults;
    for (const auto& f : tessel::plan::bind_fields(defaults))
      if (f.key == "checkpoint.on_signal")
        tessel::run::watch_stop_signals(std::get<std::vector<std::string>>(f.def));
  }
  auto start = tessel::run::start_run(a.config, a.sets, world);
  auto peers = start.peers;  // a failure is posted for the other ranks, a hang diagnosed
  try {
    return tessel::run::Trainer(std::move(start), world).train();
  } catch (...) {
    tessel::run::fail_run(peers.get(), std::current_exception());
  }
}

// --dry-run's device: --device-profile; else this CPU, measured now, when the plan would run on it
// here (training.device cpu, or auto without CUDA, and no --world-size); else h100.
tessel::planner::DeviceProfile dry_run_device(const TrainArgs& a, const tessel::plan::Config& c,
                                              int64_t n) {
  std::string spec = a.profile;
  if (spec.empty()) {
    const tessel::plan::TrainDevice dev = c.training.device;
    const bool cpu_here =
        a.world_size == 0 &&
        (dev == tessel::plan::TrainDevice::kCpu ||
         (dev == tessel::plan::TrainDevice::kAuto && !tessel::device::cuda_available()));
    spec = cpu_here ? "cpu" : "h100";
  }
  if (spec != "cpu") return tessel::planner::device_profile(spec, a.profile_sets);
  auto d = tessel::planner::measure_cpu_profile(c, n);
  tessel::planner::apply_profile_overrides(d, a.profile_sets);
  return d;
}

// --dry-run: the plan checked against the world, nothing started.
int plan_dry_run(const TrainArgs& a, const tessel::parallel::WorldInfo& world) {
  tessel::plan::Config c = tessel::run::load_plan(a.config, a.sets);
  const int64_t n = a.world_size > 0 ? a.world_size : world.world;
  // --world-size plans for another machine (a GPU cluster from a laptop): this node's devices
  // are not checked.
  const auto layout = tessel::plan::check_layout(c, n, a.world_size > 0 ? 0 : world.local_world);
  c.parallel.dp = layout.dp;
  const auto device = dry_run_device(a, c, n);
  const auto estimate = tessel::planner::estimate(c, layout, device);
  const auto faster = tessel::planner::faster_layout(c, n, device, estimate);
  std::printf("%s", tessel::planner::dry_run_report(
                        {c, a.config, layout, n, device, estimate, faster, a.details})
                        .c_str());
  if (!a.plan_json.empty())
    tessel::io::write_file_atomic(a.plan_json, tessel::planner::to_json(estimate, device));
  return 0;
}

int run_train(int argc, char** argv) {
  CLI::App app{"tessel-train: train GPT-2 / Llama models from a YAML plan", "tessel-train"};
  TrainArgs a;
  add_train_options(app, a);
  TESSEL_CLI_PARSE(app, argc, argv);
  if (!a.profile_steps.empty()) a.sets.push_back("logging.profile=" + a.profile_steps);
  if (a.help_config) {
    std::fputs(tessel::plan::config_reference().c_str(), stdout);
    return 0;
  }
  if (a.config.empty())
    throw tessel::plan::UserError("no plan given: tessel-train CONFIG.yaml (see --help)");
  const auto world = tessel::parallel::discover_world();
  return a.dry_run ? plan_dry_run(a, world) : run_training(a, world);
}

// `score --split test|valid`: the plan's own split, the loss per dataset and overall.
int print_split_score(const tessel::plan::Config& c, const std::string& weights,
                      const std::string& split, int64_t max_rows) {
  const auto r = tessel::run::score_split(
      c, weights,
      split == "test" ? tessel::data::SampleSplit::kTest : tessel::data::SampleSplit::kValid,
      max_rows);
  nlohmann::json out = {{"split", split},
                        {"loss", r.all.loss},
                        {"tokens", r.all.tokens},
                        {"rows", r.all.rows},
                        {"perplexity", std::exp(r.all.loss)}};
  for (const auto& [key, one] : r.by_dataset)
    out["by_dataset"][key] = {{"loss", one.loss}, {"rows", one.rows}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int run_score(int argc, char** argv) {
  CLI::App app{"tessel-train score: mean next-token loss and perplexity of given sequences",
               "tessel-train score"};
  std::string config, weights, tokens, data, tokenizer;
  int64_t max_rows = 0;
  std::vector<std::string> sets;
  app.add_option("config", config, "YAML plan (model and training.seq_len)")->required();
  app.add_option("--weights", weights,
                 "model.safetensors (Hugging Face or Tessel names), a folder of one or of "
                 "Hugging Face shards (model.safetensors.index.json), or a checkpoint (a "
                 "step_<N> folder, or a checkpoint.dir: its latest)")
      ->required();
  auto* t = app.add_option("--tokens", tokens,
                           "raw little-endian rows of training.seq_len+1 tokens (--token-dtype)");
  auto token_dtype = tessel::run::ScoreTokens::kInt32;
  std::map<std::string, tessel::run::ScoreTokens> token_types;
  for (size_t i = 0; i < tessel::run::score_token_names().size(); ++i)
    token_types[tessel::run::score_token_names()[i]] = static_cast<tessel::run::ScoreTokens>(i);
  app.add_option("--token-dtype", token_dtype,
                 "--tokens element type: int32, or uint16/uint32 as data.format tokens files")
      ->transform(CLI::CheckedTransformer(token_types));
  auto* d = app.add_option("--data", data,
                           "a Megatron prefix (PREFIX.bin/.idx) or text files (one document each), "
                           "cut into windows of training.seq_len+1 tokens");
  std::string split;
  auto* sp = app.add_option("--split", split,
                            "the plan's own test (or valid) split: every sample of each of its "
                            "datasets (data.split, data.test, data.valid), the loss per dataset")
                 ->check(CLI::IsMember({"test", "valid"}));
  t->excludes(d);
  sp->excludes(t);
  sp->excludes(d);
  app.add_option("--tokenizer", tokenizer, "--data text: tokenizer.json (default: byte tokens)");
  app.add_option("--max-rows", max_rows,
                 "--data: score at most this many windows; --split: of each dataset (0: all)")
      ->check(CLI::NonNegativeNumber);
  std::string logits;
  app.add_option("--logits", logits,
                 "--tokens: also write every row's logits ({\"logits\": [rows, seq_len, vocab]} "
                 "fp32) to this safetensors file");
  app.add_option("--set", sets, "Override a plan key: section.key=value (repeatable)")->take_all();
  TESSEL_CLI_PARSE(app, argc, argv);
  if (tokens.empty() + data.empty() + split.empty() != 2)
    throw tessel::plan::UserError("score: give --tokens FILE, --data PREFIX|FILES or --split test");
  const auto c = tessel::plan::load_config(config, sets);
  if (!split.empty()) return print_split_score(c, weights, split, max_rows);
  auto r = tokens.empty() ? tessel::run::score_data(c, weights, data, tokenizer, max_rows)
                          : tessel::run::score(c, weights, tokens, token_dtype, logits);
  nlohmann::json out = {
      {"loss", r.loss}, {"tokens", r.tokens}, {"rows", r.rows}, {"perplexity", std::exp(r.loss)}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

std::vector<int64_t> parse_ids(const std::string& s) {
  std::vector<int64_t> ids;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    try {
      ids.push_back(std::stoll(s.substr(pos, end - pos)));
    } catch (const std::exception&) {
      throw tessel::plan::UserError("--prompt-ids: '" + s.substr(pos, end - pos) +
                                    "' is not a token id (expected e.g. 15496,995)");
    }
    pos = end + 1;
  }
  return ids;
}

struct GenerateArgs {
  std::string config, weights, tokenizer, prompt, prompt_ids;
  std::vector<std::string> sets;
  tessel::run::SampleOptions o;
  bool json = false, no_stop = false;
};

void add_generate_options(CLI::App& app, GenerateArgs& a) {
  app.add_option("config", a.config,
                 "YAML plan (the model); default: the Hugging Face config.json beside --weights "
                 "(as export writes it)");
  app.add_option("--weights", a.weights,
                 "model.safetensors (Hugging Face or Tessel names), a folder of one or of "
                 "Hugging Face shards (model.safetensors.index.json), or a checkpoint (a "
                 "step_<N> folder, or a checkpoint.dir: its latest)")
      ->required();
  app.add_option("--tokenizer", a.tokenizer,
                 "tokenizer.json (default: the one beside --weights, as export writes it)");
  auto* p = app.add_option("--prompt", a.prompt, "Prompt text");
  auto* pi = app.add_option("--prompt-ids", a.prompt_ids, "Prompt token ids, comma-separated");
  p->excludes(pi);
  app.add_option("--max-new-tokens", a.o.max_new_tokens, "Tokens to generate")
      ->check(tessel::cli::whole_at_least(1));
  app.add_option("--temperature", a.o.temperature, "0: greedy; > 0: sample from softmax(logits/T)")
      ->check(tessel::cli::finite_non_negative());
  app.add_option("--top-k", a.o.top_k, "Sample among the k most likely tokens (0: all)")
      ->check(tessel::cli::whole_at_least(0));
  app.add_option("--seed", a.o.seed, "Sampling seed");
  app.add_flag("--no-stop", a.no_stop, "Do not stop at the tokenizer's end-of-sequence token");
  app.add_flag("--json", a.json, "Print one JSON line: prompt_ids, ids, text");
  app.add_option("--set", a.sets, "Override a plan key: section.key=value (repeatable)")
      ->take_all();
}

// --tokenizer, else the tokenizer.json in `folder` if there is one; --prompt needs one.
std::string tokenizer_for(const GenerateArgs& a, const std::filesystem::path& folder) {
  std::string tokenizer = a.tokenizer;
  if (tokenizer.empty()) {
    auto beside = folder / "tokenizer.json";
    if (std::filesystem::exists(beside)) tokenizer = beside.string();
  }
  if (tokenizer.empty() && !a.prompt.empty())
    throw tessel::plan::UserError(
        "generate: --prompt needs a tokenizer (--tokenizer, or tokenizer.json "
        "beside --weights); --prompt-ids needs none");
  return tokenizer;
}

std::vector<int64_t> encode_prompt(tessel::io::TokenizerProcess& tok, const std::string& prompt) {
  const auto encoded = tok.encode({prompt}, true);  // kept: [0] of a temporary would dangle
  return std::vector<int64_t>(encoded[0].begin(), encoded[0].end());
}

// The continuation `out` of the prompt `ids`: as JSON, as text, or (no tokenizer) as ids.
void print_generated(const std::vector<int64_t>& ids, const std::vector<int64_t>& out,
                     tessel::io::TokenizerProcess* tok, bool json) {
  const std::string text = tok ? tok->decode(out, false) : "";
  if (json) {
    nlohmann::json j = {{"prompt_ids", ids}, {"ids", out}, {"text", text}};
    std::printf("%s\n", j.dump().c_str());
  } else if (tok) {
    // Prompt and continuation decoded as one sequence: decoded apart, a SentencePiece decoder
    // drops the space before the first new token and a byte-level one can split a character.
    auto all = ids;
    all.insert(all.end(), out.begin(), out.end());
    std::printf("%s\n", tok->decode(all, true).c_str());
  } else {
    std::printf("%s\n", nlohmann::json(out).dump().c_str());
  }
}

int run_generate(int argc, char** argv) {
  CLI::App app{"tessel-train generate: continue a prompt with the plan's model",
               "tessel-train generate"};
  GenerateArgs a;
  add_generate_options(app, a);
  TESSEL_CLI_PARSE(app, argc, argv);
  if (a.prompt.empty() == a.prompt_ids.empty())
    throw tessel::plan::UserError("generate: give --prompt TEXT or --prompt-ids IDS");
  // Files beside the weights: in the folder --weights names, or beside the file it names.
  const auto folder = std::filesystem::is_directory(a.weights)
                          ? std::filesystem::path(a.weights)
                          : std::filesystem::path(a.weights).parent_path();
  a.tokenizer = tokenizer_for(a, folder);
  const auto c = !a.config.empty()
                     ? tessel::plan::load_config(a.config, a.sets)
                     : tessel::run::plan_from_hf_config((folder / "config.json").string(), a.sets);
  std::unique_ptr<tessel::io::TokenizerProcess> tok;
  if (!a.tokenizer.empty()) {
    tok = std::make_unique<tessel::io::TokenizerProcess>(a.tokenizer);
    if (!a.no_stop) a.o.stop = tessel::io::special_tokens(a.tokenizer).eos;
  }
  const std::vector<int64_t> ids =
      a.prompt.empty() ? parse_ids(a.prompt_ids) : encode_prompt(*tok, a.prompt);
  auto model = tessel::run::load_for_inference(c, a.weights);
  const auto out = tessel::run::generate(model, c, ids, a.o);
  print_generated(ids, out, tok.get(), a.json);
  return 0;
}

int run_export(int argc, char** argv) {
  CLI::App app{"tessel-train export: a checkpoint as Hugging Face safetensors + config.json",
               "tessel-train export"};
  std::string dir, format = "hf", out, tokenizer, shard = "5GB";
  app.add_option("checkpoint", dir, "step_<N> folder, or a checkpoint.dir (its latest)")
      ->required();
  app.add_option("--format", format, "Output format")->check(CLI::IsMember({"hf"}));
  app.add_option("--out", out, "Output folder")->required();
  app.add_option("--tokenizer", tokenizer,
                 "tokenizer.json (or its folder) to write beside the weights, with its bos/eos "
                 "ids in config.json and generation_config.json");
  app.add_option("--max-shard-size", shard,
                 "Above this, the weights go into shards model-0000K-of-0000N.safetensors with "
                 "model.safetensors.index.json, as save_pretrained's max_shard_size (5GB, 200MB, "
                 "2GiB or bytes)")
      ->capture_default_str();
  TESSEL_CLI_PARSE(app, argc, argv);
  tessel::checkpoint::export_hf(
      dir, out, tokenizer, "export --out",
      tessel::checkpoint::parse_shard_size(shard, "export --max-shard-size"));
  return 0;
}

// `samples`: what a plan trains on, written out before any GPU hour is spent.
int run_samples(int argc, char** argv) {
  CLI::App app{
      "tessel-train samples: the token ids of a plan's samples, in the order a run "
      "consumes them (the global batch order, before any rank's share)",
      "tessel-train samples"};
  std::string config, out, split = "train";
  int64_t count = 1, skip = 0;
  std::vector<std::string> sets;
  app.add_option("config", config, "YAML plan (data.*, run.seed, training.seq_len)")->required();
  app.add_option("--split", split,
                 "train; valid or test: each of the split's datasets' samples in turn (an "
                 "evaluation reads the first eval_batches x global_batch of each)")
      ->check(CLI::IsMember({"train", "valid", "test"}))
      ->capture_default_str();
  app.add_option("--count", count, "Samples to write")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 32))
      ->capture_default_str();
  app.add_option("--skip", skip, "Samples to skip first (global batch b starts at b·global_batch)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 53))
      ->capture_default_str();
  app.add_option("--out", out,
                 "Output file: little-endian int32, training.seq_len+1 tokens per sample (the "
                 "inputs and the next-token labels; score --tokens reads it)")
      ->required();
  bool force = false;
  app.add_flag("--force", force,
               "Replace --out if it exists (never one of the plan's inputs, a folder or a device)");
  app.add_option("--set", sets, "Override a plan key: section.key=value (repeatable)")->take_all();
  TESSEL_CLI_PARSE(app, argc, argv);
  const auto c = tessel::plan::load_config(config, sets);
  const auto which = split == "train"   ? tessel::data::SampleSplit::kTrain
                     : split == "valid" ? tessel::data::SampleSplit::kValid
                                        : tessel::data::SampleSplit::kTest;
  tessel::data::write_samples(c, which, skip, count, out, force);
  spdlog::info("samples {}..{} of the {} split ({} int32 tokens each) written to {}", skip,
               skip + count - 1, split, c.training.seq_len + 1, out);
  return 0;
}

// The command's exit status; every error becomes one message here.
int run_command(int argc, char** argv, const std::string& who) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if (cmd == "score") return run_score(argc - 1, argv + 1);
    if (cmd == "export") return run_export(argc - 1, argv + 1);
    if (cmd == "generate") return run_generate(argc - 1, argv + 1);
    if (cmd == "samples") return run_samples(argc - 1, argv + 1);
    return run_train(argc, argv);
  } catch (const tessel::observe::Interrupted& e) {  // a stop signal before step 1
    std::fprintf(stderr, "%s: %s\n", who.c_str(), e.what());
    return tessel::run::kExitStopped;
  } catch (const tessel::plan::UserError& e) {
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), e.what());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", who.c_str(), e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", who.c_str(), e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  tessel::cli::fork_ranks_if_asked();       // tests: returns in each forked rank (fork_ranks.h)
  tessel::device::reproducible_cpu_blas();  // before any tensor: oneMKL reads it at its first call
  spdlog::set_pattern("[%H:%M:%S] %v");
  // c10d warns about every rendezvous retry (a rank waiting for rank 0 to come up) with a C++
  // backtrace; errors stay. TORCH_CPP_LOG_LEVEL=INFO or WARNING brings the warnings back.
  if (!std::getenv("TORCH_CPP_LOG_LEVEL")) FLAGS_caffe2_log_level = 2;
  // Under a launcher, say which rank failed (the launcher also prefixes every line).
  const char* rank = std::getenv("RANK");
  const std::string who = rank ? std::string("tessel-train[rank ") + rank + "]" : "tessel-train";
  tessel::observe::install_crash_report(who);
  // Tests: a fatal signal here, as a crash anywhere would meet the report.
  if (const char* s = std::getenv("TESSEL_TEST_FATAL_SIGNAL")) std::raise(std::atoi(s));
  tessel::cli::exit_without_teardown(run_command(argc, argv, who));
}
