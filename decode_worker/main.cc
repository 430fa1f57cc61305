// pdserve-decode-worker: continuous-batching decode (and, with
// --prefill_local, colocated prefill) behind the DecodeWorker gRPC service.
//
//   pdserve-decode-worker --model DIR --listen 127.0.0.1:0 --ready_file F
//
// Flags may also come from a file: --flagfile=decode.flags.
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/server_util.h"
#include "text/tokenizer.h"
#include "decode_worker/decode_service.h"
#include "kv_transfer/receiver.h"
#include "base/grpc_server.h"
#include "base/metrics.h"
#include "runtime/worker_runtime.h"
#include "base/tls_flags.h"
#include "kv_transfer/grant_flags.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC address (port 0: any free port)");
ABSL_FLAG(std::string, ready_file, "", "write {\"grpc_port\":..} here once serving");
ABSL_FLAG(int, max_batch, 64, "most sequences decoded together");
ABSL_FLAG(int, prefill_chunk, 256, "prompt tokens prefilled per step (colocated and recompute)");
ABSL_FLAG(bool, prefix_cache, true,
          "local prefills reuse cached prefixes, and finished sequences publish their blocks");
ABSL_FLAG(double, itl_target_ms, 0, "admit no new sequence while the step time exceeds this (0: off)");
ABSL_FLAG(bool, prefill_local, true, "accept colocated requests (prefill here)");
ABSL_FLAG(bool, stand_in, false, "benchmark stand-in: stream max_tokens dummy tokens at once, no model work");
ABSL_FLAG(int, fault_unparseable_streams, 0,
          "fault tests only: the first N streams (-1: all) send their second chunk unparseable");
ABSL_FLAG(int, fault_lose_decode_calls, 0,
          "fault tests only: the first N handed-off Decode calls (-1: all) end CANCELLED unregistered, as calls "
          "cancelled before they ran here");
ABSL_FLAG(int, fault_move_at_token, 0,
          "fault tests only: every sequence pauses for a move to another decode worker once it has generated this "
          "many tokens (0: never)");
ABSL_FLAG(int, fault_stall_move_ms, 0, "fault tests only: each move waits this long before its KV is sent");
ABSL_FLAG(int, fault_step_delay_ms, 0, "fault tests only: every engine step waits this long first (a slow model)");
ABSL_FLAG(std::string, kv_host, "127.0.0.1", "address the KV receiver listens on (--kv_transport)");
ABSL_FLAG(int, kv_port, 0, "port of the KV receiver (0: any free port)");
ABSL_FLAG(int, kv_landing_positions, 65536,
          "--backend=cuda: positions of registered host memory KV handoffs land in before they are copied to the "
          "GPU (bounds the handoffs in flight)");
ABSL_FLAG(double, kv_lease_s, 5, "a KV reservation not renewed for this long is aborted");
ABSL_FLAG(std::string, kv_verify_handoffs, "sample",
          "which KV handoffs are checked against per-layer checksums from the prefill worker before their KV "
          "is used: all, sample (a share of them, --kv_verify_sample_rate) or off; a mismatch discards the KV "
          "and the request computes its context here");
ABSL_FLAG(double, kv_verify_sample_rate, 1.0 / 16, "--kv_verify_handoffs=sample: the share of handoffs checked");
ABSL_FLAG(double, kv_quarantine_s, 30,
          "an aborted reservation whose sender neither acknowledges nor disconnects within this is freed "
          "(its connection is dropped)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0", "Prometheus /metrics address (port 0: any free; empty: off)");
ABSL_FLAG(double, stall_timeout_s, 10,
          "a stream whose client stops reading (no write completes for this long) is cancelled and its KV freed");
ABSL_FLAG(int, max_buffered_tokens, 4096, "tokens a stream may hold behind a write its client has not taken; more cancels it");
ABSL_FLAG(double, drain_grace_s, 30,
          "SIGTERM: seconds to move running sequences to other decode workers (--kv_moves) or let them finish; "
          "what is left then is replayed elsewhere");
ABSL_FLAG(bool, kv_moves, true,
          "move running sequences, KV and all, to other decode workers on drain and when the router rebalances "
          "(false: a drain lets streams finish, then they are replayed, and the router's pauses are refused)");
