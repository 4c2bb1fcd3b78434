#include "engine/run/validate.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "engine/data/vocabulary.h"
#include "engine/run/build.h"

namespace tessel::run {

Validator::Validator(const plan::Config& c, parallel::Mesh& mesh, data::Dataset& data,
                     const torch::Device& device, MakeExecutor make)
    : c_(c),
      mesh_(mesh),
      data_(data),
      device_(device),
      doc_eod_(data::document_eod(c)),
      loss_eod_(data::loss_mask_eod(c)),
      make_(std::move(make)) {}

Validation Validator::run(models::Decoder& model, const parallel::pp::Schedule& training) const {
  torch::NoGradGuard no_grad;
  Validation v;
  const auto& sets = data_.sources(data::SampleSplit::kValid);
  const auto& weights = data_.weights(data::SampleSplit::kValid);
  for (size_t d = 0; d < sets.size(); ++d) {
    const double loss = dataset_loss(model, training, static_cast<int64_t>(d));
    v.loss += weights[d] * loss;
    if (sets.size() > 1) v.by_dataset.push_back({sets[d].key, loss});
  }
  return v;
}

// Validation dataset d's mean loss over the rows every evaluation reads.
double Validator::dataset_loss(models::Decoder& model, const parallel::pp::Schedule& training,
                               int64_t d) const {
  const auto& t = c_.training;
  const auto& l = mesh_.layout();
  auto total = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  const int64_t rows = t.eval_batches * t.global_batch, mine = rows / l.dp;
  auto last = std::chrono::steady_clock::now();
  // A micro-batch's rows (and documents), read once for this rank's chunks that need them: the
  // stages that embed tokens or score targets, and with a document mask every stage.
  std::map<int64_t, std::pair<torch::Tensor, std::vector<kernels::Documents>>> held;
  parallel::pp::StageFns fns{[&](int64_t mb, int64_t chunk, const torch::Tensor& input) {
    const int64_t first = mb * t.micro_batch;
    const bool needs = model->needs_rows(chunk) || c_.data.document_mask;
    if (needs && !held.count(mb)) {
      const auto host = data_.split_batch(data::SampleSplit::kValid, d,
                                          mesh_.coord().dp * mine + first, t.micro_batch);
      held[mb] = {to_device(host, device_), micro_batch_documents(c_, doc_eod_, host, device_)};
    }
    const auto it = held.find(mb);
    const bool mine_now = it != held.end() && needs;
    auto out = model->stage_forward(
        chunk, input, mine_now ? it->second.first : torch::Tensor(),
        mine_now && !it->second.second.empty() ? &it->second.second[0] : nullptr);
    if (chunk == model->chunks() - 1 && it != held.end()) held.erase(it);
    if (model->is_last_stage(chunk)) total += out.to(torch::kFloat64);
    if (chunk == 0 && std::chrono::steady_clock::now() - last > std::chrono::seconds(2)) {
      last = std::chrono::steady_clock::now();
      spdlog::info("eval: {}/{} sequences", (first + t.micro_batch) * l.dp, rows);
    }
    return out;
  }};
  make_(parallel::pp::forward_only(l.pp, mine / t.micro_batch, training.virtual_stages,
                                   training.v_shape))
      ->run(fns);
  mesh_.group(parallel::GroupKind::kPp).all_reduce(total).wait();  // the last stage's sum
  mesh_.dp_cp().all_reduce(total).wait();
  const int64_t scored =
      loss_eod_ < 0 ? rows * t.seq_len
                    : scored_targets(data_.split_batch(data::SampleSplit::kValid, d, 0, rows),
                                     t.seq_len, loss_eod_);
  return total.item<double>() / static_cast<double>(std::max<int64_t>(1, scored));
}

}  // namespace tessel::run
