// What the plan says about the model, in the terms models/ takes: its shape, its dtype and the
// pipeline stages a rank holds. The run, the checkpoints and the planner all read the model of a
// plan through here (the layers and parts below know no plan).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "core/plan/config.h"
#include "models/layers.h"
#include "models/shape.h"

namespace tessel::models {

/// The model section of a validated plan (every "auto" resolved) as models::ModelShape.
models::ModelShape model_shape(const plan::ModelConfig& m);

/// training.dtype (resolved: fp32 | bf16 | fp16) as a tensor dtype.
c10::ScalarType resolve_dtype(plan::Dtype dtype);

/// The pipeline stages of pipeline rank `rank` (chunk c is stage c·pp + rank).
models::StagePart stage_part(const plan::Config& c, int64_t pp, int64_t rank);

}  // namespace tessel::models
