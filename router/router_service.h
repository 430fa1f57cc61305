// The router: the client-facing pdserve.v1.Generation service, a thin
// adapter over the parts that do the work:
//
//   resolve.h      the client's request as the engine's (prompt ids,
//                  checked sampling parameters, the seed);
//   worker_pool.h  the workers: discovery, probes, KV-event ingestion;
//   placement.h    where a request runs (decides only);
//   request_queue.h  where it waits until a decode worker has KV room for
//                  it (decode_room.h: the router's ledger of that room);
//   admission.h    whether it is taken now, for the placement it gets;
//   relay.h        one request's attempts as a state machine: prefill,
//                  handoff, decode stream, retry, migration, finish;
//   grpc_transport.h  the calls to workers.
//
// The service turns gRPC calls into relays, carries a client's
// cancellation to the relay, and answers ListModels and ClusterStatus.
// Generate and Complete use gRPC's callback API: each generation runs its
// relay on a thread of its own (the relay blocks on its worker calls, and
// a reactor's callbacks must not), and the client's cancel arrives as the
// reactor's OnCancel, which ends the relay's calls at once.
// With API keys on, every call needs a valid key (UNAUTHENTICATED, counted,
// without one), ClusterStatus included: it shows the workers' addresses
// and failures, and calls every worker.
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

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/metrics.h"
#include "base/tls.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "grammar/constraint.h"
#include "router/admission.h"
#include "router/api_keys.h"
#include "router/client_cancel.h"
#include "router/measured.h"
#include "router/openai/request.h"
#include "router/openai/server.h"
#include "router/placement.h"
#include "router/prefix_index.h"
#include "router/rebalance.h"
#include "router/relay.h"
#include "router/resolve.h"
#include "router/running_sequences.h"
#include "router/transport.h"
#include "router/worker_pool.h"

