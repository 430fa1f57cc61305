// One request's way through the cluster, as an explicit state machine:
//
//   kPlace ──(local)──────────────────────────────► kDecode ──► kFinish
//     │                                               ▲  │
//     └──► kPrefill ──(first token, handoff done)─────┘  │
//            │   ▲                                        │
//            │   └── kRetryPrefill (prefill worker died   │
//            │        before its handoff committed)       │
//            └──► kMigrate ◄──────────────────────────────┘
//                 (handoff refused by the decode side, a decode worker
//                  died mid-stream, a message that did not parse)
//                   └──► kPlace (prompt + every token sent so far)
//
//   kDecode ──(the worker paused the sequence to move it)──► kMove
//   kMove ──(moved: the target's stream)──────────────────► kDecode
//         ──(not moved: resumed on its worker)────────────► kDecode
//         ──(not moved: the worker ended it)──────────────► kMigrate
//
// kPlace picks a decode worker (the placement admission was given, on the
// first attempt) and opens its stream; kPrefill runs one prefill attempt,
// relaying the first token as soon as it is sampled; kDecode relays the
// decode worker's tokens; kMove sends a sequence its decode worker paused
// (draining, or asked to by the rebalance) to another decode worker, KV
// and all, or hands it back; kMigrate abandons a decode attempt; kFinish
// sends the final message. The router's own replay of every token gives
// the text and the state a migration continues from, so a stream is the
// same byte for byte whatever failed on the way.
//
// Every worker call goes through a WorkerTransport and every reading of
// time through the injected clock, so relays run in-process in tests with
// fake workers and a fake clock (tests/router/relay_test.cc).
//
// Thread safety: Run on one thread; Cancel from any.
#ifndef PDSERVE_ROUTER_RELAY_H_
#define PDSERVE_ROUTER_RELAY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/generation.h"
#include "base/metrics.h"
#include "text/tokenizer.h"
#include "kv_transfer/grant.h"
#include "pdserve/v1/generation.pb.h"
#include "router/admission.h"
#include "router/assignment.h"
#include "router/attempt.h"
#include "router/measured.h"
#include "router/placement.h"
#include "router/relay_observer.h"
#include "router/request_queue.h"
#include "router/running_sequences.h"
#include "router/transport.h"
#include "router/worker_pool.h"

namespace pdserve::router {

// Wall time that never steps back (the steady clock from a wall-clock
// base): the relay's durations stay true across NTP steps.
Clock MonotonicClock();

struct RelayOptions {
  bool colocated = false;
  // How long a request waits for a pool with no usable worker before it
  // ends with UNAVAILABLE (capped by the client's deadline).
  absl::Duration pick_wait = absl::Seconds(3);
  // Decode attempts per request (the first and its migrations) that may
  // go back to workers that already failed it.
  int max_decode_attempts = 8;
  // Whether a prefill worker whose call failed still answers (then the
  // decode side refused the handoff): its Status, within this.
  absl::Duration handoff_check_timeout = absl::Milliseconds(300);
  // Every request's calls to workers end by this long after it arrived,
  // whatever the client's deadline (none: the client's alone).
  absl::Duration max_request_duration = absl::InfiniteDuration();
  Clock clock = MonotonicClock();
  // How a relay with no usable worker waits: until the pool's serving
  // workers change (`seen` is the epoch its pick saw), the client cancels,
  // or `timeout`. Null: WorkerPool::AwaitServingChange. Tests put a fake
  // clock's step here.
  std::function<void(uint64_t seen, absl::Duration timeout)> await_serving;
  // A sequence its decode worker paused to move is sent to another decode
  // worker with its KV (false: it resumes where it is, or, from a
  // draining worker, is replayed elsewhere).
  bool moves = true;
  // How long a move's MoveSequence may take.
  absl::Duration move_timeout = absl::Seconds(10);
};

// What every relay of one router shares; all must outlive the relays.
struct RelayContext {
  RelayOptions options;
  WorkerPool* pool = nullptr;
  Placement* placement = nullptr;
  WorkerTransport* transport = nullptr;
  MeasuredInputs* measured = nullptr;
  // The queue for decode KV room and the ledger it places against (none:
  // requests go on at once, placed by the workers' reports alone).
  RequestQueue* queue = nullptr;
  DecodeRoom* room = nullptr;
  AdmissionController* admission = nullptr;  // none: every request is taken
  int64_t admission_min_samples = 20;
  const tok::Tokenizer* tokenizer = nullptr;
  const RelayMetrics* metrics = nullptr;
  // Where relays report what happened (none: a MetricsObserver over
  // `metrics` and `measured`).
  RelayObserver* observer = nullptr;
  std::atomic<int64_t>* in_flight = nullptr;  // requests being relayed
  std::atomic<uint64_t>* next_id = nullptr;   // internal request ids
  // Handoff grants: each prefill attempt's, for its decode worker (none: no
  // grants; decode workers without a key take any reservation).
  std::shared_ptr<const kv::GrantKey> grant_key;
  absl::Duration grant_ttl = absl::Seconds(120);
  // Where relays list the sequences they are decoding (none: not listed).
  RunningSequences* running = nullptr;
};

enum class RelayState { kPlace, kPrefill, kRetryPrefill, kDecode, kMove, kMigrate, kFinish };
const char* RelayStateName(RelayState s);

class Relay {
 public:
  // `request` is validated (router/resolve.h). `deadline`: the client's
  // (bounded by options.max_request_duration);
  // `received`: when the router got it (on the relay's clock; default: when
  // Run starts), the start of its TTFT and duration.
  Relay(const RelayContext& context, GenerationRequest request, std::string client_id,
        std::optional<absl::Time> deadline, std::optional<absl::Time> received = std::nullopt);
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;