ABSL_FLAG(double, handoff_wait_s, 30,
          "how long a Decode call waits for its KV handoff to commit (its prefill queued included), and a committed "
          "handoff for its Decode call; past it the router replays the request");
ABSL_FLAG(double, move_wait_s, 5, "a sequence paused for a move whose target the router has not named within this is not moved");
ABSL_FLAG(double, kv_timeout_s, 10, "a move's KV handoff whose receiver does not answer within this fails");

namespace {

int Run() {
  using namespace pdserve;
  int start_code = 0;
  absl::StatusOr<WorkerRuntime> rt = StartWorkerRuntime("decode", &start_code);
  if (!rt.ok()) return start_code;
  absl::StatusOr<std::shared_ptr<const kv::GrantKey>> grant_key = GrantKeyFromFlags("decode");
  if (!grant_key.ok()) {
    LogEvent("error", "bad_flags", {{"error", std::string(grant_key.status().message())}});
    return 2;
  }
  kv::Transport* transport = rt->transport.get();
  WorkerModel* w = &rt->engine;
  ModelStack* engine = &w->engine;
  decode::DecodeServiceOptions so;
  so.engine.max_batch = absl::GetFlag(FLAGS_max_batch);
  so.grammar = GrammarOptionsFromFlags();
  so.engine.chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk);
  so.engine.itl_target_seconds = absl::GetFlag(FLAGS_itl_target_ms) / 1e3;
  so.engine.prefix_cache = absl::GetFlag(FLAGS_prefix_cache);
  so.engine.tier2 = so.engine.prefix_cache ? w->tier2.get() : nullptr;
  ApplyRequestLifeFlags(so.engine);
  so.engine.fault_stall_forward = absl::Milliseconds(absl::GetFlag(FLAGS_fault_step_delay_ms));
  so.allow_prefill = absl::GetFlag(FLAGS_prefill_local);
  so.stand_in = absl::GetFlag(FLAGS_stand_in);
  so.stall_timeout_seconds = absl::GetFlag(FLAGS_stall_timeout_s);
  so.max_buffered_tokens = absl::GetFlag(FLAGS_max_buffered_tokens);
  so.fault_unparseable_streams = absl::GetFlag(FLAGS_fault_unparseable_streams);
  so.fault_lose_decode_calls = absl::GetFlag(FLAGS_fault_lose_decode_calls);
  // Moves read this worker's pool; a GPU's is copied out through its backend.
  kv::KvSender mover(transport, engine->kv->storage(),
                     {.model = engine->model->identity(),
                      .timeout = absl::Seconds(absl::GetFlag(FLAGS_kv_timeout_s)),
                      .pool_backend = engine->gpu.get()});
  if (absl::GetFlag(FLAGS_kv_moves)) so.mover = &mover;
  so.move_wait_seconds = absl::GetFlag(FLAGS_move_wait_s);
  so.handoff_wait_seconds = absl::GetFlag(FLAGS_handoff_wait_s);
  so.fault_move_at_token = absl::GetFlag(FLAGS_fault_move_at_token);
  so.fault_stall_move_ms = absl::GetFlag(FLAGS_fault_stall_move_ms);
  decode::DecodeService service(engine->model.get(), engine->kv.get(), w->tokenizer.get(), so);
  kv::ReceiverOptions ro;
  ro.model = engine->model->identity();
  ro.lease = absl::Seconds(absl::GetFlag(FLAGS_kv_lease_s));
  ro.quarantine_timeout = absl::Seconds(absl::GetFlag(FLAGS_kv_quarantine_s));
  ro.grant_key = *grant_key;
  if (const std::string v = absl::GetFlag(FLAGS_kv_verify_handoffs); v == "all") {
    ro.verify_fraction = 1;
  } else if (v == "sample") {
    const double rate = absl::GetFlag(FLAGS_kv_verify_sample_rate);
    if (!(rate >= 0 && rate <= 1)) {
      LogEvent("error", "bad_flags", {{"error", absl::StrCat("--kv_verify_sample_rate=", rate, ": expected 0 to 1")}});
      return 2;
    }
    ro.verify_fraction = rate;
  } else if (v != "off") {
    LogEvent("error", "bad_flags",
             {{"error", absl::StrCat("--kv_verify_handoffs=", v, ": expected all, sample or off")}});
    return 2;
  }
  if (engine->gpu != nullptr) {
    // The pool is GPU memory: handoffs land in host memory, then are copied.
    const int32_t bs = engine->kv->spec().block_size;
    ro.pool_backend = engine->gpu.get();
    ro.landing_blocks = (absl::GetFlag(FLAGS_kv_landing_positions) + bs - 1) / bs;
  }
  absl::StatusOr<std::unique_ptr<kv::KvReceiver>> receiver = kv::KvReceiver::Create(
      transport, engine->kv.get(), ro, [&service](kv::CommittedSequence c) {
        decode::HandedOff h;
        h.kv = std::move(c.kv);
        h.first.token = c.state.first_token;
        h.first.logprob = c.state.first_logprob;
        h.first.top_logprobs = c.state.top_logprobs;
        h.grammar_hash = c.state.grammar_hash;
        h.grammar_digest = c.state.grammar_digest;
        if (c.verify) {
          h.check = {.layer_checksums = std::move(c.state.layer_checksums),
                     .first_block = c.first_block,
                     .end_block = c.end_block,
                     .producer = std::move(c.producer)};
        }
        service.OnHandoffCommitted(c.state.request_id, std::move(h));
      });
  if (!receiver.ok()) {
    LogEvent("error", "kv_receiver_failed", {{"error", std::string(receiver.status().message())}});
    return 1;
  }
  absl::StatusOr<int> kv_port = (*receiver)->Listen(absl::GetFlag(FLAGS_kv_host), absl::GetFlag(FLAGS_kv_port));
  if (!kv_port.ok()) {
    LogEvent("error", "kv_listen_failed", {{"error", std::string(kv_port.status().message())}});
    return 1;
  }
  const std::string kv_address = absl::StrCat(absl::GetFlag(FLAGS_kv_host), ":", *kv_port);
  (*receiver)->SetAddress(kv_address);  // What the router names in grants.
  service.set_kv_address(kv_address);
  CheckWorkerTransport(*rt, absl::GetFlag(FLAGS_kv_host));

