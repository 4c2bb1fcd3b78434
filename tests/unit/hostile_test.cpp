// Hostile inputs: crafted checkpoints (names that leave the folder, tensors that disagree with
// the index, index values out of range), plan values past their bounds, and a seeded fuzz of
// checkpoint indexes, shard headers and plans. Every case either loads exactly what was written
// or ends in a UserError; none crashes, hangs or loads silently.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/plan/config.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/index.h"
#include "engine/io/checksum.h"
#include "engine/io/safetensors.h"
#include "engine/planner/planner.h"
#include "engine/run/resume_plan.h"
#include "engine/run/startup.h"
#include "parallel/mesh.h"

namespace fs = std::filesystem;

namespace tessel {
namespace {

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void spit(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
}

std::string checksum_of(const std::string& bytes) {
  io::Checksum c;
  c.update(bytes.data(), bytes.size());
  return c.hex();
}

// A small complete checkpoint in Tessel's layout, written by hand: "w" whole in rank 0's file,
// "v" split by rows over two files (tensor-parallel slices), "m" two ZeRO pieces of a flat
// range, and a scalar.
class Crafted {
 public:
  explicit Crafted(const std::string& name)
      : root_(fs::temp_directory_path() /
              ("tessel_hostile_" + name + "_" + std::to_string(::getpid()))),
        dir_(root_ / "step_3") {
    fs::remove_all(root_);
    fs::create_directories(dir_);
    torch::manual_seed(3);
    want_ = {{"w", torch::randn({4, 3})},
             {"v", torch::randn({4, 2})},
             {"m", torch::randn({6})},
             {"optim.step", torch::tensor(3.0)}};
    write_file(0, {{"w", want_["w"]},
                   {"v", want_["v"].narrow(0, 0, 2)},
                   {"m", want_["m"].narrow(0, 0, 3)},
                   {"optim.step", want_["optim.step"]}});
    write_file(1, {{"v", want_["v"].narrow(0, 2, 2)}, {"m", want_["m"].narrow(0, 3, 3)}});
    auto shard = [](int file, nlohmann::json slice) {
      return nlohmann::json{{"file", file_name(file)}, {"slice", std::move(slice)}};
    };
    auto piece = [&](int file, int64_t b, int64_t e) {
      auto s = shard(file, {{0, 6}});
      s["flat"] = {b, e};
      return s;
    };
    index_ = {
        {"format", "tessel-checkpoint-1"},
        {"step", 3},
        {"consumed_samples", 6},
        {"world_size", 2},
        {"arch", "gpt2"},
        {"files", files_},
        {"tensors",
         {{"w", {{"shape", {4, 3}}, {"dtype", "Float"}, {"shards", {shard(0, {{0, 4}, {0, 3}})}}}},
          {"v",
           {{"shape", {4, 2}},
            {"dtype", "Float"},
            {"shards", {shard(0, {{0, 2}, {0, 2}}), shard(1, {{2, 4}, {0, 2}})}}}},
          {"m", {{"shape", {6}}, {"dtype", "Float"}, {"shards", {piece(0, 0, 3), piece(1, 3, 6)}}}},
          {"optim.step",
           {{"shape", nlohmann::json::array()},
            {"dtype", "Float"},
            {"shards", {shard(0, nlohmann::json::array())}}}}}}};
    write_index(index_);
    spit(dir_ / "COMPLETE", "3\n");
  }
  ~Crafted() { fs::remove_all(root_); }

  static std::string file_name(int r) { return "rank_0000" + std::to_string(r) + ".safetensors"; }
  const fs::path& dir() const { return dir_; }
  const fs::path& root() const { return root_; }
  nlohmann::json index() const { return index_; }
  const std::map<std::string, torch::Tensor>& want() const { return want_; }

  void write_index(const nlohmann::json& j) const { spit(dir_ / "index.json", j.dump(1)); }

