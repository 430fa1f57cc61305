// The engine flags both worker binaries take (--model, --threads, --weights,
// --kv, --block_size, --kv_positions), defined once, and the engine +
// tokenizer they load, the KV transport, the health check and the pool's
// metrics: what both worker binaries run on. Linked by the workers only
// (pdctl has its own flags).
#ifndef PDSERVE_RUNTIME_WORKER_RUNTIME_H_
#define PDSERVE_RUNTIME_WORKER_RUNTIME_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "base/grpc_server.h"
#include "base/metrics.h"
#include "base/tls.h"
#include "kv/kv_manager.h"
#include "grammar/constraint.h"
#include "text/tokenizer.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/self_check.h"
#include "kv_transfer/tcp_transport.h"
#include "kv_transfer/ucx_transport.h"
#include "engine/engine.h"
#include "engine/model_stack.h"
#include "kv/tier2_store.h"

namespace pdserve {

struct WorkerModel {
  ModelStack engine;
  std::unique_ptr<tok::Tokenizer> tokenizer;
  // --kv_tier2_dir: the prefix cache's second tier (null: none). After
  // `engine`, so it goes first: its last writes still read the pool.
  std::unique_ptr<Tier2Store> tier2;
};

// What both workers run on: a KV transport (its thread and registered
// memory; --kv_transport), then the engine whose KV pool lives in that memory, and the
// transport's self-check once the worker knows where to run it
// (CheckWorkerTransport). Members are destroyed in reverse: the check,
// the engine, the transport last, as the pool requires.
struct WorkerRuntime {
  // --tls_* (base/tls_flags.h): the worker's certificate; none with
  // --insecure.
  TlsFiles tls;
  // --kv_transport: TcpTransport, or UcxTransport (then also `ucx`).
  std::unique_ptr<kv::Transport> transport;
  kv::UcxTransport* ucx = nullptr;
  WorkerModel engine;
  // --fault_leak_kv_blocks: blocks held by nobody's work (given back
  // before the engine goes).
  SequenceKv leaked_kv;
  std::unique_ptr<kv::TransportSelfCheck> transport_check;
};

// Checks the TLS flags (a worker's peer must be a router), starts the
// transport and loads what the flags name, logging any error.
// Returns the process exit code on failure (2 for bad flags, 1 otherwise).
absl::StatusOr<WorkerRuntime> StartWorkerRuntime(const std::string& name, int* exit_code);

// Checks that the transport can carry a handoff over `host` (the decode
// worker: its KV listen address; "": an address UCX can connect over, for
// the prefill worker, which only connects out), before the worker serves,
// and re-checks while that fails (kv_transfer/self_check.h). A failure is
// logged and becomes the health verdict; the worker still serves Status.
void CheckWorkerTransport(WorkerRuntime& rt, const std::string& host);

// The worker's health check for ServeOptions::health: judges draining,
// the transport's self-check, KV leaks (--leak_grace_s) and a wedged
// transport (--wedge_after_s) from what the service reports, and publishes
// the verdict to it (for Status). REQUIRES: CheckWorkerTransport ran.
// The serving options every worker shares: its gRPC server's credentials
// (mutual TLS, callers must be routers) and the plaintext health port.
void ApplyWorkerServing(const WorkerRuntime& rt, ServeOptions& serve);

// `engine_failure`: the engine's error once its thread stopped on one (a
// failed forward, e.g. a tensor-parallel collective); it never heals.
// With `metrics`, the verdict is also exported as
// pdserve_worker_unhealthy{reason} (1 for the reason that holds now:
// draining, kv_self_check, kv_wedged, kv_leak, engine_failed; all 0 while
// serving), for alerts.
std::function<std::string()> WorkerHealthCheck(WorkerRuntime& rt,
                                               std::function<bool()> draining, std::function<bool()> idle,
                                               std::function<absl::Status()> engine_failure,
                                               std::function<void(std::string)> publish,
                                               MetricsRegistry* metrics = nullptr);

// The bound on a request's life from --request_life_base_s,
// --request_life_step_factor and --request_life_min_token_ms.
void ApplyRequestLifeFlags(engine::EngineOptions& options);

// The response-format bounds (--grammar_max_schema_bytes, --grammar_max_nodes,
// --grammar_max_depth, --grammar_mask_states, --grammar_mask_bytes,
// --grammar_cache_size).
grammar::GrammarOptions GrammarOptionsFromFlags();

// The pool's gauges pdserve_kv_blocks{state=used|free}, from the KV manager.
void AddKvPoolMetrics(MetricsRegistry& metrics, const KvManager* kv);

// pdserve_handoff_refusals_total{reason}: reservations and commits a KV
// receiver (a decode worker's handoffs, a prefill worker's pulls) refused
// for their grant, by reason.
void AddGrantRefusalMetrics(MetricsRegistry& metrics, const kv::KvReceiver* receiver);

// The second tier's gauges and counters (pdserve_kv_tier2_*, and
// pdserve_kv_checksum_failures_total{path="tier2"}), from its stats.
void AddKvTier2Metrics(MetricsRegistry& metrics, const Tier2Store* tier2);

}  // namespace pdserve

#endif  // PDSERVE_RUNTIME_WORKER_RUNTIME_H_
