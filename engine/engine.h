// The engine both worker roles run: requests in, one compute thread, the
// scheduler and the model. Each step is
//
//   plan (scheduler.h, from the sequences' KV needs and the pool's counts)
//   → allocate (the KV manager; its lock covers this bookkeeping only)
//   → forward (Model::Forward over ready block tables; never allocates)
//   → apply (sample, stream tokens, move requests between states).
//
// Requests come in three modes:
//   kLocal        prefill here, then decode (a colocated request, and a
//                 preempted one's recomputation);
//   kPrefillOnly  prefill here, and after the first token hand the KV to
//                 its owner (the prefill worker commits it to a decode
//                 worker); the KV of every layer is reported while the last
//                 chunk's forward still computes later layers;
//   kDecodeOnly   its KV came by handoff and its first token was sampled
//                 elsewhere (replayed into its Generation): it decodes.
// Preemption frees a running request's KV and recomputes its prompt +
// generated tokens later; sampling is keyed by (seed, position), so its
// stream goes on with the same tokens.
//
// Other threads hand the engine work through Submit and Cancel (a queue
// drained at every step). Callbacks run on the engine's thread and must not
// block.
//
// Thread safety: Submit, Cancel, stats and Stop are thread-safe; Step runs
// on one thread (the engine's own after Start, or the caller's when it
// never starts it: tests and benchmarks).
#ifndef PDSERVE_ENGINE_ENGINE_H_
#define PDSERVE_ENGINE_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv/block_hash.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/generation.h"
#include "kv/kv_manager.h"
#include "kv/tier2_store.h"
#include "model/model.h"

namespace pdserve::engine {

struct EngineOptions {
  int32_t max_batch = 64;
  // Context tokens prefilled per step across all waiting requests.
  int32_t chunk_tokens = 256;
  // 0: no inter-token-latency cap; else no new request starts while the
  // measured step time (an exponential average) exceeds it.
  double itl_target_seconds = 0;
  // Prefills start from the longest cached prefix of their context, and a
  // request that ends (or is preempted) publishes its full blocks.
  bool prefix_cache = false;
  // The life bound frees the KV of a request that stopped moving (leaked,
  // wedged) without waiting on its client's deadline: a request that is
  // computing (prefilling, between its chunks too, or decoding) ends with
  // DEADLINE_EXCEEDED (its KV freed), logged as request_expired, once it
  // has made no progress for LifeBound() = life_base + one token's
  // allowance, max(life_step_factor x the measured p99 step time,
  // life_min_per_token). Progress is its first forward (a handed-off
  // request: its admission to the running batch), a prefill chunk
  // computed, a token. Time queued (waiting, or preempted and waiting to
  // recompute) never counts, and a stream that keeps making progress is
  // never ended by it: the client's deadline and cancellation end those.
  // The bound measures silence, not age, because load stretches a
  // healthy stream's age (queueing, slower steps) but not the gaps between
  // its tokens, and a stream that keeps producing ends at its max_tokens
  // anyway. Progress is stamped after each forward, so a slow forward does
  // not count against the requests it serves; the one token's allowance
  // keeps the bound above the engine's own step times on a slow host.
  absl::Duration life_base = absl::Seconds(60);
  double life_step_factor = 10;
  absl::Duration life_min_per_token = absl::Milliseconds(50);
  // The prefix cache's second tier (kv/tier2_store.h; null: none). With
  // prefix_cache, a request whose cached prefix runs on in the tier reads
  // those blocks back into the pool before it computes (it leaves the
  // queue while they are read, and the rest of the engine goes on), and
  // every block the engine publishes is offered to the tier. A block read
  // back is verified first; one that fails is computed instead.
  // REQUIRES: outlives the engine; the pool is in host memory.
  Tier2Store* tier2 = nullptr;
  // The life bound's clock (tests put a fake one here).
  std::function<absl::Time()> clock = absl::Now;
  // Fault tests only: every forward waits this long first (a slow model:
  // the wait counts in the step time).
  absl::Duration fault_stall_forward = absl::ZeroDuration();
};

enum class RequestMode { kLocal, kPrefillOnly, kDecodeOnly };

struct RequestCallbacks {
  // A sampled token; the first of a prefill carries the context positions
  // that came from the prefix cache.
  std::function<void(const TokenEvent& token, int32_t cached_tokens)> on_token;
  // Just before the first token's on_token: the context positions that
  // came from the prefix cache, and of them those read back from the
  // second tier (null: not wanted).
  std::function<void(int32_t cached_tokens, int32_t tier2_tokens)> on_first_cached;
  // The request ended inside the engine: OK (stop or length), CANCELLED,
  // or its error. Called once, after its last token. (A kPrefillOnly
  // request that hands off ends with its owner instead.)
  std::function<void(const absl::Status& status)> on_end;
  // kPrefillOnly: every position of the context has layer `layer`'s KV
  // written (called during the last chunk's forward). An error ends the
  // request once the forward is done.
  std::function<absl::Status(int32_t layer, const SequenceKv& kv)> on_layer_written;
  // kPrefillOnly: the first token (already given to on_token) did not end
  // the request; it is handing off now and its KV goes to the callee.
  std::function<void(const TokenEvent& first, SequenceKv kv)> on_handoff;
};

// One request. Made by a worker, shared by it and the engine.
struct Request {
  Request(RequestId id, RequestMode mode, std::unique_ptr<Generation> gen, RequestCallbacks callbacks)
      : id(std::move(id)), mode(mode), gen(std::move(gen)), callbacks(std::move(callbacks)) {}

