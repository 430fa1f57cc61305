#include "runtime/worker_runtime.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/grpc_server.h"
#include "base/tls_flags.h"
#include "absl/time/clock.h"
#include "base/health.h"
#include "base/server_util.h"

ABSL_FLAG(int64_t, grammar_max_schema_bytes, 64 << 10,
          "largest JSON Schema a response format may give, in bytes (refused past it)");
ABSL_FLAG(int64_t, grammar_max_nodes, 100000,
          "most grammar nodes a response format may compile to (about 60 bytes each; refused past it)");
ABSL_FLAG(int32_t, grammar_max_depth, 128, "deepest nesting a constrained output may reach, in grammar frames");
ABSL_FLAG(int64_t, grammar_mask_states, 2048,
          "token masks kept per response format (each vocab/8 bytes); past it the cache starts again");
ABSL_FLAG(int32_t, grammar_cache_size, 64, "compiled response formats kept, by schema hash");
ABSL_FLAG(int64_t, grammar_mask_bytes, 256 << 20,
          "token masks kept, every response format together, in bytes (0: no bound; past it a format's cache starts "
          "again)");
ABSL_FLAG(std::string, model, "", "model directory (Hugging Face layout)");
ABSL_FLAG(std::string, backend, "cpu",
          "compute backend: cpu, or cuda (NVIDIA GPU; needs a build with nvcc; see docs/architecture.md, the GPU backend); "
          "cpu-device is for tests: the CPU kernels behind a GPU's memory contract");
ABSL_FLAG(int, cuda_device, 0, "--backend=cuda: the GPU to run on");
ABSL_FLAG(double, gpu_memory_fraction, 0.9,
          "--backend=cuda: fraction of the GPU's memory the worker may use; the KV pool gets what the weights, "
          "other processes and a 1 GiB workspace leave of it (--kv_positions sizes the pool when 0)");
ABSL_FLAG(int, threads, 1, "compute threads per tensor-parallel rank");
ABSL_FLAG(int, tp, 1, "tensor-parallel ranks (threads of this worker, each with --threads compute threads)");
ABSL_FLAG(std::string, tp_kv_layout, "head",
          "with --tp > 1, where the KV lives: head (each rank its KV heads) or request (each rank whole "
          "requests, every head; decode workers only)");
ABSL_FLAG(std::string, matrix_path, "",
          "matrix path of BF16 weights: f32 (exact F32 arithmetic), fp16 (AVX512-FP16, activations rounded to "
          "FP16), bf16 (AVX512-BF16 dot products, activations rounded to BF16) or amx (AMX-BF16 tiles, the same "
          "operands); default: $PDSERVE_MATRIX_PATH, "
          "else the fastest by a probe at start-up");
ABSL_FLAG(std::string, weights, "", "in-memory weight format: f32, bf16 or int8 (default: as stored)");
ABSL_FLAG(std::string, kv, "", "KV cache format (default: the weight format)");
ABSL_FLAG(int, block_size, 16, "KV block size in positions");
ABSL_FLAG(int, kv_positions, 16384, "KV pool size in positions");
ABSL_FLAG(std::string, kv_transport, "tcp",
          "how KV handoffs travel: tcp (every byte written into the pool passes the receiver's reservation "
          "check; any network) or ucx (UCX, one-sided puts over shared memory between processes on one "
          "host; UCX's tcp transport serves remote memory access to anyone who reaches the port, so use it "
          "only where every host that can reach the KV port is trusted; both sides must agree)");
ABSL_FLAG(bool, kv_loop_realtime, true,
          "run the KV transport's loop thread in SCHED_FIFO at priority 1 when the process may (root, "
          "CAP_SYS_NICE or RLIMIT_RTPRIO >= 1), so that a peer's reservation or commit is answered at once "
          "even while compute fills the core; otherwise, or when false, the loop stays in the normal class");
ABSL_FLAG(bool, kv_direct_writes, true,
          "--kv_transport=tcp: a peer on this host that the kernel already lets write this process's memory "
          "(the same user) writes handoffs straight into the pool (process_vm_writev, one copy); false: every "
          "peer's bytes pass the receiver's reservation check");

