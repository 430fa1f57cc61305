// pdserve-router: the client-facing pdserve.v1.Generation service.
//
//   pdserve-router --model DIR --prefill 127.0.0.1:7001 --decode 127.0.0.1:7002
//                  --listen 127.0.0.1:7000 [--colocated]
//   (with the OpenAI HTTP API on --http_listen, default 127.0.0.1:8000)
//   pdserve-router --model DIR --prefill dns:///prefill.pdserve:7001
//                  --decode dns://10.0.0.10/decode.pdserve:7002
//
// Flags may also come from a file: --flagfile=router.flags.
#include <sys/resource.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "base/server_util.h"
#include "base/grpc_server.h"
#include "base/tls_flags.h"
#include "kv_transfer/grant_flags.h"
#include "router/openai/server.h"
#include "router/router_service.h"

ABSL_FLAG(int64_t, grammar_max_schema_bytes, 64 << 10,
          "largest JSON Schema a response format may give, in bytes (refused past it)");
ABSL_FLAG(int64_t, grammar_max_nodes, 100000,
          "most grammar nodes a response format may compile to (about 60 bytes each; refused past it)");
ABSL_FLAG(int32_t, grammar_max_depth, 128, "deepest nesting a constrained output may reach, in grammar frames");
ABSL_FLAG(int32_t, grammar_cache_size, 64, "compiled response formats kept, by schema hash");
ABSL_FLAG(std::string, model, "", "model directory (tokenizer, config, chat template)");
ABSL_FLAG(std::string, model_name, "", "name clients may use (default: the directory's name)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC address (port 0: any free port)");
ABSL_FLAG(std::string, ready_file, "", "write {\"grpc_port\":..} here once serving");
ABSL_FLAG(std::vector<std::string>, prefill, {},
          "prefill workers: host:port, dns:///name:port or dns://SERVER[:PORT]/name:port (every address), comma-separated");
ABSL_FLAG(std::vector<std::string>, decode, {}, "decode workers, as --prefill");
ABSL_FLAG(double, resolve_interval_s, 5, "how often DNS worker targets are resolved again");
ABSL_FLAG(double, max_backoff_s, 2, "a worker that fails is probed again after 0.1 s, doubling up to this");
ABSL_FLAG(double, pick_wait_s, 3, "how long a request waits for a usable worker before UNAVAILABLE");
ABSL_FLAG(bool, decode_moves, true,
          "a sequence its decode worker pauses to move (drain, rebalance) goes to another decode worker with its KV "
          "(false: it resumes there, or a draining worker's is replayed elsewhere)");
ABSL_FLAG(double, move_timeout_s, 10, "the longest a move of a running sequence between decode workers may take");
ABSL_FLAG(bool, rebalance, true,
          "move running sequences off a decode worker whose step time or KV in use exceeds its coolest peer's by "
          "the margins below (with --decode_moves)");
ABSL_FLAG(double, rebalance_step_margin, 0.5, "rebalance: a step time this fraction above the coolest peer's is hot");
ABSL_FLAG(double, rebalance_kv_margin, 0.25,
          "rebalance: KV in use this fraction of the pool above the coolest peer's is hot");
ABSL_FLAG(double, rebalance_sustain_s, 3, "rebalance: a worker must stay hot this long before a sequence moves off it");
ABSL_FLAG(double, rebalance_window_s, 30,
          "rebalance: a sequence moves at most once within this, and a worker that received a move sheds none");
ABSL_FLAG(double, max_request_s, 600,
          "the longest a request may run: every call to a worker carries a deadline this far from when the request "
          "left the router's queue, also when the client gave none");
ABSL_FLAG(std::string, prefill_policy, "prefix_aware",
          "how a prefill worker is chosen: prefix_aware (lowest estimated TTFT: queued + uncached prompt tokens at "
          "the worker's measured speed), least_loaded or round_robin");
ABSL_FLAG(std::string, decode_policy, "prefix_aware",
          "how a decode worker is chosen: prefix_aware (batch headroom, then most of the context cached, then "
          "fewest in flight), least_loaded or round_robin");
ABSL_FLAG(double, itl_target_ms, 0,
          "a decode worker whose measured step time reaches this has no batch headroom (0: max batch only)");
ABSL_FLAG(int64_t, local_prefill_max_tokens, 0,
          "conditional disaggregation: prefill on the chosen decode worker when at most this many context "
          "tokens are not cached there and it has headroom (0: off)");
