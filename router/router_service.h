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
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/container/flat_hash_map.h"
#include "common/block_hash.h"
#include "common/dtype.h"
#include "common/generation.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "router/discovery.h"
#include "router/admission.h"
#include "router/measured.h"
#include "router/prefix_index.h"
#include "router/selection.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "pdserve/v1/worker.grpc.pb.h"

namespace pdserve::router {

struct RouterOptions {
  std::string model_dir;
  std::string model_name;  // Reported by ListModels; requests may name it.
  // Worker targets (see router/discovery.h): host:port, or a DNS name whose
  // addresses are the pool (dns:///name:port, dns://SERVER/name:port),
  // resolved again every resolve_interval.
  std::vector<std::string> prefill_workers;
  std::vector<std::string> decode_workers;
  // Send whole requests to decode workers (no prefill pool, no handoff).
  bool colocated = false;
  absl::Duration resolve_interval = absl::Seconds(5);
  absl::Duration resolve_timeout = absl::Seconds(2);
  // Status probes of each worker; one that fails is retried with
  // exponential backoff from probe_period up to max_backoff.
  absl::Duration probe_period = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  // How long a request waits for a pool with no usable worker before it
  // ends with UNAVAILABLE (capped by the client's deadline).
  absl::Duration pick_wait = absl::Seconds(3);
  // Admission control (router/admission.h); none: every valid request is
  // taken. A ticket is held from arrival to the first token.
  std::optional<AdmissionOptions> admission;
  // Selection policies (router/selection.h): prefix_aware, least_loaded or
  // round_robin.
  std::string prefill_policy = "prefix_aware";
  std::string decode_policy = "prefix_aware";
  // A decode worker has batch headroom while it runs fewer than its max
  // batch and, with a target set, its measured step time is under it.
  absl::Duration itl_target = absl::ZeroDuration();
  // Conditional disaggregation: a request whose context the chosen decode
  // worker lacks at most this many positions of (and that has headroom)
  // is prefilled there, with no prefill worker and no handoff. 0: off.
  int64_t local_prefill_max_tokens = 0;
  // How long a routed prompt's blocks count as cached on the chosen worker
  // before its own KV events confirm them.
  absl::Duration prefix_expect = absl::Seconds(10);
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

  // Resolves the targets and probes the workers until every one answers
  // (decode workers also report their KV address), or, once each pool has
  // one that does, for at most two more seconds. Errors: UNAVAILABLE naming
  // the pool with no live worker and the silent addresses.
  absl::Status WaitForWorkers(absl::Duration timeout);

  const MetricsRegistry& metrics() const { return metrics_; }

 private:
  // How a worker hashes its KV blocks (block_hash.h): prompts hashed the
  // same way match its index.
  struct HashScheme {
    ModelIdentity model;
    DType kv_dtype = DType::kF32;
    int32_t block_size = 0;
    friend bool operator==(const HashScheme& a, const HashScheme& b) {
      return a.model == b.model && a.kv_dtype == b.kv_dtype && a.block_size == b.block_size;
    }
  };
  struct Worker {
    std::string address;
    bool prefill_role = false;
    std::shared_ptr<grpc::Channel> channel;
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
    // False until the first probe answers healthy.
    std::atomic<bool> healthy{false};
    std::atomic<int64_t> free_positions{-1};  // -1: not known yet.
    std::atomic<int64_t> kv_bytes_per_position{0};
    std::atomic<int32_t> max_batch{0};
    std::atomic<int32_t> running{0};          // Decode: sequences running.
    std::atomic<double> step_seconds{0};      // Decode: its average step time.
    // How the worker hashes KV blocks (from Status; none before the first
    // answer): the router hashes prompts the same way to match its index.
    std::optional<HashScheme> prefix_hash() const {
      absl::MutexLock lock(&kv_mu);
      return prefix_hash_;
    }
    std::optional<HashScheme> prefix_hash_ ABSL_GUARDED_BY(kv_mu);
    // The worker process's instance id (0: never answered); a new one means
    // it restarted.
    std::atomic<uint64_t> instance{0};
    // No longer named by its target (DNS): picked no more; requests that
    // hold it finish.
    std::atomic<bool> removed{false};
    // Why the last probe found it not serving ("" when serving), for the
    // errors of requests that found no worker.
    std::string ejection_reason() const {
      absl::MutexLock lock(&kv_mu);
      return ejection_reason_;
    }
    std::string ejection_reason_ ABSL_GUARDED_BY(kv_mu);
    // Poller thread only.
    int failures = 0;
    absl::Time next_probe = absl::InfinitePast();
    std::string last_reason;
    int64_t last_steps = 0;  // Decode steps seen at the last probe.
  };
  using WorkerPtr = std::shared_ptr<Worker>;
  // A worker a request gave up on, in the incarnation it failed in: once it
  // restarts (a new instance id) the request may use it again.
  struct Failed {
    const Worker* worker;  // Compared, never followed: it may be gone.
    uint64_t instance;
    std::string address;
    std::string error = {};  // Why it failed the request (its handoff, its stream).
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
  // A request's context hashed per worker hashing scheme (usually one),
  // computed on first use.
  class PromptChains {
   public:
    explicit PromptChains(absl::Span<const int32_t> context) : context_(context) {}
    // The chain a worker hashing with `scheme` would find; empty without one.
    absl::Span<const BlockHash> For(const std::optional<HashScheme>& scheme);
    int64_t size() const { return static_cast<int64_t>(context_.size()); }

