// The decode worker's gRPC service (callback API): a thin adapter over an
// engine (engine/) that runs on its own thread. A Decode call is
// either colocated (prefill_here: the engine prefills, then decodes) or
// disaggregated (its KV comes by handoff from a prefill worker, and the
// call meets it in the HandoffTable, whichever arrives first).
//
// Each stream has at most one write outstanding; tokens that the engine
// produces meanwhile are buffered and go out together in the next chunk.
// The engine's thread only buffers: a writer thread starts the writes, so
// a step never waits for a socket. A
// stream whose write has not completed for stall_timeout (the client
// stopped reading and its flow-control window stays full), or whose buffer
// passes max_buffered_tokens, is cancelled: its request ends, its KV is
// freed and its batch slot goes to the streams that read.
//
// Deadlines (a handoff's wait, a stalled write) are timer entries of their
// own: nothing sweeps.
//
// Moves: a running sequence leaves for another decode worker with its KV
// (sequence_move.h) when this worker drains (longest context first) or
// the router asks (PauseSequence, to rebalance). The engine takes it out
// of the batch between steps; the stream says so (MovePoint) after every
// token sampled so far; the router picks the target, opens the target's
// Decode call and answers MoveSequence, which sends the KV. Moved: the
// stream ends OK and the router reads the target's from there. Not moved
// (no target, the handoff failed, no answer within move_wait): the
// sequence resumes here, or on a draining worker ends UNAVAILABLE so
// that the router replays it elsewhere.
//
// Thread safety: thread-safe (gRPC's callback threads, the engine's thread,
// the KV receiver's thread and the service's timer thread).
#ifndef PDSERVE_DECODE_WORKER_DECODE_SERVICE_H_
#define PDSERVE_DECODE_WORKER_DECODE_SERVICE_H_

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/deadline_timer.h"
#include "engine/engine.h"
#include "kv/kv_events.h"
#include "kv/kv_manager.h"
#include "kv_transfer/sender.h"
#include "model/model.h"
#include "grammar/constraint.h"
#include "text/tokenizer.h"
#include "decode_worker/handoff_table.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "proto/received.h"

namespace pdserve::decode {

struct DecodeServiceOptions {
  // Bounds on response formats (JSON Schema compiles and their masks).
  grammar::GrammarOptions grammar;
  engine::EngineOptions engine;
  bool allow_prefill = true;  // Colocated requests (prefill_here) accepted.
  // How long a Decode call waits for its handoff to be committed, and a
  // committed handoff for its Decode call.
  double handoff_wait_seconds = 30;
  // A stream whose write has been outstanding this long is cancelled.
  double stall_timeout_seconds = 10;
  // Tokens a stream may hold behind its outstanding write; one more
  // cancels it.
  int32_t max_buffered_tokens = 4096;
  // Benchmark stand-in: answer every Decode at once with max_tokens
  // one-token chunks (no model), to measure the router's relay alone.
  bool stand_in = false;
  // Fault tests only: the first N Decode streams (-1: every one) send their
  // second chunk with text that is not valid UTF-8 (it does not parse).
  int32_t fault_unparseable_streams = 0;
  // Fault tests only: the first N disaggregated Decode calls (-1: every
  // one) end CANCELLED at once and are never registered, as a call its
  // caller cancelled before this worker ran it: its handoff has no taker.
  int32_t fault_lose_decode_calls = 0;
  // Where moved sequences' KV goes out (reading this worker's pool; null:
  // no moves: pauses are refused, and a drain lets streams finish or
  // replay).
  kv::KvSender* mover = nullptr;
  // A paused sequence whose MoveSequence has not come within this is not
  // moved.
  double move_wait_seconds = 5;
  // Fault tests only: every sequence pauses for a move (as the rebalance
  // asks) once it has generated this many tokens (0: never); and each
  // move waits this long before its KV is sent.
  int32_t fault_move_at_token = 0;
  int32_t fault_stall_move_ms = 0;
};

// Sequences moved out of this worker, and a drain's by outcome.
struct MoveCounts {
  int64_t moved = 0;
  int64_t failed = 0;  // Paused, not moved (resumed, or ended for replay).
  int64_t drain_moved = 0;
  int64_t drain_replayed = 0;  // Left for the router to replay (not moved by the grace's end, or a move failed).
};

class DecodeCall;  // One Decode stream (decode_service.cc).

class DecodeService final : public worker::v1::DecodeWorker::CallbackService {
 public:
  // REQUIRES: model, kv and tokenizer outlive the service.
  DecodeService(Model* model, KvManager* kv, const tok::Tokenizer* tokenizer, DecodeServiceOptions options);
  // The response formats this worker compiled (for its metrics).
  const grammar::GrammarCache& grammars() const { return *grammars_; }
  ~DecodeService() override;

