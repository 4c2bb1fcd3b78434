// The validation loss a run logs every training.eval_every steps: each validation dataset's
// rows read through the training's pipeline forward only, on every rank, summed over the stages
// and the data ranks.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/plan/config.h"
#include "engine/data/dataset.h"
#include "models/registry.h"
#include "parallel/mesh.h"
#include "parallel/pp/executor.h"
#include "parallel/pp/schedule.h"

namespace tessel::run {

struct Validation {
  double loss = 0;  // the datasets' losses weighted as data.valid weighs them
  std::vector<std::pair<std::string, double>> by_dataset;  // each one's, when several
};

class Validator {
 public:
  /// The training's executor for a schedule (its stage-to-stage activation shape and dtype).
  using MakeExecutor =
      std::function<std::unique_ptr<parallel::pp::Executor>(parallel::pp::Schedule)>;
  Validator(const plan::Config& c, parallel::Mesh& mesh, data::Dataset& data,
            const torch::Device& device, MakeExecutor make);
  /// The model's loss over training.eval_batches global batches of each validation dataset, in
  /// `training`'s chunks (its virtual stages and shape). Reads the loss: a host sync.
  Validation run(models::Decoder& model, const parallel::pp::Schedule& training) const;

 private:
  double dataset_loss(models::Decoder& model, const parallel::pp::Schedule& training,
                      int64_t d) const;
  const plan::Config& c_;
  parallel::Mesh& mesh_;
  data::Dataset& data_;
  torch::Device device_;
  int64_t doc_eod_, loss_eod_;  // data.document_mask's id and data.eod_mask_loss's (-1: none)
  MakeExecutor make_;
};

}  // namespace tessel::run