  const RequestId id;
  const RequestMode mode;
  RequestLifecycle lifecycle;
  const absl::Time arrived = absl::Now();

  // Set before Submit, then the engine thread's only.
  std::unique_ptr<Generation> gen;
  SequenceKv kv;  // kDecodeOnly: the handed-off KV.
  // kDecodeOnly: what its handed-off KV must hash to, checked on the
  // engine's thread before its first step (KvCheck). A mismatch discards
  // the KV and the request computes its context here, as a preempted one
  // does.
  KvCheck kv_check;
  RequestCallbacks callbacks;

  // Engine thread only.
  std::vector<int32_t> context;  // Waiting: what to prefill; fed of it is in kv.
  int32_t fed = 0;
  int32_t cached = 0;  // Of fed, from the prefix cache (either tier).
  bool restore_tried = false;  // Read from the second tier once at most.
  int32_t restored = 0;        // Context positions read back from it (of `cached`).
  bool first_sent = false;
  absl::Status layer_status;  // kPrefillOnly: the first on_layer_written error.
  // Its latest progress on the engine's clock (EngineOptions::life_base):
  // stamped after each forward that serves it, and when a handed-off
  // request joins the running batch.
  absl::Time last_progress = absl::InfinitePast();
};

// How long `r` has gone without progress at `now`, as the life bound counts
// it (EngineOptions::life_base): now - r.last_progress while it is
// prefilling or decoding, zero in any other state (queued, preempted,
// finished). Pure; reads engine-thread-only fields.
absl::Duration TimeWithoutProgress(const Request& r, absl::Time now);

struct EngineStats {
  int64_t steps = 0;
  int64_t preemptions = 0;
  int32_t running = 0;
  int32_t waiting = 0;
  double step_seconds_avg = 0;  // Exponential average of steps with decode rows.
  double mean_history = 0;      // Mean positions per running request, last step.
  double p99_step_seconds = 0;  // Over the last 1024 steps.
  // Since the oldest request inside arrived, queued time included (0:
  // none): how long requests stay, not what the life bound measures.
  double oldest_request_seconds = 0;
  int64_t expired = 0;  // Requests ended by their life bound (no progress for LifeBound()).
  // Seconds spent in steps that did work (the forward, sampling, handing
  // the tokens on), and tokens sampled by decode rows, since start:
  // tokens / busy is the rate the engine decodes at while it works.
  double busy_seconds = 0;
  int64_t decode_tokens = 0;
  // Handed-off KV checked against its producer's checksums, and of those,
  // how many failed (their KV discarded and computed here: the positions
  // recomputed are kv_recomputed_positions).
  int64_t kv_checked = 0;
  int64_t kv_checksum_failures = 0;
  int64_t kv_recomputed_positions = 0;
  // Request-sharded KV: running requests per rank (empty otherwise); the
  // imbalance is max / mean.
  std::vector<int32_t> rank_rows;
};

class Engine {
 public:
  // REQUIRES: model and kv outlive the engine.
  Engine(Model& model, KvManager& kv, EngineOptions options);
  // Stops the thread; requests still inside end with UNAVAILABLE.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Runs steps on a thread of the engine's own until Stop.
  void Start();
  // Joins the thread (a step in progress finishes) and ends every request
  // still inside with UNAVAILABLE. Idempotent.
  void Stop();

  // REQUIRES: kLocal and kPrefillOnly requests are waiting; kDecodeOnly
  // ones are waiting-for-KV with their kv set, and not finished by their
  // replayed first token.
  void Submit(std::shared_ptr<Request> request);
  // Ends the request at the next step with `why` (CANCELLED, or e.g.
  // UNAVAILABLE for a drain): its KV is freed then and on_end gets `why`.
  // A request that is no longer inside is left alone.
  void Cancel(const std::shared_ptr<Request>& request, absl::Status why);