ABSL_FLAG(int64_t, prefix_pull_min_tokens, 64,
          "a prefill worker about to compute at least this many prompt positions that another prefill worker holds "
          "takes them from it instead, when the transfer is predicted faster than the compute (0: never)");
ABSL_FLAG(double, prefix_pull_overhead_ms, 2, "the fixed cost of a prefix pull in its prediction (round trips)");
ABSL_FLAG(bool, prefix_pull_always, false,
          "pull whenever another prefill worker holds at least --prefix_pull_min_tokens more positions, without "
          "predicting whether the transfer beats the compute");
ABSL_FLAG(double, prefix_expect_s, 10, "a routed prompt's blocks count as cached on its worker this long before "
          "the worker's KV events confirm them");
ABSL_FLAG(std::string, log_level, "info", "lowest level logged: debug (per-request routing cost terms), info, "
          "warning or error");
ABSL_FLAG(int64_t, max_queued_requests, 8192,
          "requests that wait at once in the router's queue for decode KV room (a request goes to a prefill worker "
          "only once a decode worker has room for its prompt + max_tokens); more are refused at once with "
          "RESOURCE_EXHAUSTED / HTTP 429 and a retry-after (0: refuse whatever finds no room)");
ABSL_FLAG(double, max_queue_wait_s, 60,
          "the longest a request waits in the router's queue; then it is refused with RESOURCE_EXHAUSTED / HTTP 429 "
          "and a retry-after, before any prefill work");
ABSL_FLAG(double, probe_stall_s, 10,
          "a worker whose status probes time out stays serving while it makes progress (messages on the router's "
          "requests); it is ejected when no probe has answered in time and it made no progress for this long");
ABSL_FLAG(bool, admission, false,
          "admission control: reject with RESOURCE_EXHAUSTED when the queue is full, the predicted TTFT misses "
          "the deadline or --ttft_target_ms, or arrivals exceed the bottleneck stage's measured capacity");
ABSL_FLAG(int64_t, max_queued, 256, "admission: most requests between arrival and first token");
ABSL_FLAG(double, ttft_target_ms, 0, "admission: reject requests predicted to exceed this TTFT (0: deadlines only)");
ABSL_FLAG(int64_t, admission_min_samples, 20, "admission: samples an input needs before the rate and TTFT rules use it");
ABSL_FLAG(int64_t, autoscale_min_samples, 20,
          "pdserve_recommended_workers{pool} (what autoscalers read) is absent until the pool's stage capacity and the "
          "arrival rate each rest on this many samples");
ABSL_FLAG(std::string, api_keys_file, "",
          "API keys, one ID:SHA256HEX line each (sha256 of the key), read again when the file changes; clients send "
          "'authorization: Bearer KEY' (gRPC metadata). Empty: no keys (every client accepted)");
ABSL_FLAG(bool, colocated, false, "send whole requests to decode workers (no handoff)");
ABSL_FLAG(double, kv_grant_ttl_s, 120,
          "how long a KV handoff grant stays valid (it must cover the prefill queue's wait before the reservation)");
ABSL_FLAG(double, worker_wait_s, 60, "how long to wait at start for every worker to answer");
ABSL_FLAG(std::string, http_listen, "127.0.0.1:8000",
          "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health) address, "
          "HOST:PORT or [V6]:PORT (port 0: any free; empty: off)");
ABSL_FLAG(int64_t, http_max_body_bytes, 8 << 20, "largest HTTP request body (larger: 413)");
ABSL_FLAG(int64_t, http_max_buffered_bytes, 4 << 20,
          "an HTTP stream with more unsent bytes than this (its client stopped reading) is cancelled");
ABSL_FLAG(int32_t, http_socket_send_buffer_bytes, 0,
          "SO_SNDBUF of each HTTP connection (0: the kernel's, autotuned up to net.ipv4.tcp_wmem)");
ABSL_FLAG(int64_t, max_reply_entries, pdserve::router::openai::kDefaultMaxReplyEntries,
          "a reply held whole until its last token (gRPC Complete, HTTP without stream): refuse a request whose "
          "max_tokens x (1 + logprobs) passes this many logprob entries (INVALID_ARGUMENT / 400 naming "
          "max_tokens; a chat without max_tokens counts the rest of the context); streams are not bounded so");