  // Runs the request to its end. `emit` gets every message for the client
  // (false: the client is gone). OK: the final message was emitted. Else
  // the status the client gets instead of one: CANCELLED (by the client),
  // RESOURCE_EXHAUSTED (the queue's bounds, admission), DEADLINE_EXCEEDED
  // (the client's deadline passed while queued), INVALID_ARGUMENT (more KV
  // than any decode worker holds), UNAVAILABLE (no worker of a pool could
  // take it before any token), INTERNAL (a second message that did not
  // parse, naming the field).
  absl::Status Run(const std::function<bool(const v1::GenerateResponse&)>& emit);

  // The client went away: ends every call in progress. Thread-safe. The
  // fronts call it through a ClientCancel (router/client_cancel.h).
  void Cancel();
  // The API key it came with: the queue takes keys in turn. Set before Run.
  void set_queue_key(std::string key) { queue_key_ = std::move(key); }

  // Every state entered, in order (tests assert the path taken).
  const std::vector<RelayState>& trace() const { return trace_; }

 private:
  RelayState Place();
  RelayState Prefill();
  // Before prefill worker `p` computes the context: the prefix another
  // prefill worker holds, pulled to `p` where the placement predicts that
  // cheaper (Placement::PlanPull). Any failure only means `p` computes it.
  void PullPrefix(Worker& p);
  RelayState RetryPrefill();
  RelayState Decode();
  RelayState ReadDecode();
  RelayState Move();
  RelayState Migrate();
  absl::Status Finish();
  // No prefill worker can take the attempt: the request ends UNAVAILABLE
  // with `error`, after its decode call is drained.
  RelayState NoPrefillWorker(std::string error);

  bool Admit();
  // Waits in the queue until a decode worker has room (first_ and lease_
  // then say where), or returns why not; `end` says how the wait ended
  // (kPlaced when it was not waited: no decode worker serves, or an error).
  absl::Status Enqueue(QueueEnd* end);
  // The positions a request takes on its decode worker.
  int64_t Positions() const;
  // Picks, waiting up to pick_wait (and the deadline) while none is usable.
  WorkerPtr PickWaiting(const std::function<WorkerPtr()>& pick);
  // Sends a chunk to the client; keeps the TTFT, ITL and relay cost.
  void SendChunk(const v1::TokenChunk& chunk);
  // The first bad message costs one retry; the second ends the request
  // (true) with INTERNAL naming the field.
  bool Unparseable(const char* role, const std::string& address, const absl::Status& why);
  // The decode stream's tokens are no longer wanted: it is cancelled and
  // drained by kDecode.
  void StopDecode();
  // This placement's Decode call on `d` ended without a final message:
  // tells d the request id is done there (WorkerTransport::Release), so a
  // handoff that no call will claim is freed at once.
  void ReleaseHandoff(const Worker& d);
  // Whether `w` still answers its Status healthy (within
  // handoff_check_timeout): a call it failed was then its own doing, not
  // its death or shutdown.
  bool StillServing(const Worker& w);
  void OpenDecode(std::unique_ptr<DecodeStream> s);
  // Lists (or updates) the decoding sequence in context_.running.
  void ListRunning();
  // Cancels the open decode stream and reads it to its end.
  void DrainDecode();
  void OpenPrefill(std::unique_ptr<PrefillStream> s);
  void ClosePrefill();
  void CloseDecode();
  bool client_cancelled() const { return client_cancelled_.load(std::memory_order_relaxed); }
  absl::Time Now() const { return context_.options.clock(); }
  std::optional<absl::Time> LifeDeadline(absl::Time from) const;

