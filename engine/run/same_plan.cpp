#include "engine/run/same_plan.h"

#include <fmt/format.h>

#include <chrono>
#include <sstream>
#include <thread>
#include <vector>

namespace tessel::run {
namespace {

std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }
std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// The first line where two dumped plans differ, as "key: mine vs theirs" (the dump is YAML with
// one key per line, nested by indentation: the key path is rebuilt from the indentation).
std::string first_difference(const std::string& mine, const std::string& theirs, int64_t rank) {
  std::istringstream a(mine), b(theirs);
  std::string la, lb;
  std::vector<std::string> path;
  while (true) {
    const bool ga = static_cast<bool>(std::getline(a, la)),
               gb = static_cast<bool>(std::getline(b, lb));
    if (!ga && !gb) return "";
    const std::string& line = ga ? la : lb;
    const size_t indent = line.find_first_not_of(' ') / 2, colon = line.find(':');
    path.resize(std::min(path.size(), indent));
    const std::string key =
        colon == std::string::npos ? line : line.substr(indent * 2, colon - indent * 2);
    if (la != lb || !ga || !gb) {
      std::string full;
      for (const auto& p : path) full += p + ".";
      auto value = [](const std::string& l) {
        const size_t c = l.find(':');
        return c == std::string::npos ? l : l.substr(c + 1);
      };
      return fmt::format("{}{}:{} (rank {}) vs{} (rank 0)", full, key, ga ? value(la) : " <absent>",
                         rank, gb ? value(lb) : " <absent>");
    }
    path.push_back(key);
  }
}

}  // namespace

void check_same_plan(const plan::Config& c, const parallel::Mesh& mesh) {
  auto* store = mesh.store();
  if (!store) return;
  const std::string mine = plan::dump_config(c);
  if (mesh.rank() == 0) store->set("tessel/plan", bytes(mine));
  store->wait({"tessel/plan"});
  const std::string diff = first_difference(mine, text(store->get("tessel/plan")), mesh.rank());
  if (!diff.empty()) store->set(fmt::format("tessel/plan_differs/{}", mesh.rank()), bytes(diff));
  store->add("tessel/plan_bad", diff.empty() ? 0 : 1);
  store->add("tessel/plan_checked", 1);
  // Every rank has compared once the counter reaches the world size.
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(c.parallel.timeout_s * 1000));
  while (store->add("tessel/plan_checked", 0) < mesh.world()) {
    if (std::chrono::steady_clock::now() > deadline)
      throw plan::UserError(fmt::format(
          "rank {}: waited parallel.timeout_s ({} s) for every rank to compare its plan with rank "
          "0's; {} of {} did",
          mesh.rank(), c.parallel.timeout_s, store->add("tessel/plan_checked", 0), mesh.world()));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (store->add("tessel/plan_bad", 0) == 0) return;
  if (!diff.empty())
    throw plan::UserError(
        fmt::format("{}: this rank's plan differs from rank 0's at {}", c.source, diff));
  std::string ranks;
  for (int64_t r = 1; r < mesh.world(); ++r)
    if (store->check({fmt::format("tessel/plan_differs/{}", r)}))
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  throw plan::UserError(fmt::format(
      "the ranks were started with different plans: rank{} {} differ{} from rank 0 (each names "
      "the key); start every rank with the same plan and --set overrides",
      ranks.find(',') == std::string::npos ? "" : "s", ranks,
      ranks.find(',') == std::string::npos ? "s" : ""));
}

}  // namespace tessel::run
