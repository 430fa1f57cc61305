#include "engine/scheduler.h"

#include <algorithm>

namespace pdserve::engine {

StepPlan PlanStep(const SchedulerInput& in, const SchedulerOptions& options) {
  StepPlan plan;
  int64_t left = in.allocatable_blocks;

  // Decode rows, oldest first; preempt from the newest end while the pool
  // cannot give every remaining row its next position.
  int32_t rows = static_cast<int32_t>(in.running.size());
  for (int32_t i = 0; i < rows;) {
    const RunningSeq& r = in.running[i];
    const int64_t need = BlocksFor(r.positions + 1, in.block_size) - r.blocks;
    if (need <= left) {
      left -= need;
      plan.blocks_needed += need;
      ++i;
      continue;
    }
    // The newest row gives its blocks back (it may be row i itself).
    --rows;
    ++plan.preempt;
    if (rows > i) {
      left += in.running[rows].blocks;
    } else {
      left += r.blocks;  // Row i was the newest: nothing of it was counted.
    }
  }
  plan.decode_rows = rows;
  if (plan.preempt > 0) return plan;  // The pool is short: no chunk starts.

  // Chunks from the front of the queue within the budget and the cap.
  int32_t budget = options.chunk_tokens;
  for (int32_t j = 0; j < static_cast<int32_t>(in.waiting.size()) && budget > 0; ++j) {
    if (plan.decode_rows + static_cast<int32_t>(plan.chunks.size()) >= options.max_batch) break;
    const WaitingSeq& w = in.waiting[j];
    const bool started = w.fed > 0 || w.blocks > 0;
    if (!started && !in.admit_new) break;
    const int32_t remaining = w.context - w.fed;
    if (remaining <= 0) continue;
    const int32_t n = std::min(budget, remaining);
    const int64_t need = std::max<int64_t>(0, BlocksFor(w.fed + n, in.block_size) - w.blocks);
    if (need > left) break;
    left -= need;
    plan.blocks_needed += need;
    plan.chunks.push_back({j, n, n == remaining});
    budget -= n;
  }
  if (plan.has_forward() || in.waiting.empty()) return plan;

  // Nothing fits. Partial prefills behind the head give their KV back (they
  // prefill again later) so that the head can go first...
  for (int32_t j = 1; j < static_cast<int32_t>(in.waiting.size()); ++j) {
    if (in.waiting[j].blocks > 0) plan.release.push_back(j);
  }
  // ...and if none holds any, the head waits for blocks others hold, or,
  // needing more than the whole pool (its context and one generated
  // token), ends.
  if (plan.release.empty()) {
    plan.reject_head = BlocksFor(int64_t{in.waiting[0].context} + 1, in.block_size) > in.total_blocks;
  }
  return plan;
}

}  // namespace pdserve::engine