ABSL_FLAG(int32_t, http_max_connections, 4096,
          "open HTTP connections at most; more are closed on accept (the router raises its file limit to the hard "
          "limit at start, and this must stay under it)");
ABSL_FLAG(double, http_header_timeout, 10, "seconds a request's headers may take to arrive; then it is closed");
ABSL_FLAG(double, http_request_timeout, 60,
          "seconds a request's headers and body may take to arrive; then it is closed");
ABSL_FLAG(int64_t, http_body_budget_bytes, 64 << 20,
          "HTTP request bytes held at once across all connections (bodies being read, headers); a body that does "
          "not fit gets 503 with Retry-After before it is read");
ABSL_FLAG(int32_t, http_max_inflight, 4096,
          "HTTP generations at once, waiting in the router's queue or running; more get 503 with Retry-After");
ABSL_FLAG(std::string, prefix_cache_scope, "shared",
          "which requests share prefix-cache blocks: shared (all: a prompt prefix cached for one API key is reused "
          "for every other, the most reuse, but a client can tell from cached_tokens, and from its time to first "
          "token, whether another key recently sent the same prefix, block by block) or per_key (each key's block "
          "hashes are salted with its id: no key hits or detects another's blocks, and a prefix common to several "
          "keys, e.g. a shared system prompt, is computed and held once per key: more prefill work, more KV "
          "memory, fewer hits). With keys off every request is one key");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0", "Prometheus /metrics address (port 0: any free; empty: off)");

namespace {

// Raises the soft limit on open files to the hard limit (each HTTP
// connection holds one); returns the limit now in force.
rlim_t RaiseFileLimit() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return 0;
  if (r.rlim_cur < r.rlim_max) {
    rlimit raised = r;
    raised.rlim_cur = r.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) r = raised;
  }
  return r.rlim_cur;
}

