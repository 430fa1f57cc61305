// The one scheduler of both worker roles (DESIGN.md fact 1: every phase is
// an (S0, m) forward). Pure: what the engine's sequences need goes in, a
// plan for one step comes out; it allocates nothing and touches no model.
//
// A step's forward has one row per running sequence (its next token: S0 =
// positions so far, m = 1) and then chunks of waiting contexts (a prompt,
// or a preempted sequence's prompt + generated tokens: S0 = what is in the
// KV already, m = the chunk), within a token budget and a batch cap. A
// prefill worker's engine has no running rows; a decode worker's has both.
//
// KV pressure: every running sequence must have room for one more
// position. If the pool cannot give that, the newest running sequences are
// preempted (their KV freed; they prefill again later) until it can; a step
// that preempts starts no chunk. A chunk is taken only if its blocks fit
// too. If nothing at all fits, sequences behind the queue's head that hold
// partial prefills give their KV back so that the head can go first; if
// none does and the head needs more than the whole pool, it is rejected;
// otherwise it waits for blocks others hold (handoff reservations).
#ifndef PDSERVE_ENGINE_SCHEDULER_H_
#define PDSERVE_ENGINE_SCHEDULER_H_

#include <cstdint>
#include <vector>

namespace pdserve::engine {

struct SchedulerOptions {
  int32_t max_batch = 64;      // Sequences per forward (rows + chunks).
  int32_t chunk_tokens = 256;  // Context tokens prefilled per forward, across chunks.
};

// A sequence in the running batch.
struct RunningSeq {
  int32_t positions = 0;  // In its KV.
  int32_t blocks = 0;     // Held.
};

// A sequence in the waiting queue; fed == 0 and blocks == 0: not started.
struct WaitingSeq {
  int32_t context = 0;  // Tokens to prefill in all.
  int32_t fed = 0;      // Of them, in its KV (prefilled, or attached from the prefix cache).
  int32_t blocks = 0;   // Held.
};

struct SchedulerInput {
  std::vector<RunningSeq> running;  // Admission order, newest last.
  std::vector<WaitingSeq> waiting;  // Queue order.
  int64_t allocatable_blocks = 0;   // What the KV manager can hand out now (free + evictable).
  int64_t total_blocks = 0;         // The pool.
  int32_t block_size = 16;
  // False while the step time is over the inter-token-latency target: no
  // waiting sequence starts (started ones still finish).
  bool admit_new = true;
};

struct StepPlan {
  struct Chunk {
    int32_t waiting = 0;  // Index into SchedulerInput::waiting.
    int32_t tokens = 0;
    bool ends_context = false;  // Its row's logits are sampled.
  };
  // Applied in this order:
  // 1. the newest `preempt` running sequences give their KV back and go to
  //    the front of the queue (the oldest of them first);
  int32_t preempt = 0;
  // 2. these waiting sequences (never the head) give their partial KV back;
  std::vector<int32_t> release;
  // 3. the queue's head needs more than the whole pool: it ends;
  bool reject_head = false;
  // 4. the forward: one row for each of the first `decode_rows` running
  //    sequences, then `chunks`.
  int32_t decode_rows = 0;
  std::vector<Chunk> chunks;
  // Blocks the forward's rows and chunks need beyond what they hold.
  int64_t blocks_needed = 0;

  bool has_forward() const { return decode_rows > 0 || !chunks.empty(); }
};

// Blocks that hold `positions` positions.
inline int64_t BlocksFor(int64_t positions, int32_t block_size) {
  return (positions + block_size - 1) / block_size;
}

StepPlan PlanStep(const SchedulerInput& in, const SchedulerOptions& options);

}  // namespace pdserve::engine

#endif  // PDSERVE_ENGINE_SCHEDULER_H_
