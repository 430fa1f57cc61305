// The decode worker's gRPC service: an engine (common/engine) on its own
// thread, fed by Decode calls (colocated: prefill here; disaggregated: a committed KV
// handoff for the request), streaming each token to the caller as the
// engine produces it.
//
// Thread safety: thread-safe (gRPC calls run on gRPC's threads; the engine
// on its own).
#ifndef PDSERVE_DECODE_WORKER_DECODE_SERVICE_H_
#define PDSERVE_DECODE_WORKER_DECODE_SERVICE_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/kv_manager.h"
#include "common/kv_events.h"
#include "common/model.h"
#include "common/tokenizer/tokenizer.h"
#include "common/engine/engine.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "proto/received.h"

namespace pdserve::decode {

struct DecodeServiceOptions {
  engine::EngineOptions engine;
  bool allow_prefill = true;  // Colocated requests (prefill_here) accepted.
  // How long a Decode call waits for its handoff to be committed.
  double handoff_wait_seconds = 30;
  // Benchmark stand-in: answer every Decode at once with max_tokens
  // one-token chunks (no model), to measure the router's relay alone.
  bool stand_in = false;
  // Fault tests only: the first N Decode streams (-1: every one) send their
  // second chunk with text that is not valid UTF-8 (it does not parse).
  int32_t fault_unparseable_streams = 0;
};

// A sequence whose KV arrived by handoff (see kv_transfer), waiting for (or
// claimed by) its Decode call.
struct HandedOff {
  SequenceKv kv;
  TokenEvent first;  // Sampled by the prefill worker.
  absl::Time arrived;
};

class DecodeService final : public worker::v1::DecodeWorker::Service {
 public:
  // REQUIRES: model, kv and tokenizer outlive the service.
  DecodeService(Model* model, KvManager* kv, const tok::Tokenizer* tokenizer, DecodeServiceOptions options);
  ~DecodeService() override;

  // A committed handoff for `request_id` (from the KV receiver's thread).
  // If no Decode call claims it within handoff_wait_seconds its KV is freed.
  void OnHandoffCommitted(const std::string& request_id, HandedOff seq);

  grpc::Status Decode(grpc::ServerContext* ctx, const worker::v1::DecodeRequest* req,
                      grpc::ServerWriter<worker::v1::DecodeEvent>* writer) override;
  grpc::Status Status(grpc::ServerContext* ctx, const worker::v1::WorkerStatusRequest* req,
                      worker::v1::WorkerInfo* out) override;

  bool healthy() const { return !stopped_.load() && !engine_.failed(); }
  bool draining() const { return draining_.load(); }
  // No Decode call, running or waiting sequence, or unclaimed handoff.
  bool idle();
  // The worker's health verdict ("" = serving), reported by Status.
  void set_unhealthy_reason(std::string why) {
    absl::MutexLock lock(&handoff_mu_);
    unhealthy_reason_ = std::move(why);
  }
  engine::EngineStats engine_stats() const { return engine_.stats(); }
  // Where prefill workers send KV (reported by Status); set before serving.
  void set_kv_address(std::string a) {
    absl::MutexLock lock(&handoff_mu_);
    kv_address_ = std::move(a);
  }
  // Stops the engine (pending calls end with UNAVAILABLE).
  void Shutdown();
  // SIGTERM: new Decode calls get UNAVAILABLE (the router goes elsewhere)
  // and Status reports not healthy; running streams finish until
  // `deadline`, after which they end with UNAVAILABLE so the router
  // migrates them. Returns when no stream is left.
  void Drain(absl::Time deadline);

 private:
  void SweepLoop();

  Model* model_;
  KvManager* kv_;
  const tok::Tokenizer* tokenizer_;
  const DecodeServiceOptions options_;
  rpc::UnparseableFault fault_unparseable_{options_.fault_unparseable_streams};
  // What the prefix cache holds (committed handoffs' prompts, finished
  // local sequences), for the router; Status carries it.
  KvEventLog kv_events_;
  engine::Engine engine_;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<bool> stopped_{false};
  std::atomic<bool> draining_{false};
  std::atomic<bool> evict_{false};   // Drain deadline passed: end streams.
  std::atomic<int32_t> active_calls_{0};

  absl::Mutex sweep_mu_;
  bool stop_sweeping_ ABSL_GUARDED_BY(sweep_mu_) = false;

  absl::Mutex handoff_mu_;
  absl::flat_hash_map<std::string, HandedOff> committed_ ABSL_GUARDED_BY(handoff_mu_);
  // Ids whose handoff a Decode call took, for a while: a second commit for
  // one (a retried prefill whose first attempt had committed) is freed.
  absl::flat_hash_map<std::string, absl::Time> claimed_ ABSL_GUARDED_BY(handoff_mu_);
  // Frees commits no Decode call claimed in time, forgets old claims.
  void SweepHandoffs();
  std::string kv_address_ ABSL_GUARDED_BY(handoff_mu_);
  std::string unhealthy_reason_ ABSL_GUARDED_BY(handoff_mu_);

  std::thread sweep_thread_;
};

}  // namespace pdserve::decode

#endif  // PDSERVE_DECODE_WORKER_DECODE_SERVICE_H_