   private:
    absl::Span<const int32_t> context_;
    std::vector<std::pair<HashScheme, std::vector<BlockHash>>> chains_;
  };
  // Positions of the context `w` holds in its prefix cache, as the router's
  // index sees it (never the last one: it is always computed).
  int64_t CachedTokens(const Worker& w, PromptChains& chains);
  // A healthy decode worker with free KV for `positions`, chosen by the
  // decode policy; if none has room, the one with the most free KV.
  WorkerPtr PickDecode(int64_t positions, const std::vector<Failed>& exclude, PromptChains& chains);
  WorkerPtr PickPrefill(const std::vector<Failed>& exclude, PromptChains& chains);
  // `w` as a prefill candidate for the context: its queue, what it caches
  // of the context, and its measured speed.
  SelectionCandidate PrefillCandidate(const Worker& w, PromptChains& chains);
  bool HasHeadroom(const Worker& w) const;
  // Pick, waiting up to pick_wait (and the client's deadline) while the
  // pool has no usable worker; null if none came or the client went away.
  WorkerPtr PickWaiting(grpc::ServerContext* ctx, const std::function<WorkerPtr()>& pick);
  static bool Excluded(const Worker& w, const std::vector<Failed>& exclude);
  // "no healthy decode worker (ADDRESS: why it is not serving; ...)".
  std::string NoHealthyWorker(bool prefill);
  std::vector<WorkerPtr> Snapshot(bool prefill);
  // Resolves every target of both pools; adds new addresses, removes gone
  // ones. A target that fails to resolve keeps its previous addresses.
  void Discover();
  // One Status call to a worker.
  struct StatusCall {
    WorkerPtr worker;
    grpc::ClientContext ctx;
    worker::v1::WorkerStatusRequest req;
    worker::v1::WorkerInfo info;
    grpc::Status status;
  };
  // Runs every call at once and returns when all have answered or failed
  // (set each one's deadline first).
  static void StatusAll(std::vector<std::unique_ptr<StatusCall>>& calls);
  // One round of Status probes (those due), concurrently; updates health,
  // KV address, free KV and instance, with backoff for failures.
  void ProbeDue(bool force_all);
  void PollLoop();
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
  Counter* ejections_[2] = {nullptr, nullptr};  // By prefill_role.
  // What the router observes of each stage (issue 11: shown by
  // ClusterStatus, not yet used to place or admit requests).
  MeasuredInputs measured_;
  std::unique_ptr<AdmissionController> admission_;
  std::unique_ptr<Selector> prefill_selector_;
  std::unique_ptr<Selector> decode_selector_;
  // Every worker's prefix cache, from the KV events in its Status answers.
  PrefixIndex prefix_index_;
  Counter* placement_[3] = {nullptr, nullptr, nullptr};  // prefill_pool, decode_local, colocated
  Counter* prompt_tokens_ = nullptr;
  Counter* cached_tokens_ = nullptr;
  absl::Time next_load_update_ = absl::InfinitePast();  // Poller only.
  // The capacities from the measurements and the pools now.
  MeasuredCapacity CurrentCapacity();
  ModelConfig config_;
  std::unique_ptr<tok::Tokenizer> tokenizer_;
  std::optional<tok::ChatFormat> chat_format_;
  std::vector<WorkerTarget> prefill_targets_;
  std::vector<WorkerTarget> decode_targets_;
  absl::Mutex workers_mu_;
  std::vector<WorkerPtr> prefill_ ABSL_GUARDED_BY(workers_mu_);
  std::vector<WorkerPtr> decode_ ABSL_GUARDED_BY(workers_mu_);
  // Per target, its addresses at the last successful resolve (discovery
  // thread only, or WaitForWorkers before it starts).
  absl::flat_hash_map<std::string, std::vector<std::string>> resolved_;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<uint64_t> next_request_{1};

  absl::Mutex watch_mu_;
  std::vector<Watch*> watches_ ABSL_GUARDED_BY(watch_mu_);
  bool stop_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread watcher_;
  std::thread poller_;
  // Resolves the targets every resolve_interval, on its own thread so a
  // slow name server never delays the health probes.
  std::thread discoverer_;
  void DiscoverLoop();
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_ROUTER_SERVICE_H_