  // A committed handoff for `request_id` (from the KV receiver's thread):
  // it starts decoding if its Decode call is waiting, else waits up to
  // handoff_wait_seconds for it (then its KV is freed).
  void OnHandoffCommitted(const std::string& request_id, HandedOff seq);

  grpc::ServerWriteReactor<worker::v1::DecodeEvent>* Decode(grpc::CallbackServerContext* ctx,
                                                           const worker::v1::DecodeRequest* req) override;
  // The router is done with a request id here (its Decode call ended
  // without a final message): an unclaimed handoff is freed now, one still
  // on its way on arrival, and a Decode call that comes later is refused.
  // For a call its caller cancelled before this worker ever ran it, the
  // only word that the handoff has no taker.
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const worker::v1::ReleaseRequest* req,
                                    worker::v1::ReleaseResponse* out) override;
  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* ctx, const worker::v1::WorkerStatusRequest* req,
                                   worker::v1::WorkerInfo* out) override;
  grpc::ServerUnaryReactor* PauseSequence(grpc::CallbackServerContext* ctx,
                                          const worker::v1::PauseSequenceRequest* req,
                                          worker::v1::PauseSequenceResponse* out) override;
  grpc::ServerUnaryReactor* MoveSequence(grpc::CallbackServerContext* ctx, const worker::v1::MoveSequenceRequest* req,
                                         worker::v1::MoveSequenceResponse* out) override;
  MoveCounts move_counts() const;

  bool healthy() const { return !stopped_.load() && !engine_.failed(); }
  bool draining() const { return draining_.load(); }
  // No Decode call, running or waiting sequence, or unclaimed handoff.
  bool idle();
  // The worker's health verdict ("" = serving), reported by Status.
  void set_unhealthy_reason(std::string why) {
    absl::MutexLock lock(&info_mu_);
    unhealthy_reason_ = std::move(why);
  }
  engine::EngineStats engine_stats() const { return engine_.stats(); }
  // The engine's error once its thread stopped on one (OK while it runs).
  absl::Status engine_failure() const { return engine_.failure(); }
  // Where prefill workers send KV (reported by Status); set before serving.
  void set_kv_address(std::string a) {
    absl::MutexLock lock(&info_mu_);
    kv_address_ = std::move(a);
  }
  absl::Duration handoff_wait() const { return absl::Seconds(options_.handoff_wait_seconds); }
  // Streams cancelled because their client stopped reading.
  int64_t stalled_streams() const { return stalled_streams_.load(); }
  // Stops the engine (running streams end with UNAVAILABLE).
  void Shutdown();
  // SIGTERM: new Decode calls get UNAVAILABLE (the router goes elsewhere)
  // and Status reports not healthy; running sequences move to other
  // workers one at a time, longest context first (with a mover); what
  // stays runs until `deadline`, after which it ends with UNAVAILABLE so
  // the router replays it elsewhere. Returns when no stream is left.
  void Drain(absl::Time deadline);

 private:
  friend class DecodeCall;
  // The call has its KV: replay the first token, then decode.
  void StartHandedOff(const std::shared_ptr<DecodeCall>& call, HandedOff seq);
  void Forget(DecodeCall* call);
  // A sequence out of the engine for a move, waiting for its MoveSequence.
  struct Paused {
    std::shared_ptr<DecodeCall> call;
    std::shared_ptr<engine::Request> request;
    std::string reason;
    uint64_t serial = 0;  // Tells this pause's wait from a later one's.
  };
  // Asks the engine to pause `call`'s sequence for a move; false when
  // there is nothing to pause (no mover, no sequence, already pausing).
  bool RequestPause(const std::shared_ptr<DecodeCall>& call, const std::string& reason);
  // The engine's answer (its thread).
  void OnPaused(const std::shared_ptr<DecodeCall>& call, const std::shared_ptr<engine::Request>& r,
                const std::string& reason, bool out);
  // A pause whose MoveSequence did not come in time.
  void PauseTimedOut(const std::string& id, uint64_t serial);
  // A paused sequence that does not move: resumes (true), or, on a
  // draining worker or with its stream gone, ends (false).
  bool ResumeOrEnd(Paused p, const std::string& why);
  void RunMove(const worker::v1::MoveSequenceRequest& req, worker::v1::MoveSequenceResponse* out);
  void MoverLoop();
  // A draining worker's moves, one sequence at a time, until `deadline`.
  void MoveAllOut(absl::Time deadline);
  // The pause of `id` is over (moved or not); a drain waits for this.
  void Settle(const std::string& id, bool moved) ABSL_EXCLUSIVE_LOCKS_REQUIRED(move_mu_);
  // Asks the writer thread to start `call`'s next write (or its finish).
  void Kick(std::shared_ptr<DecodeCall> call);
  void WriterLoop();

  Model* model_;
  KvManager* kv_;
  const tok::Tokenizer* tokenizer_;
  // Response formats this worker has compiled (its vocabulary made on first use).
  std::unique_ptr<grammar::GrammarCache> grammars_;
  const DecodeServiceOptions options_;
  rpc::UnparseableFault fault_unparseable_{options_.fault_unparseable_streams};
  rpc::UnparseableFault fault_lose_call_{options_.fault_lose_decode_calls};  // Counts the same way.
  // What the prefix cache holds (committed handoffs' prompts, finished
  // local sequences), for the router; Status carries it.
  KvEventLog kv_events_;
  std::unique_ptr<TieredListener> tiered_events_;  // With a second tier: both tiers into kv_events_.
  engine::Engine engine_;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<bool> stopped_{false};
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> stalled_streams_{0};

  absl::Mutex calls_mu_;
  // Every call from Decode to OnDone, by its address.
  absl::flat_hash_map<const DecodeCall*, std::shared_ptr<DecodeCall>> calls_ ABSL_GUARDED_BY(calls_mu_);

  // Before the table: its deadlines run here, and it stops (Shutdown)
  // before the table goes.
  ThreadTimer timer_{"decode-timer"};
  HandoffTable handoffs_;
  std::atomic<bool> shut_down_{false};

  absl::Mutex info_mu_;
  std::string kv_address_ ABSL_GUARDED_BY(info_mu_);
  std::string unhealthy_reason_ ABSL_GUARDED_BY(info_mu_);

  // The engine's thread hands calls with something to write to this thread,
  // which starts the writes: a step never waits for a socket.
  absl::Mutex writer_mu_;
  std::vector<std::shared_ptr<DecodeCall>> kicks_ ABSL_GUARDED_BY(writer_mu_);
  bool stop_writer_ ABSL_GUARDED_BY(writer_mu_) = false;
  std::thread writer_thread_;

  mutable absl::Mutex move_mu_;
  absl::flat_hash_map<std::string, Paused> paused_ ABSL_GUARDED_BY(move_mu_);
  absl::flat_hash_set<std::string> pausing_ ABSL_GUARDED_BY(move_mu_);  // Asked of the engine.
  // While draining: pauses that are over, and whether they moved.
  absl::flat_hash_map<std::string, bool> settled_ ABSL_GUARDED_BY(move_mu_);
  uint64_t next_pause_ ABSL_GUARDED_BY(move_mu_) = 0;
  MoveCounts move_counts_ ABSL_GUARDED_BY(move_mu_);
  struct MoveJob {
    const worker::v1::MoveSequenceRequest* req = nullptr;
    worker::v1::MoveSequenceResponse* out = nullptr;
    grpc::ServerUnaryReactor* reactor = nullptr;
  };
  std::deque<MoveJob> move_jobs_ ABSL_GUARDED_BY(move_mu_);
  bool stop_mover_ ABSL_GUARDED_BY(move_mu_) = false;
  // Sends moves one at a time (each blocks on its handoff).
  std::thread mover_thread_;
  kv::ReceiverConnections move_connections_{options_.mover};  // The mover thread's.
};

}  // namespace pdserve::decode

#endif  // PDSERVE_DECODE_WORKER_DECODE_SERVICE_H_