  // Takes a decoding request out of the running batch at the next step,
  // its KV kept (a decode worker moving the sequence to another: nothing
  // runs it meanwhile and nothing frees its blocks). `done` runs on the
  // engine's thread: true when it came out (from then on its holder keeps
  // it, and its KV holds every position but its last sampled token's,
  // until it Resumes it or lets it go), false when it was not decoding in
  // the batch (queued, preempted, finished) and is left as it was.
  void Pause(const std::shared_ptr<Request>& request, std::function<void(bool paused)> done);
  // A paused request joins the running batch again.
  void Resume(std::shared_ptr<Request> request);

  // One step. Returns whether it did anything (false: nothing to do, or
  // waiting for KV that others hold). An error is fatal for the engine:
  // every request inside has ended with it.
  absl::StatusOr<bool> Step();

  EngineStats stats() const;
  // How long a computing request may go without progress
  // (EngineOptions::life_base); thread-safe.
  absl::Duration LifeBound() const;
  // A step hit an error (every request ended with it, and a request
  // submitted after it ends at once with the same error). Set before any
  // request's on_end hears of the error.
  bool failed() const;
  // That error (OK while the engine runs).
  absl::Status failure() const;

 private:
  struct Inbox {
    std::vector<std::shared_ptr<Request>> requests;
    std::vector<std::pair<std::shared_ptr<Request>, absl::Status>> cancels;
    std::vector<std::pair<std::shared_ptr<Request>, std::function<void(bool)>>> pauses;
    std::vector<std::shared_ptr<Request>> resumes;
    // Second-tier reads that finished: the request and how many of its
    // blocks were read back and verified.
    std::vector<std::pair<std::shared_ptr<Request>, int32_t>> restored;
  };

  void Run();
  void DrainInbox();
  void End(Request& r, absl::Status status, EndReason reason);
  void EndAll(const absl::Status& status);
  // Records the engine's failure, then ends every request with it.
  void Fail(const absl::Status& status);
  void Publish(const Request& r);
  // The context's full-block hashes of `r` (its salt's chain), the first
  // `blocks` of them.
  std::vector<BlockHash> ContextHashes(const Request& r, int32_t blocks) const;
  // Starts reading the blocks that follow r's pool prefix from the second
  // tier; true when a read started (r then waits in restoring_).
  bool StartRestore(const std::shared_ptr<Request>& r);
  // A read started by StartRestore finished with `verified` blocks good:
  // they join the pool's prefix cache and r goes back to the queue's front.
  void FinishRestore(const std::shared_ptr<Request>& r, int32_t verified);
  void Preempt(std::shared_ptr<Request> r);
  SchedulerInput Describe() const;
  // Checks a handed-off request's KV against r.kv_check; true when it
  // matches (or there is nothing to check).
  bool CheckHandedOffKv(Request& r);
  // Samples the token ending r's row; false when r ended (or handed off).
  bool AcceptToken(Request& r, absl::Span<const float> logits);
  void PublishStats();
  // Ends the requests that made no progress for LifeBound().
  void EndExpired();
  // How long until the first computing request would pass LifeBound()
  // (infinite when none computes).
  absl::Duration UntilNextExpiry() const;
  void RecordStep(double seconds);

  Model& model_;
  KvManager& kv_;
  const EngineOptions options_;
  const BlockHasher hasher_;

  mutable absl::Mutex mu_;
  Inbox inbox_ ABSL_GUARDED_BY(mu_);
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);  // OK until a step hits an error.
  bool work_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time oldest_arrived_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  int free_listener_ = 0;  // kv_'s handle.
  std::atomic<std::thread::id> thread_id_{};

  // Engine thread only.
  std::vector<std::shared_ptr<Request>> running_;  // Admission order (newest last).
  std::deque<std::shared_ptr<Request>> waiting_;
  // Out of the queue while the second tier reads their blocks; a cancel
  // that comes meanwhile waits in restore_cancels_ until the read is done
  // (the read writes into their blocks until then).
  std::vector<std::shared_ptr<Request>> restoring_;
  std::vector<std::pair<std::shared_ptr<Request>, absl::Status>> restore_cancels_;
  double step_avg_ = 0;
  int64_t preemptions_ = 0;
  int64_t steps_ = 0;
  int64_t expired_ = 0;
  int64_t kv_checked_ = 0;
  int64_t kv_checksum_failures_ = 0;
  int64_t kv_recomputed_positions_ = 0;
  double busy_seconds_ = 0;
  int64_t decode_tokens_ = 0;
  std::vector<float> step_times_;  // Ring of the last kStepWindow steps.
  size_t step_next_ = 0;
  std::vector<float> p99_scratch_;
  // Written by the engine's thread, read by LifeBound from any thread.
  std::atomic<double> p99_step_{0};

  std::thread thread_;
};

}  // namespace pdserve::engine

#endif  // PDSERVE_ENGINE_ENGINE_H_
