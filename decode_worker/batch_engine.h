// Continuous batching over one model and one KV pool: the decode worker's
// engine, also the colocated (prefill-here) path and the recompute path.
//
// Every Step() runs one forward over
//   - every running sequence's next token (one row each), and
//   - chunks of waiting prompts (a local prefill, or the recomputation of a
//     preempted sequence's prompt + generated tokens) up to a token budget,
// then samples for each row that ends a context. Finished sequences leave
// and waiting ones join at every step.
//
// KV pressure: before a step every running sequence must have room for one
// more position. When the pool is full the newest running sequence is
// preempted: its KV is freed and its prompt + generated tokens go back to
// the front of the queue to be prefilled again, after which its stream
// continues with the same tokens (sampling is keyed by seed and position).
//
// Batch cap: at most max_batch sequences run; with an inter-token-latency
// target, no new sequence is admitted while the measured step time (an
// exponential average) exceeds the target.
//
// Thread safety: Submit*/Cancel may be called from any thread; Step() from
// one thread only (the worker's engine loop). Sinks run on the Step thread.
#ifndef PDSERVE_DECODE_WORKER_BATCH_ENGINE_H_
#define PDSERVE_DECODE_WORKER_BATCH_ENGINE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/block_hash.h"
#include "common/generation.h"
#include "common/kv_manager.h"
#include "common/model.h"

namespace pdserve {

struct BatchEngineOptions {
  int32_t max_batch = 64;
  // Prompt tokens prefilled per step across all waiting sequences.
  int32_t prefill_chunk_tokens = 256;
  // 0: no inter-token-latency cap.
  double itl_target_seconds = 0;
  // Local prefills start from the longest cached prefix of their context,
  // and a sequence that ends (or is preempted) publishes its full blocks,
  // so a later turn of the same conversation prefills only what is new.
  bool prefix_cache = false;
};

// What a sequence's sink receives: a token (status OK), or the end of the
// stream with an error (CANCELLED after Cancel, or the failure).
struct EngineEvent {
  absl::Status status;
  TokenEvent token;
  // The first token of a local prefill: context positions that came from
  // the prefix cache.
  int32_t cached_tokens = 0;
};
using EventSink = std::function<void(const EngineEvent&)>;

struct BatchEngineStats {
  int64_t steps = 0;
  int64_t preemptions = 0;
  int32_t running = 0;
  int32_t waiting = 0;
  double step_seconds_avg = 0;  // Exponential average.
  double mean_history = 0;      // Mean positions per running sequence, last step.
};

class BatchEngine {
 public:
  // REQUIRES: `kv` outlives the engine.
  BatchEngine(Model& model, KvManager& kv, BatchEngineOptions options);
  ~BatchEngine();
  BatchEngine(const BatchEngine&) = delete;
  BatchEngine& operator=(const BatchEngine&) = delete;

  // A request to prefill here; its first token is sampled here too.
  void SubmitPrefill(uint64_t id, std::unique_ptr<Generation> gen, EventSink sink);
  // A request whose KV for prompt positions is in `kv` (a committed
  // handoff) and whose first token was sampled elsewhere and replayed into
  // `gen`: it decodes from the next step.
  void SubmitDecode(uint64_t id, std::unique_ptr<Generation> gen, SequenceKv kv, EventSink sink);
  // Ends the sequence at the next step: its KV is freed at once then and its
  // sink gets CANCELLED. Unknown ids are ignored.
  void Cancel(uint64_t id);

  // One step. Returns false when there was nothing to do. Errors are fatal
  // for the engine (every sink has been told).
  absl::StatusOr<bool> Step();

  BatchEngineStats stats() const;

 private:
  struct Seq {
    uint64_t id = 0;
    std::unique_ptr<Generation> gen;
    EventSink sink;
    SequenceKv kv;
    // Waiting: the tokens to prefill and how many are in the KV already.
    std::vector<int32_t> context;
    int32_t fed = 0;
    int32_t cached = 0;  // Of fed, from the prefix cache.
    bool first_sent = false;
  };
  struct Inbox {
    std::vector<std::unique_ptr<Seq>> prefill;
    std::vector<std::unique_ptr<Seq>> decode;
    std::vector<uint64_t> cancel;
  };

  void DrainInbox();
  void Finish(Seq& s, absl::Status status);
  // Publishes s's full blocks to the prefix cache (prefix_cache only).
  void Publish(const Seq& s);
  void Preempt(size_t running_index);
  // Makes room for one more position in every running sequence.
  absl::Status ReserveDecodeRows();

  Model& model_;
  KvManager& kv_;
  const BatchEngineOptions options_;
  const BlockHasher hasher_;

  mutable absl::Mutex mu_;
  Inbox inbox_ ABSL_GUARDED_BY(mu_);
  BatchEngineStats stats_ ABSL_GUARDED_BY(mu_);

  // Step thread only.
  std::vector<std::unique_ptr<Seq>> running_;  // Admission order (newest last).
  std::deque<std::unique_ptr<Seq>> waiting_;
  double step_avg_ = 0;
};

}  // namespace pdserve

#endif  // PDSERVE_DECODE_WORKER_BATCH_ENGINE_H_
