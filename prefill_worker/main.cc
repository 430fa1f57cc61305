// pdserve-prefill-worker: chunked prefill + first token + KV handoff,
// behind the PrefillWorker gRPC service.
//
//   pdserve-prefill-worker --model DIR --listen 127.0.0.1:0 --ready_file F
//
// The KV goes to whichever decode worker each request names (its KV
// receiver address, from the router), over --kv_transport (the same on
// every worker: tcp by default; ucx takes UCX_TLS and UCX_NET_DEVICES from
// its environment); see docs/operations.md.
// Flags may also come from a file: --flagfile=prefill.flags.
#include <algorithm>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/server_util.h"
#include "text/tokenizer.h"
#include "base/grpc_server.h"
#include "base/metrics.h"
#include "kv_transfer/grant_flags.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/sender.h"
#include "prefill_worker/prefill_service.h"
#include "prefill_worker/prefix_pull.h"
#include "runtime/worker_runtime.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC address (port 0: any free port)");
ABSL_FLAG(std::string, ready_file, "", "write {\"grpc_port\":..} here once serving");
ABSL_FLAG(int, prefill_chunk, 512, "prompt tokens per forward, across requests");
ABSL_FLAG(int, max_batch, 8, "requests per forward");
ABSL_FLAG(bool, kv_stream_layers, true,
          "send each layer's KV as the forward finishes it (false: every layer after the forward, only to measure "
          "what streaming saves: tools/bench/first_gap.sh)");
ABSL_FLAG(int, fault_stall_before_commit_ms, 0, "fault tests only: stall each handoff before its commit");
ABSL_FLAG(int, fault_stall_prefill_ms, 0, "fault tests only: stall before each prefill forward");
ABSL_FLAG(bool, fault_wrong_kv_checksums, false,
          "fault tests only: the checksums of every verified handoff are wrong by one bit, as if its KV changed on "
          "the way");
ABSL_FLAG(int, fault_unparseable_streams, 0,
          "fault tests only: the first N streams (-1: all) send their first token unparseable");
ABSL_FLAG(bool, kv_pulls, true,
          "take prefixes other prefill workers hold from them, when the router predicts that cheaper than computing "
          "them, and send the ones held here on request (CPU backend; needs --kv_grant_key unless --insecure)");
ABSL_FLAG(std::string, kv_host, "127.0.0.1", "address the prefix pull receiver listens on (--kv_pulls)");
ABSL_FLAG(int, kv_port, 0, "port of the prefix pull receiver (0: any free port)");
ABSL_FLAG(double, kv_lease_s, 5, "a prefix pull's reservation not renewed for this long is aborted");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0", "Prometheus /metrics address (port 0: any free; empty: off)");
ABSL_FLAG(double, kv_timeout_s, 10, "a KV handoff whose receiver does not answer within this fails (the router retries it)");
ABSL_FLAG(double, drain_grace_s, 30, "SIGTERM: seconds to finish queued requests before they go elsewhere");
ABSL_FLAG(double, handoff_room_wait_s, 20,
          "a KV reservation the decode worker refuses for lack of room is asked again whenever it tells of freed "
          "room, for up to this long, the prompt not yet computed; then the request fails with RESOURCE_EXHAUSTED and "
          "the router moves it to another decode worker (0: at the first refusal)");

