// The prefill worker's gRPC service. Requests go through three threads in
// order. For each request,
//   1. the reserve thread reserves KV blocks on the chosen decode worker
//      (kv_transfer; a network round trip the compute thread never waits
//      for), keeping at most 2 x max_batch requests reserved ahead of the
//      compute, and hands the request to the engine (engine/, a
//      prefill-only request). A decode worker whose pool has no room for
//      the reservation is asked again each time it tells of freed room
//      (kv::RoomFreed), up to handoff_room_wait: a full pool is a wait, not a failed handoff, and
//      the prefill is computed only once the room is held. Meanwhile the
//      request is set aside and the others are served; the ones waiting
//      for the same decode worker are asked in arrival order;
// then the engine's thread runs chunked prefill over its requests with a
// per-step token budget (several prompts per forward; the longest cached
// prefix of each prompt is reused), and
//   2. streams every layer's KV to them from the last chunk's forward, as
//      soon as the layer is written, while later layers still compute,
//   3. samples the first token and sends it to the router at once (TTFT),
//   4. commits the handoff (token ids, first token, sampling state) on a
//      separate thread, so the next prompt's compute is not held up, and
//      reports HandoffDone.
// A first token that already ends the request aborts the handoff instead.
//
// Thread safety: thread-safe.
#ifndef PDSERVE_PREFILL_WORKER_PREFILL_SERVICE_H_
#define PDSERVE_PREFILL_WORKER_PREFILL_SERVICE_H_

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "engine/engine.h"
#include "kv/kv_manager.h"
#include "kv/kv_events.h"
#include "model/model.h"
#include "grammar/constraint.h"
#include "text/tokenizer.h"
#include "kv_transfer/sender.h"
#include "proto/received.h"
#include "pdserve/v1/worker.grpc.pb.h"

namespace pdserve::prefill {

class PrefixPusher;  // prefix_pull.h
struct PullCounters;

struct PrefillServiceOptions {
  // Bounds on response formats (JSON Schema compiles and their masks).
  grammar::GrammarOptions grammar;
  int32_t chunk_tokens = 512;  // Prompt tokens per forward, across requests.
  // Each layer's KV is sent as the forward finishes it; false: every layer
  // after the forward (only to measure what streaming saves).
  bool stream_layers = true;
  int32_t max_batch = 8;       // Requests per forward.
  // Fault tests only: hold each handoff this long between the first token
  // and the commit, so a test can kill the worker mid-handoff.
  int32_t fault_stall_before_commit_ms = 0;
  // Fault tests only: each forward waits this long first (a kill then
  // lands mid-prefill, after the decode side's reservation).
  int32_t fault_stall_prefill_ms = 0;
  // Fault tests only: the first N Prefill streams (-1: every one) send
  // their first token as a message that does not parse.
  int32_t fault_unparseable_streams = 0;
  // The bound on a request's life (engine::EngineOptions::life_base).
  absl::Duration life_base = absl::Seconds(60);
  double life_step_factor = 10;
  absl::Duration life_min_per_token = absl::Milliseconds(50);
  // How long a request waits for KV room on its decode worker (a
  // reservation refused for lack of room is asked again when the decode
  // worker tells of freed room) before it ends
  // with RESOURCE_EXHAUSTED; zero: it ends at the first refusal.
  absl::Duration handoff_room_wait = absl::Seconds(20);
  // The prefix cache's second tier (engine::EngineOptions::tier2; null:
  // none). REQUIRES: outlives the service.
  Tier2Store* tier2 = nullptr;
  // Prefix pulls (prefix_pull.h; null: off). `pusher` answers PushPrefix;
  // `pull_address` is this worker's pull receiver (Status reports it as
  // kv_address) and `pulls` its counters. REQUIRES: they outlive the
  // service.
  PrefixPusher* pusher = nullptr;
  std::string pull_address;
  const PullCounters* pulls = nullptr;
};

class PrefillCall;  // One Prefill stream (prefill_service.cc).

class PrefillService final : public worker::v1::PrefillWorker::CallbackService {
 public:
  // REQUIRES: everything outlives the service.
  PrefillService(Model* model, KvManager* kv, const tok::Tokenizer* tokenizer,
                 kv::KvSender* sender, PrefillServiceOptions options);
  // The response formats this worker compiled (for its metrics).
  const grammar::GrammarCache& grammars() const { return *grammars_; }
  ~PrefillService() override;

  grpc::ServerWriteReactor<worker::v1::PrefillEvent>* Prefill(grpc::CallbackServerContext* ctx,
                                                              const worker::v1::PrefillRequest* req) override;
  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* ctx, const worker::v1::WorkerStatusRequest* req,
                                   worker::v1::WorkerInfo* out) override;
  // Runs on the push thread (a handoff's round trips never hold a gRPC
  // callback thread); FAILED_PRECONDITION without a pusher.
  grpc::ServerUnaryReactor* PushPrefix(grpc::CallbackServerContext* ctx, const worker::v1::PushPrefixRequest* req,
                                       worker::v1::PushPrefixResponse* out) override;

