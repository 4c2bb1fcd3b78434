// What the plan says about the model, in the terms models/ takes: its shape (models know no
// YAML) and the pipeline stages a rank holds.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "core/plan/config.h"
#include "models/layers.h"
#include "models/shape.h"

namespace tessel::planner {

/// The model section of a validated plan (every "auto" resolved) as models::ModelShape.
models::ModelShape model_shape(const plan::ModelConfig& m);

/// training.dtype (resolved: fp32 | bf16 | fp16) as a tensor dtype.
c10::ScalarType resolve_dtype(plan::Dtype dtype);

/// The pipeline stages of pipeline rank `rank` (chunk c is stage c·pp + rank).
models::StagePart stage_part(const plan::Config& c, int64_t pp, int64_t rank);

}  // namespace tessel::planner