  // Rewrites a rank file's header (as an adversary would) and records the new size and
  // checksum in `index`, so that only the header's content can give it away.
  void rewrite_header(int r, const std::function<void(nlohmann::json&)>& edit,
                      nlohmann::json& index) const {
    const fs::path p = dir_ / file_name(r);
    const std::string bytes = slurp(p);
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    auto header = nlohmann::json::parse(bytes.substr(8, n));
    edit(header);
    const std::string h = header.dump();
    const uint64_t len = h.size();
    std::string out(reinterpret_cast<const char*>(&len), 8);
    out += h + bytes.substr(8 + n);
    spit(p, out);
    if (index.contains("files") && index["files"].is_object())
      index["files"][file_name(r)] = {{"bytes", out.size()}, {"checksum", checksum_of(out)}};
  }

  // The checkpoint's tensors as the loader assembles them.
  models::Weights load() const { return checkpoint::read_checkpoint_tensors(dir_.string()); }

 private:
  void write_file(int r, const std::vector<std::pair<std::string, torch::Tensor>>& t) {
    const auto w = io::write_safetensors((dir_ / file_name(r)).string(), t, {{"format", "tessel"}});
    files_[file_name(r)] = {{"bytes", w.bytes}, {"checksum", w.checksum}};
  }

  fs::path root_, dir_;
  std::map<std::string, torch::Tensor> want_;
  nlohmann::json files_ = nlohmann::json::object(), index_;
};

template <class F>
std::string user_error(F&& f) {
  try {
    f();
  } catch (const plan::UserError& e) {
    return e.what();
  }
  return "";
}

TEST(HostileCheckpoint, TheCraftedCheckpointLoadsAsWritten) {
  Crafted c("ok");
  const auto got = c.load();
  ASSERT_EQ(got.size(), c.want().size());
  for (const auto& [name, t] : c.want()) EXPECT_TRUE(torch::equal(got.at(name), t)) << name;
}

TEST(HostileCheckpoint, ShardNamesStayInsideTheFolder) {
  Crafted c("names");
  // A file outside the checkpoint, with a size and checksum the index records correctly.
  const fs::path outside = c.root() / "x.safetensors";
  fs::copy_file(c.dir() / Crafted::file_name(1), outside);
  for (const std::string& name :
       std::vector<std::string>{"../x.safetensors", outside.string(), "./../x.safetensors"}) {
    auto index = c.index();
    index["files"][name] = index["files"][Crafted::file_name(1)];
    index["tensors"]["v"]["shards"][1]["file"] = name;
    c.write_index(index);
    const auto err = user_error([&] { c.load(); });
    EXPECT_NE(err.find("is not a plain file name inside the checkpoint folder"), std::string::npos)
        << name << ": " << err;
  }
  // A link inside the folder that points out of it.
  auto index = c.index();
  fs::create_symlink(outside, c.dir() / "link.safetensors");
  index["files"]["link.safetensors"] = index["files"][Crafted::file_name(1)];
  index["tensors"]["v"]["shards"][1]["file"] = "link.safetensors";
  c.write_index(index);
  EXPECT_NE(user_error([&] { c.load(); }).find("outside the checkpoint folder"), std::string::npos);
  // `latest` naming a folder elsewhere.
  spit(c.root() / "latest", "../../etc\n");
  EXPECT_NE(user_error([&] {
              checkpoint::resolve_checkpoint(c.root().string());
            }).find("not a plain file name"),
            std::string::npos);
}

TEST(HostileCheckpoint, ShardTensorsMatchTheIndexBeforeAnyCopy) {
  Crafted c("shapes");
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> header, index;
    const char* says;
  };
  const auto none = [](nlohmann::json&) {};
  const Case cases[] = {
      // Smaller than the index says: used to load into partly uninitialised memory.
      {"smaller",
       [](nlohmann::json& h) {
         h["w"]["shape"] = {2, 3};
         h["w"]["data_offsets"][1] = h["w"]["data_offsets"][0].get<int64_t>() + 24;
       },
       none, "tensor 'w' is Float [2, 3] in the file, but index.json says Float [4, 3]"},
      // Larger: used to end in an internal error.
      {"larger", none,
       [](nlohmann::json& i) {
         i["tensors"]["w"]["shape"] = {3, 3};
         i["tensors"]["w"]["shards"][0]["slice"] = {{0, 3}, {0, 3}};
       },
       "tensor 'w' is Float [4, 3] in the file, but index.json says Float [3, 3]"},
      // Stored as F16 where the index says F32: used to load at fp16 precision.
      {"F16",
       [](nlohmann::json& h) {
         h["w"]["dtype"] = "F16";
         h["w"]["shape"] = {4, 6};
       },
       none, "tensor 'w' is Half [4, 6] in the file, but index.json says Float [4, 3]"},
      // A ZeRO piece whose file holds fewer elements than its flat range.
      {"piece", none,
       [](nlohmann::json& i) {
         i["tensors"]["m"]["shards"][1]["flat"] = {2, 6};
       },
       "tensor 'm' is Float [3] in the file, but index.json says Float [4]"},
  };
  for (const auto& k : cases) {
    Crafted fresh(std::string("shape_") + std::to_string(&k - cases));
    auto index = fresh.index();
    fresh.rewrite_header(0, k.header, index);
    k.index(index);
    fresh.write_index(index);
    const auto err = user_error([&] { fresh.load(); });
    EXPECT_NE(err.find(k.says), std::string::npos) << k.what << ": " << err;
  }
}

TEST(HostileCheckpoint, IndexValuesAreValidated) {
  Crafted c("values");
  struct Case {
    const char* key;
    nlohmann::json value;
    const char* says;
  };
  const Case cases[] = {
      // Step 3 reads at most 3 x 4M samples (training.global_batch's bound): 2^53 would send a
      // blend's walk to that position for ever.
      {"consumed_samples", -5, "consumed_samples: -5 is outside [0, 12582912]"},
      {"consumed_samples", int64_t{1} << 53,
       "consumed_samples: 9007199254740992 is outside [0, 12582912]"},
      {"step", 1e30, "step: expected an integer, got 1e+30"},
      {"step", 4, "step: 4 in folder step_3"},
      {"world_size", 0, "world_size: 0 is outside [1, 16777216]"},
      {"format", "x", "format: expected \"tessel-checkpoint-1\""},
  };
  for (const auto& k : cases) {
    auto index = c.index();
    index[k.key] = k.value;
    c.write_index(index);
    const auto err = user_error([&] { checkpoint::read_index(c.dir()); });
    EXPECT_NE(err.find(k.says), std::string::npos) << k.key << ": " << err;
  }
  auto index = c.index();
  index["tensors"]["v"]["shards"][1]["slice"][0] = {2, 9};
  c.write_index(index);
  EXPECT_NE(user_error([&] {
              c.load();
            }).find("tensors.v.shards[1].slice[0]: [2, 9) is not a range inside [0, 4)"),
            std::string::npos);
  fs::remove(c.dir() / "index.json");
  EXPECT_NE(user_error([&] { c.load(); }).find("index.json: missing"), std::string::npos);
}

TEST(HostileCheckpoint, AStepFolderWithoutItsPlanIsNotResumed) {
  // It used to resume with a warning, even when seq_len and seed had changed.
  Crafted c("noplan");
  const plan::Config plan = plan::load_config_text("data: {path: [a.txt]}\n", "p.yaml");
  const auto err = user_error([&] { run::check_resume_plan(plan, c.dir().string(), false); });
  EXPECT_NE(err.find("it has no config.yaml, the plan it was saved under"), std::string::npos)
      << err;
  EXPECT_NE(err.find("tessel-train export"), std::string::npos) << err;
}

// --- fuzz ----------------------------------------------------------------------------------------

// Values an adversary (or a damaged copy) puts anywhere.
std::vector<nlohmann::json> hostile_values() {
  return {-5,
          -1,
          0,
          1,
          2,
          7,
          (int64_t{1} << 53) + 1,
          INT64_MAX,
          1e30,
          -1e30,
          0.5,
          "x",
          "",
          "../rank_00001.safetensors",
          "/etc/passwd",
          "F16",
          "I64",
          "Half",
          nullptr,
          nlohmann::json::array(),
          nlohmann::json::object(),
          true,
          {0},
          {0, 99},
          {{0, 4}, {0, 3}},
          {{0, 2}, {0, 2}}};
}

// Every node of a JSON document, as pointers.
void all_pointers(const nlohmann::json& j, const nlohmann::json::json_pointer& at,
                  std::vector<nlohmann::json::json_pointer>& out) {
  out.push_back(at);
  if (j.is_object())
    for (const auto& [k, v] : j.items()) all_pointers(v, at / k, out);
  else if (j.is_array())
    for (size_t i = 0; i < j.size(); ++i) all_pointers(j[i], at / i, out);
}

// One mutation: a node replaced by a hostile value, removed, or a second copy appended.
void mutate(nlohmann::json& doc, std::mt19937_64& rng) {
  std::vector<nlohmann::json::json_pointer> ptrs;
  all_pointers(doc, nlohmann::json::json_pointer(), ptrs);
  const auto& p = ptrs[1 + rng() % (ptrs.size() - 1)];
  const auto values = hostile_values();
  switch (rng() % 4) {
    case 0:
    case 1:
      doc[p] = values[rng() % values.size()];
      break;
    case 2:
      if (doc[p.parent_pointer()].is_object())
        doc[p.parent_pointer()].erase(p.back());
      else
        doc[p] = values[rng() % values.size()];
      break;
    default:
      if (doc[p.parent_pointer()].is_array())
        doc[p.parent_pointer()].push_back(doc[p]);
      else
        doc[p] = values[rng() % values.size()];
  }
}

// The oracle: a UserError (true), or exactly the tensors written (a subset when the index drops
// some).
bool refused_or_exact(const Crafted& c, const std::string& what) {
  models::Weights got;
  try {
    got = c.load();
  } catch (const plan::UserError&) {
    return true;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": not a UserError: " << e.what();
    return true;
  }
  for (const auto& [name, t] : got) {
    EXPECT_TRUE(c.want().count(name)) << what << ": loaded an unknown tensor " << name;
    if (!c.want().count(name)) continue;
    EXPECT_TRUE(t.sizes() == c.want().at(name).sizes() && torch::equal(t, c.want().at(name)))
        << what << ": loaded '" << name << "' silently wrong";
  }
  return false;
}

TEST(HostileCheckpoint, FuzzedIndexesAndHeadersLoadExactlyOrAreRefused) {
  Crafted c("fuzz");
  std::mt19937_64 rng(20261127);
  const std::string original[2] = {slurp(c.dir() / Crafted::file_name(0)),
                                   slurp(c.dir() / Crafted::file_name(1))};
  int refused = 0, loaded = 0;
  for (int i = 0; i < 300; ++i) {
    for (int r = 0; r < 2; ++r) spit(c.dir() / Crafted::file_name(r), original[r]);
    auto index = c.index();
    const int mutations = 1 + static_cast<int>(rng() % 3);
    std::string what = "case " + std::to_string(i);
    for (int m = 0; m < mutations; ++m) {
      if (rng() % 3 == 0) {  // the header of a rank file, checksum recomputed
        const int r = static_cast<int>(rng() % 2);
        c.rewrite_header(
            r, [&](nlohmann::json& h) { mutate(h, rng); }, index);
        what += " header" + std::to_string(r);
      } else {
        mutate(index, rng);
        what += " index";
      }
    }
    c.write_index(index);
    (refused_or_exact(c, what + ": " + index.dump()) ? refused : loaded)++;
    if (::testing::Test::HasFailure()) break;  // one reported case is enough
  }
  // Most mutations must be caught; some (a changed arch, consumed_samples 7) are harmless.
  EXPECT_GT(refused, 200);
  std::printf("fuzzed checkpoints: %d refused, %d loaded exactly\n", refused, loaded);
}

// --- the plan ------------------------------------------------------------------------------------

const char* kPlan =
    "data: {path: [a.txt]}\ntraining: {steps: 4, global_batch: 8, micro_batch: 4}\n";

TEST(HostilePlan, IntegerKeysAreBoundedWithTheReason) {
  const std::string big = std::to_string(INT64_MAX);
  struct Case {
    std::string set, says;
  };
  const Case cases[] = {
      {"model.layers=" + big, "model.layers: must be in [1, 1024], got " + big +
                                  " (far above published models (their largest use under 200))"},
      {"model.hidden=" + big, "model.hidden: must be in [1, 131072]"},
      {"model.vocab_size=" + big, "model.vocab_size: must be in [1, 16777216]"},
      {"model.max_seq_len=" + big, "model.max_seq_len: must be in [1, 4194304]"},
      {"training.global_batch=" + big, "training.global_batch: must be in [1, 4194304]"},
      // Within each bound, the products: parameters and tokens per step.
      {"model.hidden=131072", "at most 1.75e+13 (ten times the largest published models"},
      {"training.global_batch=4194304", "tokens per step: at most 2^32"},
  };
  for (const auto& k : cases) {
    std::vector<std::string> sets = {k.set};
    if (k.set.rfind("model.hidden=131072", 0) == 0) sets.push_back("model.layers=1024");
    if (k.set.rfind("training.global_batch=4194304", 0) == 0)
      sets.push_back("training.seq_len=2048");
    if (k.set.rfind("training.global_batch=4194304", 0) == 0)
      sets.push_back("model.max_seq_len=2048");
    const auto err = user_error([&] { plan::load_config_text(kPlan, "p.yaml", sets); });
    EXPECT_NE(err.find(k.says), std::string::npos) << k.set << ": " << err;
  }
  // The bound and its reason are in the reference too.
  EXPECT_NE(plan::config_reference().find("Range: [1, 1024] (far above published models"),
            std::string::npos);
  // A schedule of more micro-batches than it can hold is refused before it is built.
  const plan::Config c = plan::load_config_text(
      kPlan, "p.yaml",
      {"training.global_batch=131072", "training.micro_batch=1", "training.seq_len=16"});
  EXPECT_NE(user_error([&] {
              plan::check_layout(c, 1, 1);
            }).find("131072 micro-batches per step: at most 65536"),
            std::string::npos);
}

TEST(HostilePlan, PartialCasesAreRefusedClearly) {
  EXPECT_NE(user_error([&] {
              plan::load_config_text(std::string(kPlan) + "---\nmodel: {layers: 9}\n", "p.yaml");
            }).find("p.yaml: holds 2 YAML documents"),
            std::string::npos);
  EXPECT_NE(user_error([&] {
              plan::load_config(fs::temp_directory_path().string());
            }).find(": a folder, not a plan file"),
            std::string::npos);
  EXPECT_NE(user_error([&] {
              plan::load_config_text(kPlan, "p.yaml",
                                     {"parallel.zero3.keep_gathered=true", "parallel.zero=1"});
            }).find("parallel.zero3.keep_gathered is a ZeRO-3 setting"),
            std::string::npos);
  EXPECT_NE(user_error([&] {
              plan::load_config_text(kPlan, "p.yaml", {"parallel.zero_shard=2"});
            }).find("parallel.zero_shard (2) is a ZeRO setting"),
            std::string::npos);
  const auto self = user_error([&] {
    plan::load_config_text(kPlan, "p.yaml",
                           {"checkpoint.accept_changes=[checkpoint.accept_changes]"});
  });
  EXPECT_NE(self.find("'checkpoint.accept_changes' needs no acceptance"), std::string::npos)
      << self;
  EXPECT_EQ(self.find("did you mean"), std::string::npos) << self;
}

TEST(HostilePlan, FilesAndStagesAreNamed) {
  // A layers_per_stage entry of 0 used to be refused without saying which.
  const plan::Config c = plan::load_config_text(
      "data: {path: [a.txt]}\nmodel: {layers: 4}\nparallel: {pp: 2, pipeline: "
      "{layers_per_stage: [4, 0]}}\n",
      "p.yaml");
  EXPECT_NE(user_error([&] { plan::check_layout(c, 2, 2); }).find("(entry 1 is 0: every stage"),
            std::string::npos);
  // model.init_from at a folder used to end in "cannot map: No such device".
  const auto dir = fs::temp_directory_path() / ("tessel_init_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  EXPECT_NE(
      user_error([&] { run::init_weights_file(dir.string()); })
          .find("model.init_from: " + dir.string() +
                " is a folder with neither model.safetensors.index.json nor model.safetensors"),
      std::string::npos);
  spit(dir / "model.safetensors", "");
  EXPECT_EQ(run::init_weights_file(dir.string()), (dir / "model.safetensors").string());
  EXPECT_NE(
      user_error([&] { run::init_weights_file((dir / "nothing").string()); }).find("no such file"),
      std::string::npos);
  fs::remove_all(dir);
}

TEST(HostilePlan, FuzzedPlansLoadOrAreRefused) {
  plan::Config scratch;
  const auto fields = plan::bind_fields(scratch);
  const std::vector<std::string> values = {"-1",
                                           "0",
                                           "1",
                                           "3",
                                           "9223372036854775807",
                                           "-9223372036854775808",
                                           "1e308",
                                           "-1e308",
                                           ".nan",
                                           ".inf",
                                           "''",
                                           "x",
                                           "[]",
                                           "[1, 2]",
                                           "{a: 1}",
                                           "null",
                                           "true",
                                           "131072",
                                           "1024",
                                           "/",
                                           "../../x"};
  std::mt19937_64 rng(1127);
  const auto profile = planner::device_profile("h100", {});
  int refused = 0, planned = 0;
  for (int i = 0; i < 400; ++i) {
    std::vector<std::string> sets;
    for (int m = 0; m < 1 + static_cast<int>(rng() % 3); ++m)
      sets.push_back(fields[rng() % fields.size()].key + "=" + values[rng() % values.size()]);
    std::string what;
    for (const auto& s : sets) what += " --set " + s;
    try {
      const plan::Config c = plan::load_config_text(kPlan, "p.yaml", sets);
      const auto layout = plan::check_layout(c, 1, 1);
      const auto e = planner::estimate(c, layout, profile);
      // What --dry-run prints: finite, non-negative figures.
      for (const auto& r : e.ranks)
        EXPECT_TRUE(std::isfinite(r.total()) && r.weights >= 0 && r.activations >= 0) << what;
      EXPECT_TRUE(std::isfinite(e.step_s) && e.step_s >= 0 && e.params_total > 0) << what;
      ++planned;
    } catch (const plan::UserError&) {
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": not a UserError: " << e.what();
    }
  }
  EXPECT_GT(planned, 20);
  EXPECT_GT(refused, 100);
  std::printf("fuzzed plans: %d refused, %d planned\n", refused, planned);
}

// The device profile of each GPU CUDA names: an H100 PCIe or NVL is not an SXM H100 (its peak
// about 24% or 16% lower, PCIe between its pairs), and an unknown name is refused by name.
TEST(DeviceProfiles, TheGpusOwnProfile) {
  auto of = [](const std::string& name) {
    const auto* p = planner::profile_of_gpu(name);
    return p ? p->name : std::string("none");
  };
  EXPECT_EQ(of("NVIDIA H100 80GB HBM3"), "h100");
  EXPECT_EQ(of("NVIDIA H100 PCIe"), "h100-pcie");
  EXPECT_EQ(of("NVIDIA H100 NVL"), "h100-nvl");
  EXPECT_EQ(of("NVIDIA H200"), "h200");
  EXPECT_EQ(of("NVIDIA A100-SXM4-80GB"), "a100");
  EXPECT_EQ(of("NVIDIA GeForce RTX 4090"), "none");
  EXPECT_EQ(planner::device_profile("h100-pcie", {}).peak_tflops, 756);
  EXPECT_EQ(planner::device_profile("h100-nvl", {}).memory_gib, 94);
  try {
    planner::device_profile("h100-sxm5", {});
    ADD_FAILURE() << "an unknown profile was accepted";
  } catch (const plan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("h100-nvl, h100-pcie, h200, cpu"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tessel