namespace pdserve::router {

// Which requests share prefix-cache blocks (kv/block_hash.h): all of
// them, or only those under the same API key (each key's hash chains are
// salted with CacheSaltForKey of its id).
enum class PrefixCacheScope { kShared, kPerKey };

struct RouterOptions {
  std::string model_dir;
  std::string model_name;  // Reported by ListModels; requests may name it.
  // Bounds on response formats the router compiles (and refuses past).
  grammar::GrammarOptions grammar;
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
  // Sequences a decode worker pauses to move (its drain, the rebalance)
  // go to another decode worker with their KV (router/relay.h).
  bool decode_moves = true;
  absl::Duration move_timeout = absl::Seconds(10);
  // The rebalance (router/rebalance.h): every period the router looks
  // at the decode workers' reports and may ask a hot one to move a
  // sequence to a peer. None: off (or without decode_moves).
  std::optional<RebalanceOptions> rebalance = RebalanceOptions{};
  absl::Duration rebalance_period = absl::Seconds(1);
  // The longest a request may run: its calls to the workers carry a
  // deadline this far from its arrival even when the client gave none.
  absl::Duration max_request_duration = absl::Seconds(600);
  // The queue for decode KV room (router/request_queue.h); none, or
  // colocated (each worker's engine queues and preempts itself): requests
  // are placed at once by the workers' reports alone.
  std::optional<RequestQueueOptions> queue = RequestQueueOptions{};
  // How long a worker whose probes time out keeps serving in the router's
  // view while it shows no progress (router/worker_pool.h).
  absl::Duration probe_stall = absl::Seconds(10);
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
  // Prefix pulls between prefill workers (PlacementOptions::
  // pull_min_tokens, pull_overhead, pull_always).
  int64_t pull_min_tokens = 64;
  absl::Duration pull_overhead = absl::Milliseconds(2);
  bool pull_always = false;
  // How long a routed prompt's blocks count as cached on the chosen worker
  // before its own KV events confirm them.
  absl::Duration prefix_expect = absl::Seconds(10);
  // Handoff grants (kv_transfer/grant.h): with a key, every prefill attempt
  // carries a grant for its decode worker, valid for grant_ttl.
  std::shared_ptr<const kv::GrantKey> grant_key;
  absl::Duration grant_ttl = absl::Seconds(120);
  // pdserve_recommended_workers is exposed once its inputs have this many
  // samples each.
  int64_t autoscale_min_samples = 20;
  // Complete (a reply sent whole, held until its last token): a request
  // whose max_tokens x (1 + logprobs) passes this is refused with
  // INVALID_ARGUMENT naming max_tokens. Generate's streams are not bounded so.
  int64_t max_reply_entries = openai::kDefaultMaxReplyEntries;
  // Over gRPC, a request's cache salt: zero (shared), or its key's.
  PrefixCacheScope prefix_cache_scope = PrefixCacheScope::kShared;
  // API keys (router/api_keys.h): "" accepts every client.
  std::string api_keys_file;
  // The router's certificate and the cluster CA, presented to the workers
  // (mutual TLS); none: plaintext to the workers.
  TlsFiles tls;
};

// Generate and Complete are callback methods; the rest are synchronous.
using GenerationServiceBase =
    v1::Generation::WithCallbackMethod_Generate<v1::Generation::WithCallbackMethod_Complete<v1::Generation::Service>>;

class RouterService final : public GenerationServiceBase {
 public:
  static absl::StatusOr<std::unique_ptr<RouterService>> Create(RouterOptions options);
  ~RouterService() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                           const v1::GenerateRequest* req) override;
  grpc::ServerUnaryReactor* Complete(grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req,
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

  // OK when a request can be placed now: a decode worker serves and, unless
  // colocated, a prefill worker too. Else UNAVAILABLE saying which pool.
  absl::Status Ready();
  // The key id for an "authorization" value ("Bearer KEY"; "" when keys
  // are off), or UNAUTHENTICATED (counted, and logged by key id only).
  absl::StatusOr<std::string> CheckKey(absl::string_view authorization, absl::string_view peer);
  // CheckKey, then the key's limits for one generation (api_keys.h): the
  // lease is held until the generation ends. RESOURCE_EXHAUSTED over a
  // limit (counted as "key_limited", and per key id).
  absl::StatusOr<KeyLease> AdmitKey(absl::string_view authorization, absl::string_view peer);
  // What the HTTP API (router/openai/server.h) needs; valid while this lives.
  openai::HttpBackend HttpBackend();

  const MetricsRegistry& metrics() const { return metrics_; }

 private:
  class StreamedCall;
  class WholeCall;

  explicit RouterService(RouterOptions options);
  // OK when keys are off or the client's "authorization" metadata holds a
  // valid key; else UNAUTHENTICATED (counted, and logged by key id only).
  grpc::Status Authenticate(grpc::ServerContextBase* ctx);
  // How a reply goes back: streamed as it goes, or held whole to the end
  // (then bounded by options_.max_reply_entries).
  enum class Reply { kStreamed, kWhole };
  // Runs the request on the calling thread; `emit` gets every response
  // message (false: stop), and `cancel` carries the client's cancel to the
  // relay while it runs.
  grpc::Status Run(grpc::ServerContextBase* ctx, const v1::GenerateRequest& req, Reply reply,
                   const std::function<bool(const v1::GenerateResponse&)>& emit, ClientCancel* cancel);
  void RegisterMetrics();
  // The capacities from the measurements and the pools now.
  MeasuredCapacity CurrentCapacity();
  // The rebalance's thread: a look at the decode pool every period.
  void RebalanceLoop();

  RouterOptions options_;
  MetricsRegistry metrics_;
  std::unique_ptr<RelayMetrics> relay_metrics_;
  std::unique_ptr<RequestResolver> resolver_;
  std::unique_ptr<ApiKeys> api_keys_;  // null: keys off
  // pdserve_api_key_requests_total{key, outcome}, made as keys are seen.
  absl::Mutex key_metrics_mu_;
  absl::flat_hash_map<std::string, Counter*> key_metrics_ ABSL_GUARDED_BY(key_metrics_mu_);
  void CountKey(const std::string& id, const char* outcome);
  // What the router observes of each stage (measured.h).
  MeasuredInputs measured_;
  // Every worker's prefix cache, from the KV events in its Status answers.
  PrefixIndex prefix_index_;
  std::unique_ptr<WorkerTransport> transport_;
  std::unique_ptr<AdmissionController> admission_;
  DecodeRoom room_;
  std::unique_ptr<RequestQueue> queue_;
  Counter* ejections_[2] = {nullptr, nullptr};  // prefill, decode
  absl::Time next_load_update_ = absl::InfinitePast();  // probe thread only
  // Declared after what its threads use: destroyed (and stopped) first.
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<Placement> placement_;
  RelayContext relay_context_;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<uint64_t> next_request_{1};
  RunningSequences running_;
  absl::Mutex rebalance_mu_;
  bool stop_rebalance_ ABSL_GUARDED_BY(rebalance_mu_) = false;
  std::thread rebalance_thread_;  // Last: stopped first.
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_ROUTER_SERVICE_H_
