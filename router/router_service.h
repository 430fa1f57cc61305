// The router: the client-facing pdserve.v1.Generation service.
//
// Per request it resolves the prompt to ids once (text, chat template or
// ids), checks it, resolves sampling defaults and the seed, picks a decode
// worker (fewest sequences in flight) and, unless the request runs
// colocated, a prefill worker (fewest queued prefill tokens), then relays:
// the first token as soon as the prefill worker samples it, the rest from
// the decode worker. The router's own replay of the first token gives its
// text, so the streamed text equals the in-process engine's byte for byte.
// Client cancellation and deadlines are carried to every downstream call.
//
// Thread safety: thread-safe.
#ifndef PDSERVE_ROUTER_ROUTER_SERVICE_H_
#define PDSERVE_ROUTER_ROUTER_SERVICE_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/container/flat_hash_map.h"
#include "common/generation.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "pdserve/v1/worker.grpc.pb.h"

namespace pdserve::router {

struct RouterOptions {
  std::string model_dir;
  std::string model_name;  // Reported by ListModels; requests may name it.
  std::vector<std::string> prefill_workers;  // host:port
  std::vector<std::string> decode_workers;
  // Send whole requests to decode workers (no prefill pool, no handoff).
  bool colocated = false;
};

class RouterService final : public v1::Generation::Service {
 public:
  static absl::StatusOr<std::unique_ptr<RouterService>> Create(RouterOptions options);
  ~RouterService() override;

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Complete(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        v1::CompleteResponse* out) override;
  grpc::Status ListModels(grpc::ServerContext* ctx, const v1::ListModelsRequest* req,
                          v1::ListModelsResponse* out) override;
  grpc::Status ClusterStatus(grpc::ServerContext* ctx, const v1::ClusterStatusRequest* req,
                             v1::ClusterStatusResponse* out) override;

  // Waits until every worker answers Status (decode workers also report
  // their KV address). Errors: UNAVAILABLE naming the workers still silent.
  absl::Status WaitForWorkers(absl::Duration timeout);

  const MetricsRegistry& metrics() const { return metrics_; }

 private:
  struct Worker {
    std::string address;
    std::unique_ptr<worker::v1::PrefillWorker::Stub> prefill;
    std::unique_ptr<worker::v1::DecodeWorker::Stub> decode;
    // Where its KV receiver listens; it changes when the worker restarts,
    // so the status poll refreshes it.
    std::string kv_address() const {
      absl::MutexLock lock(&kv_mu);
      return kv_address_;
    }
    void set_kv_address(std::string a) {
      absl::MutexLock lock(&kv_mu);
      kv_address_ = std::move(a);
    }
    mutable absl::Mutex kv_mu;
    std::string kv_address_ ABSL_GUARDED_BY(kv_mu);
    std::atomic<int32_t> in_flight{0};
    std::atomic<int64_t> queued_tokens{0};
    // From the worker's Status, refreshed every poll period.
    std::atomic<bool> healthy{true};
    std::atomic<int64_t> free_positions{-1};  // -1: not known yet.
  };
  // Downstream calls of one request, cancelled with it.
  struct Watch {
    grpc::ServerContext* server;
    std::vector<grpc::ClientContext*> clients;
  };

  explicit RouterService(RouterOptions options);
  // Validated engine request from the client's message (INVALID_ARGUMENT
  // naming the field otherwise).
  absl::StatusOr<GenerationRequest> Resolve(const v1::GenerateRequest& req) const;
  // Runs the request; `emit` gets every response message (false: stop).
  grpc::Status Run(grpc::ServerContext* ctx, const v1::GenerateRequest& req,
                   const std::function<bool(const v1::GenerateResponse&)>& emit);
  // A healthy decode worker with free KV for `positions` (fewest in flight
  // among them); if none has room, the one with the most free KV.
  Worker* PickDecode(int64_t positions, const std::vector<Worker*>& exclude);
  void PollLoop();
  Worker* PickPrefill(const std::vector<Worker*>& exclude);
  void WatchLoop();

  void RegisterMetrics();
  void CountOutcome(const char* outcome);

  RouterOptions options_;
  MetricsRegistry metrics_;
  absl::flat_hash_map<std::string, Counter*> outcomes_;
  Histogram* ttft_ = nullptr;
  Histogram* itl_ = nullptr;
  Histogram* e2e_ = nullptr;
  Histogram* queue_ = nullptr;
  Histogram* prefill_time_ = nullptr;
  Histogram* handoff_ = nullptr;
  Counter* retries_ = nullptr;
  Counter* migrations_ = nullptr;
  ModelConfig config_;
  std::unique_ptr<tok::Tokenizer> tokenizer_;
  std::optional<tok::ChatFormat> chat_format_;
  std::vector<std::unique_ptr<Worker>> prefill_;
  std::vector<std::unique_ptr<Worker>> decode_;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<uint64_t> next_request_{1};

  absl::Mutex watch_mu_;
  std::vector<Watch*> watches_ ABSL_GUARDED_BY(watch_mu_);
  bool stop_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread watcher_;
  std::thread poller_;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_ROUTER_SERVICE_H_
