// What a run builds before its first step, outside the Trainer: the device it computes on, the
// model on that device, and which attention kernel the plan will run (tessel-train's run, score
// and generate, and the tests, build through these).
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "core/kernels/document_attention.h"
#include "core/plan/config.h"
#include "models/from_plan.h"
#include "models/registry.h"
#include "parallel/mesh.h"

namespace tessel::run {

/// training.device resolved: auto -> cuda when available; the CUDA index by
/// plan::choose_cuda_device (`why`, when given, receives its reason). Throws UserError for
/// cuda without one, or for too few devices for the processes on this node.
torch::Device resolve_device(plan::TrainDevice device, const parallel::WorldInfo& w = {},
                             std::string* why = nullptr);

/// The process-wide settings of the plan's device: intra-op threads, TF32, deterministic kernels;
/// on CPU the allocation counter, counting the state from its first byte.
void configure_device(const plan::Config& c, const torch::Device& device);

/// Host rows (data, evaluation, scoring) onto the run's device: on CUDA through pinned memory and
/// queued without waiting (the copy goes behind the work already queued); on CPU as they are.
torch::Tensor to_device(const torch::Tensor& host, const torch::Device& device);

/// data.eod_mask_loss: the targets of host rows [b, seq + 1] the loss scores, those whose input
/// token (the row's first `seq`) is not `eod`. Read on the host from the rows' own memory.
int64_t scored_targets(const torch::Tensor& host_rows, int64_t seq, int64_t eod);

/// data.document_mask: the documents of host rows [B, T+1] (their inputs rows[:, :T]) cut after
/// each `eod` (data::document_eod), one set per micro-batch of training.micro_batch rows, their
/// positions and bounds queued to `device`. eod < 0 (no mask): none (an empty list).
std::vector<kernels::Documents> micro_batch_documents(const plan::Config& c, int64_t eod,
                                                      const torch::Tensor& host_rows,
                                                      const torch::Device& device);

/// Builds the plan's model on `device` in `dtype`: seeded init, or model.init_from.
/// `tp`: the tensor-parallel group (null: one process holds the whole model); `stages`: the
/// pipeline stages this rank holds (default: all); `cp`: the context-parallel group.
models::Decoder make_model(const plan::Config& c, const torch::Device& device,
                           torch::ScalarType dtype, parallel::Group* tp = nullptr,
                           const models::StagePart& stages = {}, parallel::Group* cp = nullptr,
                           parallel::Group* ep = nullptr);

/// Loads weights of Tessel or Hugging Face names into `model` (models/registry.h): a safetensors
/// file, or a folder of one or of Hugging Face shards (io::MappedWeights). The files are mapped,
/// not read: this rank copies only the slices it keeps. `key` (model.init_from, --weights) is
/// named in errors.
void load_weights_file(models::Decoder& model, const std::string& path, const std::string& key);

/// The attention kernel the plan runs on `device`, in words for the start-up log (on CUDA it also
/// pins SDPA's kernel order). Throws UserError where it would be SDPA's math kernel on CUDA.
std::string attention_kernel(const plan::Config& c, const torch::Device& device,
                             torch::ScalarType dtype);

/// training.fp8 in words for the start-up log ("" when off). Throws UserError where the device
/// cannot run it: CUDA below compute capability 8.9, or a float8 matmul dimension on a rank (a
/// layer's local input or output features, a micro-batch's tokens) not a multiple of 16.
std::string fp8_matmuls(const plan::Config& c, const torch::Device& device);

}  // namespace tessel::run