  MetricsRegistry metrics;
  {
    AddKvPoolMetrics(metrics, engine->kv.get());
    service.grammars().RegisterMetrics(metrics);
    if (w->tier2 != nullptr) AddKvTier2Metrics(metrics, w->tier2.get());
    kv::KvReceiver* r = receiver->get();
    metrics.AddGauge("pdserve_kv_blocks", "KV blocks by state.",
                     [r] { return static_cast<double>(r->stats().quarantined_blocks); }, "state=\"quarantined\"");
    metrics.AddGauge("pdserve_batch_size", "Sequences decoding now.",
                     [&service] { return static_cast<double>(service.engine_stats().running); });
    metrics.AddGauge("pdserve_decode_queue_depth", "Sequences waiting to (re)prefill here.",
                     [&service] { return static_cast<double>(service.engine_stats().waiting); });
    metrics.AddGauge("pdserve_decode_step_seconds", "Decode step time (exponential average).",
                     [&service] { return service.engine_stats().step_seconds_avg; });
    metrics.AddCounterFunc("pdserve_requests_expired_total", "Requests ended by the bound on a request's life.",
                           [&service] { return static_cast<double>(service.engine_stats().expired); });
    metrics.AddCounterFunc("pdserve_kv_handoffs_verified_total",
                           "Handed-off KV checked against its producer's checksums before use (--kv_verify_handoffs).",
                           [&service] { return static_cast<double>(service.engine_stats().kv_checked); });
    metrics.AddCounterFunc("pdserve_kv_checksum_failures_total",
                           "KV blocks whose bytes did not match the checksum recorded by their producer (discarded; "
                           "their positions are computed again), by path.",
                           [&service] { return static_cast<double>(service.engine_stats().kv_checksum_failures); },
                           "path=\"handoff\"");
    metrics.AddCounterFunc("pdserve_kv_recomputed_positions_total",
                           "KV positions that arrived and were computed again here because they failed their check.",
                           [&service] { return static_cast<double>(service.engine_stats().kv_recomputed_positions); });
    metrics.AddCounterFunc("pdserve_stalled_streams_total", "Streams cancelled because their client stopped reading.",
                           [&service] { return static_cast<double>(service.stalled_streams()); });
    metrics.AddCounterFunc("pdserve_preemptions_total", "Sequences preempted for recomputation.",
                           [&service] { return static_cast<double>(service.engine_stats().preemptions); });
    metrics.AddCounterFunc("pdserve_handoff_bytes_total", "KV bytes received by committed handoffs.",
                           [r] { return static_cast<double>(r->metrics().bytes); });
    metrics.AddCounterFunc("pdserve_handoff_transfers_total", "Committed handoffs.",
                           [r] { return static_cast<double>(r->metrics().transfers); });
    metrics.AddCounterFunc("pdserve_handoff_failures_total", "Handoffs that ended without a commit.",
                           [r] { return static_cast<double>(r->metrics().failures); });
    metrics.AddCounterFunc("pdserve_handoff_leases_expired_total", "KV reservations whose lease expired.",
                           [r] { return static_cast<double>(r->metrics().leases_expired); });
    AddGrantRefusalMetrics(metrics, r);
    for (const char* outcome : {"moved", "not_moved"}) {
      metrics.AddCounterFunc("pdserve_decode_moves_out_total",
                             "Running sequences this worker paused to move to another decode worker, by outcome "
                             "(not_moved: resumed here, or ended for the router to replay).",
                             [&service, moved = std::string(outcome) == "moved"] {
                               const decode::MoveCounts c = service.move_counts();
                               return static_cast<double>(moved ? c.moved : c.failed);
                             },
                             absl::StrCat("outcome=\"", outcome, "\""));
    }
    for (const char* outcome : {"moved", "replayed"}) {
      metrics.AddCounterFunc("pdserve_drain_sequences_total",
                             "Sequences running when this worker drained, by how they left (moved with their KV, or "
                             "replayed elsewhere from their tokens).",
                             [&service, moved = std::string(outcome) == "moved"] {
                               const decode::MoveCounts c = service.move_counts();
                               return static_cast<double>(moved ? c.drain_moved : c.drain_replayed);
                             },
                             absl::StrCat("outcome=\"", outcome, "\""));
    }
  }
  ServeOptions serve;
  ApplyWorkerServing(*rt, serve);
  serve.metrics = &metrics;
  serve.metrics_address = absl::GetFlag(FLAGS_metrics_listen);
  serve.address = absl::GetFlag(FLAGS_listen);
  serve.ready_file = absl::GetFlag(FLAGS_ready_file);
  serve.role = "decode";
  serve.log_fields = {{"kv_port", std::to_string(*kv_port)}};
  kv::KvReceiver* r = receiver->get();
  serve.on_drain = [&service, r](absl::Time deadline) {
    r->StopAccepting();
    service.Drain(deadline);
  };
  serve.health = WorkerHealthCheck(
      *rt, [&service] { return service.draining(); },
      [&service, r] {
        const kv::KvReceiver::Stats rs = r->stats();
        return rs.active == 0 && rs.quarantined == 0 && service.idle();
      },
      [&service] { return service.engine_failure(); },
      [&service](std::string why) { service.set_unhealthy_reason(std::move(why)); }, &metrics);
  serve.drain_grace = absl::Seconds(absl::GetFlag(FLAGS_drain_grace_s));
  serve.on_shutdown = [&service] { service.Shutdown(); };
  const int exit_code = ServeUntilSignal(serve, {&service});
  service.Shutdown();  // The mover's thread stops before the sender goes.
  transport->Detach(receiver->get());
  transport->Detach(&mover);
  receiver->reset();
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  pdserve::BlockShutdownSignals();
  pdserve::LogProtobufAsEvents();
  absl::SetProgramUsageMessage("pdserve decode worker: pdserve-decode-worker --model DIR [--listen ADDR]");
  absl::ParseCommandLine(argc, argv);
  pdserve::ConfigureServerProcess();
  return Run();
}