int Run() {
  using namespace pdserve;
  router::RouterOptions o;
  o.model_dir = absl::GetFlag(FLAGS_model);
  if (o.model_dir.empty()) {
    LogEvent("error", "bad_flags", {{"error", "--model is required"}});
    return 2;
  }
  o.model_name = absl::GetFlag(FLAGS_model_name);
  o.grammar.schema.max_schema_bytes = absl::GetFlag(FLAGS_grammar_max_schema_bytes);
  o.grammar.schema.max_nodes = absl::GetFlag(FLAGS_grammar_max_nodes);
  o.grammar.schema.max_depth = absl::GetFlag(FLAGS_grammar_max_depth);
  o.grammar.max_grammars = absl::GetFlag(FLAGS_grammar_cache_size);
  if (o.model_name.empty()) {
    std::string dir = o.model_dir;
    while (!dir.empty() && dir.back() == '/') dir.pop_back();
    o.model_name = dir.substr(dir.find_last_of('/') + 1);
  }
  o.prefill_workers = absl::GetFlag(FLAGS_prefill);
  o.decode_workers = absl::GetFlag(FLAGS_decode);
  o.colocated = absl::GetFlag(FLAGS_colocated);
  o.api_keys_file = absl::GetFlag(FLAGS_api_keys_file);
  o.autoscale_min_samples = absl::GetFlag(FLAGS_autoscale_min_samples);
  o.max_reply_entries = absl::GetFlag(FLAGS_max_reply_entries);
  if (const std::string scope = absl::GetFlag(FLAGS_prefix_cache_scope); scope == "per_key") {
    o.prefix_cache_scope = router::PrefixCacheScope::kPerKey;
  } else if (scope != "shared") {
    LogEvent("error", "bad_flags", {{"error", "--prefix_cache_scope must be shared or per_key"}});
    return 2;
  }
  if (o.max_reply_entries < 1) {
    LogEvent("error", "bad_flags", {{"error", "--max_reply_entries must be at least 1"}});
    return 2;
  }
  if (o.autoscale_min_samples < 1) {
    LogEvent("error", "bad_flags", {{"error", "--autoscale_min_samples must be at least 1"}});
    return 2;
  }
  absl::StatusOr<TlsFiles> tls = TlsFilesFromFlags("router");
  if (!tls.ok()) {
    LogEvent("error", "bad_flags", {{"error", std::string(tls.status().message())}});
    return 2;
  }
  o.tls = *tls;
  absl::StatusOr<std::shared_ptr<const kv::GrantKey>> grant_key = GrantKeyFromFlags("router");
  if (!grant_key.ok()) {
    LogEvent("error", "bad_flags", {{"error", std::string(grant_key.status().message())}});
    return 2;
  }
  o.grant_key = *grant_key;
  o.grant_ttl = absl::Seconds(absl::GetFlag(FLAGS_kv_grant_ttl_s));
  if (!(absl::GetFlag(FLAGS_kv_grant_ttl_s) > 0)) {
    LogEvent("error", "bad_flags", {{"error", "--kv_grant_ttl_s must be above 0"}});
    return 2;
  }
  o.resolve_interval = absl::Seconds(absl::GetFlag(FLAGS_resolve_interval_s));
  o.max_backoff = absl::Seconds(absl::GetFlag(FLAGS_max_backoff_s));
  o.pick_wait = absl::Seconds(absl::GetFlag(FLAGS_pick_wait_s));
  o.decode_moves = absl::GetFlag(FLAGS_decode_moves);
  o.move_timeout = absl::Seconds(absl::GetFlag(FLAGS_move_timeout_s));
  if (absl::GetFlag(FLAGS_rebalance)) {
    o.rebalance = router::RebalanceOptions{.step_margin = absl::GetFlag(FLAGS_rebalance_step_margin),
                                           .kv_margin = absl::GetFlag(FLAGS_rebalance_kv_margin),
                                           .sustain = absl::Seconds(absl::GetFlag(FLAGS_rebalance_sustain_s)),
                                           .window = absl::Seconds(absl::GetFlag(FLAGS_rebalance_window_s))};
  } else {
    o.rebalance.reset();
  }
  o.max_request_duration = absl::Seconds(absl::GetFlag(FLAGS_max_request_s));
  if (!(absl::GetFlag(FLAGS_max_request_s) > 0)) {
    LogEvent("error", "bad_flags", {{"error", "--max_request_s must be above 0"}});
    return 2;
  }
  o.prefill_policy = absl::GetFlag(FLAGS_prefill_policy);
  o.decode_policy = absl::GetFlag(FLAGS_decode_policy);
  o.itl_target = absl::Milliseconds(absl::GetFlag(FLAGS_itl_target_ms));
  o.local_prefill_max_tokens = absl::GetFlag(FLAGS_local_prefill_max_tokens);
  o.pull_min_tokens = absl::GetFlag(FLAGS_prefix_pull_min_tokens);
  o.pull_overhead = absl::Milliseconds(absl::GetFlag(FLAGS_prefix_pull_overhead_ms));
  o.pull_always = absl::GetFlag(FLAGS_prefix_pull_always);
  o.prefix_expect = absl::Seconds(absl::GetFlag(FLAGS_prefix_expect_s));
  if (absl::Status st = SetMinLogLevel(absl::GetFlag(FLAGS_log_level)); !st.ok()) {
    LogEvent("error", "bad_flags", {{"error", std::string(st.message())}});
    return 2;
  }
  {
    router::RequestQueueOptions q;
    q.max_queued = absl::GetFlag(FLAGS_max_queued_requests);
    q.max_wait = absl::Seconds(absl::GetFlag(FLAGS_max_queue_wait_s));
    if (q.max_queued < 0 || !(absl::GetFlag(FLAGS_max_queue_wait_s) >= 0)) {
      LogEvent("error", "bad_flags", {{"error", "--max_queued_requests and --max_queue_wait_s must be at least 0"}});
      return 2;
    }
    o.queue = q;
  }
  o.probe_stall = absl::Seconds(absl::GetFlag(FLAGS_probe_stall_s));
  if (!(absl::GetFlag(FLAGS_probe_stall_s) > 0)) {
    LogEvent("error", "bad_flags", {{"error", "--probe_stall_s must be above 0"}});
    return 2;
  }
  if (absl::GetFlag(FLAGS_admission)) {
    router::AdmissionOptions a;
    a.max_queued = absl::GetFlag(FLAGS_max_queued);
    if (const double ms = absl::GetFlag(FLAGS_ttft_target_ms); ms > 0) a.ttft_target = absl::Milliseconds(ms);
    a.min_samples = absl::GetFlag(FLAGS_admission_min_samples);
    if (a.max_queued < 1 || a.min_samples < 1) {
      LogEvent("error", "bad_flags", {{"error", "--max_queued and --admission_min_samples must be at least 1"}});
      return 2;
    }
    o.admission = a;
  }
  absl::StatusOr<std::unique_ptr<router::RouterService>> service = router::RouterService::Create(o);
  if (!service.ok()) {
    LogEvent("error", "start_failed", {{"error", std::string(service.status().message())}});
    return 2;
  }
  if (absl::Status st = (*service)->WaitForWorkers(absl::Seconds(absl::GetFlag(FLAGS_worker_wait_s))); !st.ok()) {
    LogEvent("error", "workers_unavailable", {{"error", std::string(st.message())}});
    return 1;
  }
  std::unique_ptr<router::openai::HttpServer> http;
  if (const std::string address = absl::GetFlag(FLAGS_http_listen); !address.empty()) {
    router::openai::HttpServerOptions ho;
    ho.address = address;
    ho.max_body_bytes = absl::GetFlag(FLAGS_http_max_body_bytes);
    ho.max_buffered_bytes = absl::GetFlag(FLAGS_http_max_buffered_bytes);
    ho.socket_send_buffer = absl::GetFlag(FLAGS_http_socket_send_buffer_bytes);
    ho.max_connections = absl::GetFlag(FLAGS_http_max_connections);
    ho.header_timeout = absl::Seconds(absl::GetFlag(FLAGS_http_header_timeout));
    ho.request_timeout = absl::Seconds(absl::GetFlag(FLAGS_http_request_timeout));
    ho.body_budget_bytes = absl::GetFlag(FLAGS_http_body_budget_bytes);
    ho.max_inflight = absl::GetFlag(FLAGS_http_max_inflight);
    ho.max_reply_entries = absl::GetFlag(FLAGS_max_reply_entries);
    if (ho.max_connections < 1 || ho.max_inflight < 1 || !(absl::GetFlag(FLAGS_http_header_timeout) > 0) ||
        !(absl::GetFlag(FLAGS_http_request_timeout) > 0) || ho.body_budget_bytes < ho.max_body_bytes) {
      LogEvent("error", "bad_flags",
               {{"error", "--http_max_connections, --http_max_inflight and the HTTP timeouts must be above 0, and "
                          "--http_body_budget_bytes at least --http_max_body_bytes"}});
      return 2;
    }
    if (const rlim_t files = RaiseFileLimit(); files < static_cast<rlim_t>(ho.max_connections) + 256) {
      LogEvent("warning", "file_limit_low",
               {{"limit", std::to_string(files)}, {"http_max_connections", std::to_string(ho.max_connections)}});
    }
    ho.tls = o.tls;
    absl::StatusOr<std::unique_ptr<router::openai::HttpServer>> h =
        router::openai::HttpServer::Start(ho, (*service)->HttpBackend());
    if (!h.ok()) {
      LogEvent("error", "http_listen_failed", {{"address", address}, {"error", std::string(h.status().message())}});
      return 1;
    }
    http = *std::move(h);
  }
  ServeOptions so;
  // Clients get server-side TLS (API keys say who they are).
  if (o.tls.enabled()) so.credentials = ServerTlsCredentials(o.tls, "");
  so.health_address = absl::GetFlag(FLAGS_health_listen);
  if (http != nullptr) {
    so.ports.emplace_back("http_port", http->port());
    so.on_drain = [&http](absl::Time deadline) { http->Drain(deadline); };
  }
  so.address = absl::GetFlag(FLAGS_listen);
  so.ready_file = absl::GetFlag(FLAGS_ready_file);
  so.role = "router";
  // Ready (gRPC health SERVING) only while a request can be placed: a
  // router with an empty pool is taken out of its Service's endpoints.
  so.health = [&service]() -> std::string {
    const absl::Status st = (*service)->Ready();
    return st.ok() ? "" : std::string(st.message());
  };
  so.metrics = &(*service)->metrics();
  so.metrics_address = absl::GetFlag(FLAGS_metrics_listen);
  so.log_fields = {{"model", o.model_name}, {"colocated", o.colocated ? "true" : "false"}};
  return ServeUntilSignal(so, {service->get()});
}

}  // namespace

int main(int argc, char** argv) {
  pdserve::BlockShutdownSignals();
  pdserve::LogProtobufAsEvents();
  absl::SetProgramUsageMessage("pdserve router: pdserve-router --model DIR --decode ADDR[,..] [--prefill ADDR[,..]]");
  absl::ParseCommandLine(argc, argv);
  pdserve::ConfigureServerProcess();
  return Run();
}