namespace {

int Run() {
  using namespace pdserve;
  int start_code = 0;
  absl::StatusOr<WorkerRuntime> rt = StartWorkerRuntime("prefill", &start_code);
  if (!rt.ok()) return start_code;
  kv::Transport* transport = rt->transport.get();
  WorkerModel* w = &rt->engine;
  ModelStack* engine = &w->engine;
  int exit_code = 0;
  {
    // Prefix pulls: a receiver on this pool that checks every pull (its
    // blocks are published only once they match their producer's
    // checksums), and a pusher answering PushPrefix from the same sender
    // as the handoffs.
    prefill::PullCounters pull_counters;
    std::unique_ptr<kv::KvReceiver> pull_receiver;
    std::string pull_address;
    std::string pulls_off;
    std::shared_ptr<const kv::GrantKey> grant_key;
    if (!absl::GetFlag(FLAGS_kv_pulls)) {
      pulls_off = "--kv_pulls=false";
    } else if (engine->gpu != nullptr) {
      pulls_off = "a device pool: pulled KV cannot be checked on the host";
    } else if (absl::StatusOr<std::shared_ptr<const kv::GrantKey>> k = GrantKeyFromFlags("prefill"); !k.ok()) {
      pulls_off = std::string(k.status().message());
    } else {
      grant_key = *k;
    }
    if (pulls_off.empty()) {
      kv::ReceiverOptions ro;
      ro.model = engine->model->identity();
      ro.lease = absl::Seconds(absl::GetFlag(FLAGS_kv_lease_s));
      ro.grant_key = grant_key;
      ro.verify_fraction = 1;
      KvManager* pool = engine->kv.get();
      const ModelIdentity model = engine->model->identity();
      absl::StatusOr<std::unique_ptr<kv::KvReceiver>> r = kv::KvReceiver::Create(
          transport, pool, ro, [pool, model, &pull_counters](kv::CommittedSequence c) {
            prefill::AcceptPulledPrefix(pool, model, std::move(c), &pull_counters);
          });
      absl::StatusOr<int> port = r.ok() ? (*r)->Listen(absl::GetFlag(FLAGS_kv_host), absl::GetFlag(FLAGS_kv_port))
                                        : absl::StatusOr<int>(r.status());
      if (!port.ok()) {
        LogEvent("error", "kv_listen_failed", {{"error", std::string(port.status().message())}});
        return 1;
      }
      pull_receiver = *std::move(r);
      pull_address = absl::StrCat(absl::GetFlag(FLAGS_kv_host), ":", *port);
      pull_receiver->SetAddress(pull_address);  // What the router names in pull grants.
    } else {
      LogEvent("info", "kv_pulls_off", {{"reason", pulls_off}});
    }
    CheckWorkerTransport(*rt, pull_receiver != nullptr ? absl::GetFlag(FLAGS_kv_host) : "");
    // A GPU's pool is copied out through its backend, layer by layer.
    kv::KvSender sender(transport, engine->kv->storage(),
                        {.model = engine->model->identity(),
                         .timeout = absl::Seconds(absl::GetFlag(FLAGS_kv_timeout_s)),
                         .pool_backend = engine->gpu.get(),
                         .fault_wrong_checksums = absl::GetFlag(FLAGS_fault_wrong_kv_checksums)});
    prefill::PrefillServiceOptions so;
    so.chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk);
    so.grammar = GrammarOptionsFromFlags();
    so.stream_layers = absl::GetFlag(FLAGS_kv_stream_layers);
    so.max_batch = absl::GetFlag(FLAGS_max_batch);
    so.fault_stall_before_commit_ms = absl::GetFlag(FLAGS_fault_stall_before_commit_ms);
    so.fault_stall_prefill_ms = absl::GetFlag(FLAGS_fault_stall_prefill_ms);
    so.fault_unparseable_streams = absl::GetFlag(FLAGS_fault_unparseable_streams);
    so.handoff_room_wait = absl::Seconds(std::max(0.0, absl::GetFlag(FLAGS_handoff_room_wait_s)));
    {
      engine::EngineOptions life;
      ApplyRequestLifeFlags(life);
      so.life_base = life.life_base;
      so.life_step_factor = life.life_step_factor;
      so.life_min_per_token = life.life_min_per_token;
    }
    so.tier2 = w->tier2.get();
    std::unique_ptr<prefill::PrefixPusher> pusher;
    if (pull_receiver != nullptr) {
      pusher = std::make_unique<prefill::PrefixPusher>(engine->model->identity(), engine->kv.get(), &sender,
                                                       w->tier2.get());
      so.pusher = pusher.get();
      so.pull_address = pull_address;
      so.pulls = &pull_counters;
    }
    prefill::PrefillService service(engine->model.get(), engine->kv.get(), w->tokenizer.get(), &sender, so);

    MetricsRegistry metrics;
    AddKvPoolMetrics(metrics, engine->kv.get());
    service.grammars().RegisterMetrics(metrics);
    if (w->tier2 != nullptr) AddKvTier2Metrics(metrics, w->tier2.get());
    const KvManager* kv = engine->kv.get();
    auto pool_gauge = [kv](auto read) {
      return [kv, read] { return static_cast<double>(read(kv->Counts().prefix)); };
    };
    metrics.AddCounterFunc("pdserve_prefix_cache_blocks_total", "Full prompt blocks looked up in the prefix cache.",
                           pool_gauge([](const PrefixCacheStats& p) { return p.hit_blocks; }),
                           "result=\"hit\"");
    metrics.AddCounterFunc("pdserve_prefix_cache_blocks_total", "Full prompt blocks looked up in the prefix cache.",
                           pool_gauge([](const PrefixCacheStats& p) { return p.miss_blocks; }),
                           "result=\"miss\"");
    metrics.AddCounterFunc("pdserve_prefix_cache_evictions_total", "Cached blocks reclaimed for new allocations.",
                           pool_gauge([](const PrefixCacheStats& p) { return p.evictions; }));
    metrics.AddCounterFunc("pdserve_requests_expired_total", "Requests ended by the bound on a request's life.",
                           [&service] { return static_cast<double>(service.engine_stats().expired); });
    metrics.AddGauge("pdserve_prefill_queue_depth", "Requests waiting for prefill.",
                     [&service] { return static_cast<double>(service.stats().queued); });
    metrics.AddGauge("pdserve_prefill_queued_tokens", "Prompt tokens waiting for prefill.",
                     [&service] { return static_cast<double>(service.stats().queued_tokens); });
    metrics.AddCounterFunc("pdserve_handoff_bytes_total", "KV bytes sent.",
                           [&sender] { return static_cast<double>(sender.metrics().bytes); });
    metrics.AddCounterFunc("pdserve_handoff_transfers_total", "Committed handoffs.",
                           [&sender] { return static_cast<double>(sender.metrics().transfers); });
    metrics.AddCounterFunc("pdserve_handoff_failures_total", "Handoffs that ended without a commit.",
                           [&sender] { return static_cast<double>(sender.metrics().failures); });
    metrics.AddCounterFunc("pdserve_handoff_room_waits_total",
                           "KV reservations a decode worker refused for lack of room that then waited for room.",
                           [&service] { return static_cast<double>(service.counters().room_waits); });
    metrics.AddCounterFunc("pdserve_handoff_room_wait_seconds_total",
                           "Seconds KV reservations waited for room on a decode worker (counted as each wait ends).",
                           [&service] { return service.counters().room_wait_seconds; });
    metrics.AddCounterFunc("pdserve_handoff_room_retries_total",
                           "KV reservations asked again because the decode worker told of freed room.",
                           [&service] { return static_cast<double>(service.counters().room_retries); });
    metrics.AddCounterFunc("pdserve_prefill_discarded_tokens_total",
                           "Context tokens prefilled here whose KV no decode worker took (not counting requests "
                           "their first token ended or their client cancelled).",
                           [&service] { return static_cast<double>(service.counters().discarded_tokens); });
    if (pull_receiver != nullptr) {
      const prefill::PushCounters* pc = &pusher->counters();
      const prefill::PullCounters* pl = &pull_counters;
      auto counter = [](const std::atomic<int64_t>* v) { return [v] { return static_cast<double>(v->load()); }; };
      metrics.AddCounterFunc("pdserve_kv_pulls_total", "Prefixes pulled from other prefill workers, by result.",
                             counter(&pl->received), "result=\"published\"");
      metrics.AddCounterFunc("pdserve_kv_pulls_total", "Prefixes pulled from other prefill workers, by result.",
                             counter(&pl->checksum_failures), "result=\"checksum_failed\"");
      metrics.AddCounterFunc("pdserve_kv_pulled_positions_total",
                             "Prefix positions published from pulls (held ones included).", counter(&pl->positions));
      metrics.AddCounterFunc("pdserve_kv_checksum_failures_total",
                             "KV blocks whose bytes did not match the checksum recorded by their producer (discarded; "
                             "their positions are computed again), by path.",
                             counter(&pl->checksum_failures), "path=\"pull\"");
      for (const auto& [result, v] : {std::pair{"pushed", &pc->pushed}, std::pair{"failed", &pc->failed},
                                      std::pair{"not_cached", &pc->empty}}) {
        metrics.AddCounterFunc("pdserve_kv_pushes_total",
                               "Prefixes sent to other prefill workers on the router's request, by result.",
                               counter(v), absl::StrCat("result=\"", result, "\""));
      }
      metrics.AddCounterFunc("pdserve_kv_push_bytes_total", "KV bytes of prefixes sent to other prefill workers.",
                             counter(&pc->bytes));
      metrics.AddCounterFunc("pdserve_kv_push_tier2_blocks_total",
                             "Blocks of prefixes sent to other prefill workers that were read back from the second "
                             "tier to be sent (the pool no longer held them).",
                             counter(&pc->tier2_blocks));
      AddGrantRefusalMetrics(metrics, pull_receiver.get());
    }
    ServeOptions serve;
    ApplyWorkerServing(*rt, serve);
    serve.metrics = &metrics;
    serve.metrics_address = absl::GetFlag(FLAGS_metrics_listen);
    serve.address = absl::GetFlag(FLAGS_listen);
    serve.ready_file = absl::GetFlag(FLAGS_ready_file);
    serve.role = "prefill";
    serve.on_drain = [&service](absl::Time deadline) { service.Drain(deadline); };
    serve.health = WorkerHealthCheck(
        *rt, [&service] { return service.draining(); },
        [&service] { return service.idle(); },
        [&service] { return service.engine_failure(); },
        [&service](std::string why) { service.set_unhealthy_reason(std::move(why)); }, &metrics);
    serve.drain_grace = absl::Seconds(absl::GetFlag(FLAGS_drain_grace_s));
    serve.on_shutdown = [&service] { service.Shutdown(); };
    exit_code = ServeUntilSignal(serve, {&service});
    if (pull_receiver != nullptr) transport->Detach(pull_receiver.get());
    transport->Detach(&sender);
  }
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  pdserve::BlockShutdownSignals();
  pdserve::LogProtobufAsEvents();
  absl::SetProgramUsageMessage("pdserve prefill worker: pdserve-prefill-worker --model DIR [--listen ADDR]");
  absl::ParseCommandLine(argc, argv);
  pdserve::ConfigureServerProcess();
  return Run();
}