  const RelayContext& context_;
  MetricsObserver default_observer_;
  RelayObserver* observer_;  // context_.observer, or default_observer_
  const GenerationRequest request_;
  const std::string client_id_;
  const std::optional<absl::Time> client_deadline_;
  // The client's, bounded by max_request_duration from when the request
  // left the queue (its arrival, without a queue).
  std::optional<absl::Time> deadline_;
  const std::optional<absl::Time> received_;
  const std::function<bool(const v1::GenerateResponse&)>* emit_ = nullptr;
  std::vector<RelayState> trace_;

  absl::Time start_;
  PromptChains prompt_chains_;
  Placed first_;  // the placement admission saw, for the first attempt
  std::optional<AdmissionTicket> ticket_;
  std::string queue_key_;
  RoomLease lease_;  // the current decode attempt's room on its worker
  Generation replay_;
  std::vector<int32_t> streamed_;  // every token sent to the client
  v1::GenerateResponse msg_;
  v1::Timings timings_;
  int32_t completion_ = 0;
  FinishReason finish_ = FinishReason::kNone;
  std::string error_;
  bool cancelled_ = false;    // ended early (by the client, or a CANCELLED call)
  bool unavailable_ = false;  // no worker of a pool could take it
  bool internal_ = false;
  int parse_failures_ = 0;
  double max_itl_ = 0, sum_itl_ = 0;
  int32_t gaps_ = 0;
  absl::Time last_token_;
  bool client_gone_ = false;
  std::vector<double> relay_costs_;  // read to written, per relayed message

  // Decode attempts.
  int attempt_ = 0;
  Exclusions failed_decode_;
  Exclusions avoid_prefill_;  // sent a message that did not parse
  std::string internal_id_;
  std::optional<PromptChains> migrated_chains_;
  PromptChains* chains_ = nullptr;
  WorkerPtr decode_;
  Assignment decode_load_;  // decode_'s in_flight while its call is open
  bool local_ = false;
  Attempt requests_;  // what this decode attempt sends to workers
  bool decode_expected_ = false;
  // The prefill attempts of this decode attempt.
  WorkerPtr prefill_;
  Exclusions failed_prefill_;
  absl::Status prefill_status_;
  bool first_sent_ = false;
  int32_t first_token_ = -1;
  // Why kMigrate abandons the decode attempt.
  struct Migration {
    bool exclude_decode = false;  // this worker no more for this request
    bool mark_failed = false;     // nor for any, until a probe says it serves
    std::string why;
  } migration_;
  // The decode worker's MovePoint that kMove answers.
  worker::v1::MovePoint pause_;

  std::atomic<bool> client_cancelled_{false};
  absl::Mutex streams_mu_;
  std::unique_ptr<PrefillStream> prefill_stream_ ABSL_GUARDED_BY(streams_mu_);
  std::unique_ptr<DecodeStream> decode_stream_ ABSL_GUARDED_BY(streams_mu_);
  // A move's target stream, until the move is done.
  std::unique_ptr<DecodeStream> move_stream_ ABSL_GUARDED_BY(streams_mu_);
  // The same streams, read by Run's thread (null: none open).
  PrefillStream* prefill_reader_ = nullptr;
  DecodeStream* decode_reader_ = nullptr;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_RELAY_H_
