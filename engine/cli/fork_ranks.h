// Tests start the ranks of one node many times over (the parity table: about 600 rank processes),
// and each new tessel-train spends about 0.45 s of a core registering LibTorch's operators before
// main. TESSEL_TEST_FORK_RANKS=N has this process, once loaded, fork the node's N ranks instead:
// each child continues as the rank a launcher would have started (RANK and LOCAL_RANK set, the
// rest of the worker environment inherited), so everything after start-up is the same code. CPU
// only: nothing has touched a device or started a thread when it forks. tessel-launch and the
// schedulers still start workers as separate programs (tested by the launcher's tests).
#pragma once

namespace tessel::cli {

/// Without TESSEL_TEST_FORK_RANKS, returns at once. With it: forks its N ranks; returns in each
/// child (its stdout and stderr in $TESSEL_TEST_FORK_LOGS/rank<R>.log when that is set), and in
/// the parent waits for them and exits: 0 when every rank did, else the first failed rank's
/// status (128 + the signal for a signal), the others killed 60 s after it failed. A rank dies
/// with the parent (PR_SET_PDEATHSIG), so killing the parent stops the node.
void fork_ranks_if_asked();

}  // namespace tessel::cli