  void Shutdown();
  struct Stats {
    int32_t queued = 0;
    int64_t queued_tokens = 0;
    int32_t in_flight = 0;
  };
  Stats stats();
  // Monotonic, for the worker's metrics.
  struct Counters {
    int64_t room_waits = 0;        // Reservations that waited for room.
    double room_wait_seconds = 0;  // Their waits, summed once each ends.
    int64_t room_retries = 0;      // Reservations asked again after freed room.
    // Context tokens prefilled here whose KV no decode worker took (the
    // commit failed, or the handoff ended otherwise after the forward;
    // requests their first token ended or their caller cancelled aside).
    int64_t discarded_tokens = 0;
  };
  Counters counters() const;
  engine::EngineStats engine_stats() const { return engine_.stats(); }
  // The engine's error once its thread stopped on one (OK while it runs).
  absl::Status engine_failure() const { return engine_.failure(); }
  bool draining();
  // No request queued, prefilling or handing off.
  bool idle();
  // The worker's health verdict ("" = serving), reported by Status.
  void set_unhealthy_reason(std::string why) {
    absl::MutexLock lock(&mu_);
    unhealthy_reason_ = std::move(why);
  }
  // SIGTERM: new Prefill calls get UNAVAILABLE and Status reports not
  // healthy; queued and running requests finish until `deadline`, after
  // which the rest end with UNAVAILABLE (the router prefills them again
  // elsewhere).
  void Drain(absl::Time deadline);

 private:
  friend class PrefillCall;
  using Clock = std::chrono::steady_clock;
  struct Job;
  struct RoomWait;
  // The decode side's reservation, a network round trip: on a thread of
  // its own, so the engine's thread never waits for one.
  void ReserveLoop();
  // A job off the queue: reserved and submitted, set aside to wait for
  // room, or ended.
  void Reserve(const std::shared_ptr<Job>& job);
  // The jobs waiting for room: the cancelled (when `cancels` says some
  // may be) and those past the bound end; where the next try is due, the
  // oldest asks again, and on success the next one at once.
  void ServeRoomWaits(bool cancels);
  void BeginRoomWait(RoomWait& wait, const std::shared_ptr<Job>& job);
  void EndRoomWait(Job& job);
  // The earliest next try or bound among the waits (none: nothing waits).
  std::optional<Clock::time_point> NextRoomEvent() const;
  // Hands a reserved job to the engine.
  void Submit(const std::shared_ptr<Job>& job);
  // The caller went away: the job ends where it is (queued, reserving, or
  // in the engine).
  void Cancel(Job& job);
  void CommitLoop();
  void PushLoop();
  // Connects (once per address) and reserves; errors end the job.
  absl::Status StartHandoff(Job& job);
  void FinishJob(const std::shared_ptr<Job>& job, absl::Status status);

  Model* model_;
  KvManager* kv_;
  const tok::Tokenizer* tokenizer_;
  // Response formats this worker has compiled (its vocabulary made on first use).
  std::unique_ptr<grammar::GrammarCache> grammars_;
  kv::KvSender* sender_;
  const PrefillServiceOptions options_;
  rpc::UnparseableFault fault_unparseable_;
  // What the prefix cache holds, for the router (Status carries it).
  KvEventLog kv_events_;
  std::unique_ptr<TieredListener> tiered_events_;  // With a second tier: both tiers into kv_events_.

  absl::Mutex mu_;
  std::deque<std::shared_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);  // Not reserved yet.
  int32_t in_engine_ ABSL_GUARDED_BY(mu_) = 0;  // Reserved; in the engine until the first token.
  std::deque<std::shared_ptr<Job>> commits_ ABSL_GUARDED_BY(mu_);
  int64_t queued_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool commits_closed_ ABSL_GUARDED_BY(mu_) = false;  // No more will come.
  std::string unhealthy_reason_ ABSL_GUARDED_BY(mu_);

  int32_t waiting_for_room_ ABSL_GUARDED_BY(mu_) = 0;  // Jobs in room_waits_.
  // Connections whose decode worker told of freed room (the sender's room
  // listener), not yet looked at by the reserve thread.
  absl::flat_hash_set<const kv::Connection*> room_freed_ ABSL_GUARDED_BY(mu_);
  // A wait was told of room but the lookahead was full: served once the
  // engine takes a job.
  bool room_pending_ ABSL_GUARDED_BY(mu_) = false;
  // Bumped by each cancel of a job outside the engine: wakes the reserve
  // thread, so a wait for room ends at once.
  int64_t cancels_ ABSL_GUARDED_BY(mu_) = 0;

  // Reserve thread only.
  kv::ReceiverConnections connections_{sender_};
  absl::flat_hash_map<std::string, RoomWait> room_waits_;  // By decode KV address.

  std::atomic<int64_t> room_waits_total_{0};
  std::atomic<double> room_wait_seconds_{0};
  std::atomic<int64_t> room_retries_{0};
  std::atomic<int64_t> discarded_tokens_{0};

  // PushPrefix calls waiting for the push thread.
  std::deque<std::function<void()>> pushes_ ABSL_GUARDED_BY(mu_);

  engine::Engine engine_;
  std::thread push_thread_;
  std::thread reserve_thread_;
  std::thread commit_thread_;
};

}  // namespace pdserve::prefill

#endif  // PDSERVE_PREFILL_WORKER_PREFILL_SERVICE_H_
