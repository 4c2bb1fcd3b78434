#include "engine/score.h"

#include <torch/torch.h>

#include <fstream>

#include "engine/train.h"

namespace tessel {

ScoreResult score(const Config& c, const std::string& weights, const std::string& tokens_path) {
  const int64_t row = c.training.seq_len + 1;
  std::ifstream f(tokens_path, std::ios::binary | std::ios::ate);
  if (!f) throw UserError(tokens_path + ": cannot open the tokens file");
  const int64_t bytes = f.tellg();
  if (bytes == 0 || bytes % (4 * row) != 0)
    throw UserError(tokens_path + ": " + std::to_string(bytes) +
                    " bytes is not a whole number of rows of training.seq_len+1 = " +
                    std::to_string(row) + " int32 tokens (" + std::to_string(4 * row) + " bytes)");
  const int64_t b = bytes / (4 * row);
  auto tokens = torch::empty({b, row}, torch::kInt32);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(tokens.data_ptr<int32_t>()), bytes);
  auto bad = ((tokens < 0) | (tokens >= c.model.vocab_size)).nonzero();
  if (bad.size(0) > 0) {
    int64_t r = bad[0][0].item<int64_t>(), k = bad[0][1].item<int64_t>();
    throw UserError(tokens_path + ": token id " + std::to_string(tokens[r][k].item<int32_t>()) +
                    " at row " + std::to_string(r) + ", column " + std::to_string(k) +
                    " is outside model.vocab_size " + std::to_string(c.model.vocab_size));
  }
  const auto device = resolve_device(c.training.device);
  // --weights replaces every parameter, so the plan's init_from is not read first.
  Config plan = c;
  plan.model.init_from.clear();
  auto model = make_model(plan, device, resolve_dtype(c.training.dtype));
  models::load_weights(model, weights);
  torch::NoGradGuard no_grad;
  model->eval();
  double total = 0;
  auto all = tokens.to(torch::kInt64);
  for (int64_t first = 0; first < b; first += c.training.micro_batch) {
    auto rows = all.narrow(0, first, std::min(c.training.micro_batch, b - first)).to(device);
    total += model->loss_sum(rows).to(torch::kFloat64).item<double>();
  }
  return {total / static_cast<double>(b * c.training.seq_len), b * c.training.seq_len};
}

}  // namespace tessel