ABSL_FLAG(std::string, kv_tier2_dir, "",
          "a directory on local disk for the prefix cache's second tier: full KV blocks are written there as "
          "they are published and read back (checked) when a prompt's cached prefix runs on past the pool; it "
          "survives restarts (empty: no second tier; CPU backend only)");
ABSL_FLAG(int64_t, kv_tier2_bytes, int64_t{4} << 30,
          "--kv_tier2_dir: the most bytes of block files it keeps (least recently used go first)");
ABSL_FLAG(int32_t, kv_tier2_io_threads, 2, "--kv_tier2_dir: threads reading and writing block files");

ABSL_FLAG(double, request_life_base_s, 60,
          "a request that is prefilling or decoding ends (DEADLINE_EXCEEDED, its KV freed) once it has made no "
          "progress (a forward, a prefill chunk, a token) for this + one token's allowance, max(step factor x p99 "
          "step, min per token); time queued never counts and a stream making progress is never ended by it");
ABSL_FLAG(double, request_life_step_factor, 10,
          "the life bound's one-token allowance is at least this x the p99 step time; see --request_life_base_s");
ABSL_FLAG(double, request_life_min_token_ms, 50,
          "the life bound's one-token allowance is at least this; see --request_life_base_s");
ABSL_FLAG(double, drain_min_s, 0,
          "SIGTERM: stay up at least this long, refusing new work as draining, so that routers that still list "
          "this worker (until their next probe or DNS resolve) are told so instead of sending to a vanished "
          "address (Kubernetes: a little above the router's --resolve_interval_s)");
ABSL_FLAG(double, leak_grace_s, 10, "NOT_SERVING once KV blocks stay in use this long with no request holding them");
ABSL_FLAG(double, wedge_after_s, 5, "NOT_SERVING once the KV transport's event loop has not run for this long");
ABSL_FLAG(int, fault_leak_kv_blocks, 0, "fault tests only: take this many KV blocks at start and never free them");
ABSL_FLAG(int64_t, fault_tp_collective_after, 0,
          "fault tests only: the tensor-parallel ranks' Nth collective after start fails (0: never)");
ABSL_FLAG(double, fault_wedge_kv_after_s, 0, "fault tests only: block the KV transport's loop this long after start (0: never)");

