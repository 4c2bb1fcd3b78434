// Every rank must train the same plan: ranks started with different files (another lr, seed or
// data path) would otherwise train on silently. At start each rank publishes its resolved plan
// in the rendezvous store and compares it with rank 0's; any difference stops every rank, and
// the ranks that differ name the first key, both values and the ranks.
#pragma once

#include "core/plan/config.h"
#include "parallel/mesh.h"

namespace tessel::run {

/// Throws UserError on every rank when any rank's resolved plan differs from rank 0's.
void check_same_plan(const plan::Config& c, const parallel::Mesh& mesh);

}  // namespace tessel::run