namespace pdserve {

namespace {

// `allocator`: the transport's registered memory, for the KV pool. A
// worker on a GPU keeps its pool in GPU memory instead: a prefill worker's
// sender copies each layer out through the backend, a decode worker's
// receiver lands handoffs in registered host memory and copies them in
// (kv::SenderOptions, kv::ReceiverOptions).
absl::StatusOr<WorkerModel> LoadWorkerModel(KvRegionAllocator* allocator) {
  ModelStackOptions eo;
  eo.model_dir = absl::GetFlag(FLAGS_model);
  if (eo.model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  eo.backend = absl::GetFlag(FLAGS_backend);
  eo.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  eo.gpu_memory_fraction = absl::GetFlag(FLAGS_gpu_memory_fraction);
  eo.threads = absl::GetFlag(FLAGS_threads);
  eo.tp = absl::GetFlag(FLAGS_tp);
  eo.tp_kv_layout = absl::GetFlag(FLAGS_tp_kv_layout);
  eo.matrix_path = absl::GetFlag(FLAGS_matrix_path);
  eo.weights = absl::GetFlag(FLAGS_weights);
  eo.kv = absl::GetFlag(FLAGS_kv);
  eo.block_size = absl::GetFlag(FLAGS_block_size);
  eo.kv_positions = absl::GetFlag(FLAGS_kv_positions);
  eo.allocator = eo.backend == "cpu" ? allocator : nullptr;
  WorkerModel w;
  absl::StatusOr<ModelStack> engine = LoadModelStack(eo);
  if (!engine.ok()) return engine.status();
  w.engine = *std::move(engine);
  LogEvent("info", "kernels",
           {{"backend", w.engine.compute().Name()},
            {"matrix_path", w.engine.backend ? std::string(kernels::cpu::MatrixPathName(w.engine.backend->matrix_path()))
                                             : std::string("gpu")},
            {"reason", w.engine.backend ? w.engine.backend->matrix_path_reason() : std::string("gpu")},
            {"attention", w.engine.backend == nullptr ? std::string("gpu")
                          : w.engine.backend->Bf16DotAttention(w.engine.kv->spec().dtype, w.engine.kv->spec().block_size)
                              ? std::string("bf16_dot")
                              : std::string("f32_fma")},
            {"tp", absl::StrCat(w.engine.model->tp())}});
  absl::StatusOr<std::unique_ptr<tok::Tokenizer>> tokenizer = tok::Tokenizer::Load(eo.model_dir);
  if (!tokenizer.ok()) return tokenizer.status();
  w.tokenizer = *std::move(tokenizer);
  if (const std::string dir = absl::GetFlag(FLAGS_kv_tier2_dir); !dir.empty()) {
    if (eo.backend != "cpu") {
      return absl::InvalidArgumentError("--kv_tier2_dir: the second tier holds host memory pools only (--backend=cpu)");
    }
    absl::StatusOr<std::unique_ptr<Tier2Store>> tier2 =
        Tier2Store::Open(w.engine.model->identity(), w.engine.kv->spec(),
                         {.dir = dir,
                          .capacity_bytes = absl::GetFlag(FLAGS_kv_tier2_bytes),
                          .io_threads = absl::GetFlag(FLAGS_kv_tier2_io_threads)});
    if (!tier2.ok()) {
      return absl::Status(tier2.status().code(), absl::StrCat("--kv_tier2_dir: ", tier2.status().message()));
    }
    w.tier2 = *std::move(tier2);
    const Tier2Stats st = w.tier2->Stats();
    LogEvent("info", "kv_tier2_opened",
             {{"dir", dir},
              {"blocks", absl::StrCat(st.blocks)},
              {"bytes", absl::StrCat(st.bytes)},
              {"capacity_bytes", absl::StrCat(st.capacity_bytes)},
              {"discarded", absl::StrCat(st.discarded_at_open)}});
  }
  return w;
}

}  // namespace

void ApplyWorkerServing(const WorkerRuntime& rt, ServeOptions& serve) {
  if (rt.tls.enabled()) serve.credentials = ServerTlsCredentials(rt.tls, "router");
  serve.health_address = absl::GetFlag(FLAGS_health_listen);
  serve.drain_min = absl::Seconds(absl::GetFlag(FLAGS_drain_min_s));
}

absl::StatusOr<WorkerRuntime> StartWorkerRuntime(const std::string& name, int* exit_code) {
  WorkerRuntime rt;
  if (absl::GetFlag(FLAGS_tp_kv_layout) == "request" && name != "decode") {
    LogEvent("error", "bad_flags", {{"error", "--tp_kv_layout=request is for decode workers"}});
    *exit_code = 2;
    return absl::InvalidArgumentError("--tp_kv_layout=request is for decode workers");
  }
  absl::StatusOr<TlsFiles> tls = TlsFilesFromFlags(name);
  if (!tls.ok()) {
    LogEvent("error", "bad_flags", {{"error", std::string(tls.status().message())}});
    *exit_code = 2;
    return tls.status();
  }
  rt.tls = *std::move(tls);
  const std::string kind = absl::GetFlag(FLAGS_kv_transport);
  if (kind == "tcp") {
    absl::StatusOr<std::unique_ptr<kv::TcpTransport>> transport =
        kv::TcpTransport::Create({.name = name,
                                  .realtime_loop = absl::GetFlag(FLAGS_kv_loop_realtime),
                                  .direct_writes = absl::GetFlag(FLAGS_kv_direct_writes)});
    if (!transport.ok()) {
      LogEvent("error", "kv_transport_failed", {{"error", std::string(transport.status().message())}});
      *exit_code = 1;
      return transport.status();
    }
    rt.transport = *std::move(transport);
  } else if (kind == "ucx") {
    absl::StatusOr<std::unique_ptr<kv::UcxTransport>> transport = kv::UcxTransport::Create(
        {.name = name, .realtime_loop = absl::GetFlag(FLAGS_kv_loop_realtime)});
    if (!transport.ok()) {
      LogEvent("error", "ucx_failed", {{"error", std::string(transport.status().message())}});
      *exit_code = 1;
      return transport.status();
    }
    rt.ucx = transport->get();
    rt.transport = *std::move(transport);
    LogEvent("warning", "kv_transport_ucx",
             {{"detail", "UCX's tcp transport serves remote memory access to any peer that reaches the KV port; "
                         "every host that can reach it must be trusted"}});
  } else {
    LogEvent("error", "bad_flags", {{"error", absl::StrCat("--kv_transport=", kind, ": expected tcp or ucx")}});
    *exit_code = 2;
    return absl::InvalidArgumentError("--kv_transport");
  }
  if (const kv::EventLoop& loop = rt.transport->loop(); loop.realtime()) {
    LogEvent("info", "kv_loop_scheduling", {{"class", "fifo"}, {"priority", "1"}});
  } else if (absl::GetFlag(FLAGS_kv_loop_realtime)) {
    LogEvent("warning", "kv_loop_scheduling",
             {{"class", "normal"},
              {"detail", absl::StrCat("SCHED_FIFO refused: ", loop.realtime_refused(),
                                      "; a peer's reservation may wait a scheduler tick behind compute on the "
                                      "transport's core")}});
  }
  absl::StatusOr<WorkerModel> w = LoadWorkerModel(&rt.transport->region_allocator());
  if (!w.ok()) {
    LogEvent("error", "load_failed", {{"error", std::string(w.status().message())}});
    *exit_code = absl::IsInvalidArgument(w.status()) ? 2 : 1;
    return w.status();
  }
  rt.engine = *std::move(w);
  // The loop goes round at least this often even when idle, so the health
  // check can tell a quiet transport from a wedged one.
  rt.transport->loop().AddTicker(absl::Milliseconds(250), [] {});
  if (const int n = absl::GetFlag(FLAGS_fault_leak_kv_blocks); n > 0) {
    KvManager& kv = *rt.engine.engine.kv;
    rt.leaked_kv = kv.NewSequence();
    const absl::Status leaked = kv.Grow(rt.leaked_kv, n * kv.spec().block_size);
    LogEvent("warning", "fault_leak_kv_blocks", {{"blocks", std::to_string(n)}, {"ok", leaked.ok() ? "true" : "false"}});
  }
  if (const int64_t n = absl::GetFlag(FLAGS_fault_tp_collective_after); n > 0) {
    kernels::cpu::ThreadCollectiveGroup* group = rt.engine.engine.model->tp_group();
    if (group == nullptr) {
      *exit_code = 2;
      return absl::InvalidArgumentError("--fault_tp_collective_after needs --tp > 1");
    }
    group->InjectFailure(n, absl::UnavailableError("injected fault: a tensor-parallel rank's link failed"));
    LogEvent("warning", "fault_tp_collective", {{"after", std::to_string(n)}});
  }
  if (const double s = absl::GetFlag(FLAGS_fault_wedge_kv_after_s); s > 0) {
    kv::EventLoop* loop = &rt.transport->loop();
    std::thread([loop, s] {
      absl::SleepFor(absl::Seconds(s));
      LogEvent("warning", "fault_wedge_kv_loop");
      loop->Post([] {
        for (;;) absl::SleepFor(absl::Hours(1));
      });
    }).detach();
  }
  return rt;
}

void CheckWorkerTransport(WorkerRuntime& rt, const std::string& host) {
  if (host.empty() && rt.ucx == nullptr) {
    // Plain sockets reach any address the kernel routes: loopback shows
    // that the transport itself works.
    rt.transport_check =
        std::make_unique<kv::TransportSelfCheck>(rt.transport.get(), kv::SelfCheckOptions{.host = "127.0.0.1"});
  } else if (host.empty()) {
    absl::StatusOr<std::string> connectable = rt.ucx->ConnectableHost();
    if (!connectable.ok()) {
      rt.transport_check = std::make_unique<kv::TransportSelfCheck>(
          absl::UnavailableError(absl::StrCat("KV handoff self-check cannot run: ", connectable.status().message())));
    } else {
      rt.transport_check =
          std::make_unique<kv::TransportSelfCheck>(rt.transport.get(), kv::SelfCheckOptions{.host = *connectable});
    }
  } else {
    rt.transport_check =
        std::make_unique<kv::TransportSelfCheck>(rt.transport.get(), kv::SelfCheckOptions{.host = host});
  }
  if (const std::string why = rt.transport_check->reason(); !why.empty()) {
    LogEvent("error", "kv_transport_unusable", {{"error", why}});
  }
}

grammar::GrammarOptions GrammarOptionsFromFlags() {
  grammar::GrammarOptions g;
  g.schema.max_schema_bytes = absl::GetFlag(FLAGS_grammar_max_schema_bytes);
  g.schema.max_nodes = absl::GetFlag(FLAGS_grammar_max_nodes);
  g.schema.max_depth = absl::GetFlag(FLAGS_grammar_max_depth);
  g.max_mask_states = absl::GetFlag(FLAGS_grammar_mask_states);
  g.max_grammars = absl::GetFlag(FLAGS_grammar_cache_size);
  g.max_mask_bytes = absl::GetFlag(FLAGS_grammar_mask_bytes);
  return g;
}

void ApplyRequestLifeFlags(engine::EngineOptions& options) {
  options.life_base = absl::Seconds(absl::GetFlag(FLAGS_request_life_base_s));
  options.life_step_factor = absl::GetFlag(FLAGS_request_life_step_factor);
  options.life_min_per_token = absl::Milliseconds(absl::GetFlag(FLAGS_request_life_min_token_ms));
}

void AddKvPoolMetrics(MetricsRegistry& metrics, const KvManager* kv) {
  metrics.AddGauge("pdserve_kv_blocks", "KV blocks by state.",
                   [kv] { return static_cast<double>(kv->Counts().used); }, "state=\"used\"");
  metrics.AddGauge("pdserve_kv_blocks", "KV blocks by state.",
                   [kv] { return static_cast<double>(kv->Counts().free); }, "state=\"free\"");
  // The layout: constant for the worker's life.
  const KvCacheSpec spec = kv->spec();
  metrics.AddGauge("pdserve_tp_ranks", "Tensor-parallel ranks of the worker's model (1: not sharded).",
                   [spec] { return static_cast<double>(spec.num_ranks); });
  metrics.AddGauge("pdserve_kv_bytes_per_position_per_rank",
                   "KV bytes one position takes on one rank (what pdctl plan counts per chip).",
                   [spec] { return static_cast<double>(spec.BytesPerPosition()); });
}

void AddGrantRefusalMetrics(MetricsRegistry& metrics, const kv::KvReceiver* receiver) {
  for (int k = 1; k < kv::kGrantRefusalKinds; ++k) {
    const auto why = static_cast<kv::GrantRefusal>(k);
    metrics.AddCounterFunc("pdserve_handoff_refusals_total",
                           "Reservations and commits refused: no, a bad, an expired, a foreign or a reused grant; "
                           "a commit from another connection or for another request.",
                           [receiver, why] { return static_cast<double>(receiver->refusals(why)); },
                           absl::StrCat("reason=\"", kv::GrantRefusalName(why), "\""));
  }
}

void AddKvTier2Metrics(MetricsRegistry& metrics, const Tier2Store* tier2) {
  auto stat = [tier2](auto read) { return [tier2, read] { return static_cast<double>(read(tier2->Stats())); }; };
  metrics.AddGauge("pdserve_kv_tier2_bytes", "Bytes of block files the prefix cache's second tier holds.",
                   stat([](const Tier2Stats& s) { return s.bytes; }));
  metrics.AddGauge("pdserve_kv_tier2_capacity_bytes", "The second tier's capacity (--kv_tier2_bytes).",
                   stat([](const Tier2Stats& s) { return s.capacity_bytes; }));
  metrics.AddGauge("pdserve_kv_tier2_blocks", "Blocks the second tier holds.",
                   stat([](const Tier2Stats& s) { return s.blocks; }));
  metrics.AddCounterFunc("pdserve_kv_tier2_restored_blocks_total",
                         "Blocks read back from the second tier, verified, into the pool (prefix hits in tier 2).",
                         stat([](const Tier2Stats& s) { return s.restored_blocks; }));
  metrics.AddCounterFunc("pdserve_kv_tier2_restore_misses_total",
                         "Blocks a restore asked for and did not get (gone by then, or failed their check).",
                         stat([](const Tier2Stats& s) { return s.restore_misses; }));
  metrics.AddCounterFunc("pdserve_kv_tier2_writes_total", "Blocks offered to the second tier, by outcome.",
                         stat([](const Tier2Stats& s) { return s.writes; }), "result=\"written\"");
  metrics.AddCounterFunc("pdserve_kv_tier2_writes_total", "Blocks offered to the second tier, by outcome.",
                         stat([](const Tier2Stats& s) { return s.write_drops; }), "result=\"dropped\"");
  metrics.AddCounterFunc("pdserve_kv_tier2_writes_total", "Blocks offered to the second tier, by outcome.",
                         stat([](const Tier2Stats& s) { return s.write_errors; }), "result=\"failed\"");
  metrics.AddCounterFunc("pdserve_kv_tier2_evictions_total", "Block files the second tier deleted for room.",
                         stat([](const Tier2Stats& s) { return s.evictions; }));
  metrics.AddCounterFunc("pdserve_kv_tier2_discarded_files_total",
                         "Block files refused when the second tier opened (truncated, corrupt header, foreign).",
                         stat([](const Tier2Stats& s) { return s.discarded_at_open; }));
  metrics.AddCounterFunc("pdserve_kv_tier2_restores_total", "Second-tier reads completed (one per request).",
                         stat([](const Tier2Stats& s) { return s.restores; }));
  metrics.AddCounterFunc("pdserve_kv_tier2_restore_seconds_total",
                         "Seconds from each second-tier read's start to its end, queueing included.",
                         [tier2] { return tier2->Stats().restore_seconds; });
  metrics.AddCounterFunc("pdserve_kv_checksum_failures_total",
                         "KV blocks whose bytes did not match the checksum recorded by their producer (discarded; "
                         "their positions are computed again), by path.",
                         stat([](const Tier2Stats& s) { return s.checksum_failures; }), "path=\"tier2\"");
}

std::function<std::string()> WorkerHealthCheck(WorkerRuntime& rt,
                                               std::function<bool()> draining, std::function<bool()> idle,
                                               std::function<absl::Status()> engine_failure,
                                               std::function<void(std::string)> publish,
                                               MetricsRegistry* metrics) {
  // The verdict's kind, for pdserve_worker_unhealthy{reason}.
  static constexpr const char* kReasons[] = {"draining", "kv_self_check", "kv_wedged", "kv_leak", "engine_failed"};
  auto kind = std::make_shared<std::atomic<int>>(-1);
  if (metrics != nullptr) {
    for (int i = 0; i < 5; ++i) {
      metrics->AddGauge(
          "pdserve_worker_unhealthy", "1 for why the worker does not serve now (0 everywhere while it serves).",
          [kind, i] { return kind->load() == i ? 1.0 : 0.0; }, absl::StrCat("reason=\"", kReasons[i], "\""));
    }
  }
  if (metrics != nullptr) {
    const bool realtime = rt.transport->loop().realtime();
    metrics->AddGauge("pdserve_kv_loop_realtime",
                      "1 when the KV transport's loop runs in SCHED_FIFO (--kv_loop_realtime), 0 in the normal class.",
                      [realtime] { return realtime ? 1.0 : 0.0; });
  }
  auto judge = std::make_shared<HealthJudge>(HealthOptions{
      .leak_grace = absl::Seconds(absl::GetFlag(FLAGS_leak_grace_s)),
      .wedge_after = absl::Seconds(absl::GetFlag(FLAGS_wedge_after_s))});
  kv::EventLoop* loop = &rt.transport->loop();
  const kv::TransportSelfCheck* check = rt.transport_check.get();
  const KvManager* kv = rt.engine.engine.kv.get();
  return [=] {
    if (absl::Status failed = engine_failure(); !failed.ok()) {
      std::string why = absl::StrCat("engine stopped: ", failed.message());
      kind->store(4);
      publish(why);
      return why;
    }
    HealthInputs in;
    in.draining = draining();
    if (check != nullptr) in.transport_error = check->reason();
    in.idle = idle();
    in.kv_blocks_used = kv->Counts().used;
    in.idle = in.idle && idle();  // Still idle after the count: the blocks are nobody's.
    in.transport_beat = loop->last_beat();
    std::string why = judge->Judge(in, absl::Now());
    kind->store(why.empty()                                   ? -1
                : why == "draining"                           ? 0
                : absl::StartsWith(why, "KV transport wedged") ? 2
                : absl::StartsWith(why, "KV pool leak")        ? 3
                                                              : 1);
    publish(why);
    return why;
  };
}

}  // namespace pdserve
