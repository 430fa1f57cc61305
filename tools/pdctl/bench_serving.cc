#include "tools/pdctl/bench_serving.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/generation.h"
#include "decode_worker/batch_engine.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tools/pdctl/engine_setup.h"

namespace pdserve::pdctl {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Work {
  std::vector<int32_t> prompt;
  int32_t max_tokens = 0;
  double arrival = 0;  // Seconds after the start (rate mode).
};

// What one request saw, on the client's clock.
struct Sample {
  bool ok = false;
  std::string error;
  double ttft = 0, e2e = 0;
  std::vector<double> itl;  // Per token after the first.
  int32_t tokens = 0;
  double relay_p50 = -1, relay_p99 = -1;  // Router-reported, when known.
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// Records chunk arrivals: a chunk of n tokens after a gap g counts as n
// inter-token gaps of g / n.
struct Recorder {
  Clock::time_point sent, last;
  Sample s;
  void Chunk(int n, Clock::time_point now) {
    if (n <= 0) return;
    if (s.tokens == 0) {
      s.ttft = Seconds(sent, now);
      for (int i = 1; i < n; ++i) s.itl.push_back(0);
    } else {
      const double g = Seconds(last, now) / n;
      for (int i = 0; i < n; ++i) s.itl.push_back(g);
    }
    s.tokens += n;
    last = now;
  }
};

class Target {
 public:
  virtual ~Target() = default;
  virtual Sample Run(const Work& w) = 0;
};

class RouterTarget final : public Target {
 public:
  explicit RouterTarget(const std::string& address)
      : stub_(v1::Generation::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}
  Sample Run(const Work& w) override {
    v1::GenerateRequest req;
    req.mutable_token_ids()->mutable_ids()->Assign(w.prompt.begin(), w.prompt.end());
    req.set_max_tokens(w.max_tokens);
    req.set_ignore_eos(true);
    req.mutable_sampling()->set_temperature(0);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
    Recorder r;
    r.sent = Clock::now();
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse m;
    while (reader->Read(&m)) {
      if (m.has_chunk()) r.Chunk(m.chunk().token_ids_size(), Clock::now());
      if (m.has_final() && m.final().finish_reason() == v1::FINISH_REASON_ERROR) r.s.error = m.final().error();
      if (m.has_final()) {
        r.s.relay_p50 = m.final().timings().router_relay_p50();
        r.s.relay_p99 = m.final().timings().router_relay_p99();
      }
    }
    const grpc::Status st = reader->Finish();
    r.s.e2e = Seconds(r.sent, Clock::now());
    if (!st.ok()) r.s.error = st.error_message();
    r.s.ok = r.s.error.empty() && r.s.tokens == w.max_tokens;
    return std::move(r.s);
  }
  int32_t VocabSize() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ListModelsResponse out;
    if (!stub_->ListModels(&ctx, {}, &out).ok() || out.models().empty()) return 0;
    return out.models(0).vocab_size();
  }

 private:
  std::unique_ptr<v1::Generation::Stub> stub_;
};

// The same workload through the continuous-batching engine in this process.
class InProcessTarget final : public Target {
 public:
  static absl::StatusOr<std::unique_ptr<InProcessTarget>> Create(const std::string& model_dir, int threads) {
    EngineOptions eo;
    eo.model_dir = model_dir;
    eo.threads = threads;
    eo.kv_positions = 65536;
    absl::StatusOr<Engine> e = MakeEngine(eo);
    if (!e.ok()) return e.status();
    return std::unique_ptr<InProcessTarget>(new InProcessTarget(*std::move(e)));
  }
  ~InProcessTarget() override {
    stop_ = true;
    loop_.join();
  }
  Sample Run(const Work& w) override {
    GenerationRequest gr;
    gr.prompt = w.prompt;
    gr.params.temperature = 0;
    gr.params.max_tokens = w.max_tokens;
    gr.params.ignore_eos = true;
    gr.params.seed = 1;
    struct Shared {
      absl::Mutex mu;
      Recorder r;
      bool done = false;
    };
    auto sh = std::make_shared<Shared>();
    sh->r.sent = Clock::now();
    engine_->SubmitPrefill(next_++, std::make_unique<Generation>(std::move(gr), nullptr),
                           [sh](const EngineEvent& e) {
                             absl::MutexLock lock(&sh->mu);
                             if (!e.status.ok()) {
                               sh->r.s.error = std::string(e.status.message());
                               sh->done = true;
                               return;
                             }
                             sh->r.Chunk(1, Clock::now());
                             if (e.token.finish != FinishReason::kNone) sh->done = true;
                           });
    absl::MutexLock lock(&sh->mu);
    sh->mu.Await(absl::Condition(&sh->done));
    sh->r.s.e2e = Seconds(sh->r.sent, Clock::now());
    sh->r.s.ok = sh->r.s.error.empty();
    return sh->r.s;
  }

 private:
  explicit InProcessTarget(Engine e) : e_(std::move(e)) {
    engine_ = std::make_unique<BatchEngine>(*e_.model, *e_.pool, BatchEngineOptions{.max_batch = 256});
    loop_ = std::thread([this] {
      while (!stop_) {
        absl::StatusOr<bool> r = engine_->Step();
        if (!r.ok() || !*r) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
  }
  Engine e_;
  std::unique_ptr<BatchEngine> engine_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> next_{1};
  std::thread loop_;
};

nlohmann::ordered_json Drive(Target& target, const std::vector<Work>& work, const ServingBenchOptions& o,
                             const std::string& name) {
  std::vector<Sample> samples(work.size());
  std::atomic<size_t> next{0};
  std::atomic<int> done{0};
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  auto progress = std::thread([&] {
    while (done.load() < static_cast<int>(work.size())) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      std::fprintf(stderr, "bench %s: %d/%zu done, %.0f s\n", name.c_str(), done.load(), work.size(),
                   Seconds(start, Clock::now()));
    }
  });
  if (o.rate > 0) {
    // Open loop: one thread per request, started at its arrival time.
    for (size_t i = 0; i < work.size(); ++i) {
      const auto at = start + std::chrono::microseconds(static_cast<int64_t>(work[i].arrival * 1e6));
      std::this_thread::sleep_until(at);
      threads.emplace_back([&, i] {
        samples[i] = target.Run(work[i]);
        ++done;
      });
    }
  } else {
    for (int c = 0; c < o.concurrency; ++c) {
      threads.emplace_back([&] {
        for (size_t i = next++; i < work.size(); i = next++) {
          samples[i] = target.Run(work[i]);
          ++done;
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  const double wall = Seconds(start, Clock::now());
  progress.join();
  std::vector<double> ttft, itl, e2e, relay50, relay99;
  int64_t tokens = 0;
  int failed = 0;
  std::string first_error;
  for (const Sample& s : samples) {
    if (!s.ok) {
      ++failed;
      if (first_error.empty()) first_error = s.error;
      continue;
    }
    ttft.push_back(s.ttft);
    e2e.push_back(s.e2e);
    itl.insert(itl.end(), s.itl.begin(), s.itl.end());
    tokens += s.tokens;
    if (s.relay_p50 >= 0) {
      relay50.push_back(s.relay_p50);
      relay99.push_back(s.relay_p99);
    }
  }
  auto pct = [](const std::vector<double>& v) {
    return nlohmann::ordered_json{{"p50", Percentile(v, 0.5)}, {"p90", Percentile(v, 0.9)}, {"p99", Percentile(v, 0.99)}};
  };
  nlohmann::ordered_json r = {{"target", name},
                              {"requests", work.size()},
                              {"failed", failed},
                              {"wall_seconds", wall},
                              {"output_tokens_per_second", tokens / wall},
                              {"requests_per_second", (work.size() - failed) / wall},
                              {"ttft_seconds", pct(ttft)},
                              {"itl_seconds", pct(itl)},
                              {"e2e_seconds", pct(e2e)}};
  if (!relay50.empty()) {
    // Per request the router reports its relay p50/p99; across requests:
    // the median of the medians and the largest p99.
    r["router_relay_seconds"] = {{"p50", Percentile(relay50, 0.5)},
                                 {"p99", *std::max_element(relay99.begin(), relay99.end())}};
  }
  if (!first_error.empty()) r["first_error"] = first_error;
  return r;
}

}  // namespace

absl::Status RunServingBench(const ServingBenchOptions& o) {
  if (o.router.empty()) return absl::InvalidArgumentError("bench needs --router HOST:PORT");
  if (o.requests < 1) return absl::InvalidArgumentError("--requests must be at least 1");
  if (o.rate <= 0 && o.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be at least 1");
  if (o.prompt_min < 1 || o.prompt_max < o.prompt_min) return absl::InvalidArgumentError("--prompt-len: need 1 <= min <= max");
  if (o.output_min < 1 || o.output_max < o.output_min) return absl::InvalidArgumentError("--output-len: need 1 <= min <= max");
  RouterTarget router(o.router);
  const int32_t vocab = router.VocabSize();
  if (vocab <= 0) return absl::UnavailableError(absl::StrCat("router ", o.router, ": ListModels failed"));
  std::mt19937_64 rng(o.seed);
  std::vector<Work> work(o.requests);
  double t = 0;
  std::exponential_distribution<double> gap(o.rate > 0 ? o.rate : 1.0);
  for (Work& w : work) {
    const int n = std::uniform_int_distribution<int>(o.prompt_min, o.prompt_max)(rng);
    for (int i = 0; i < n; ++i) w.prompt.push_back(static_cast<int32_t>(rng() % vocab));
    w.max_tokens = std::uniform_int_distribution<int>(o.output_min, o.output_max)(rng);
    if (o.rate > 0) {
      w.arrival = t;
      t += gap(rng);
    }
  }
  nlohmann::ordered_json out;
  out["workload"] = {{"requests", o.requests},        {"concurrency", o.rate > 0 ? 0 : o.concurrency},
                     {"rate", o.rate},                {"prompt_tokens", {o.prompt_min, o.prompt_max}},
                     {"output_tokens", {o.output_min, o.output_max}}};
  nlohmann::ordered_json runs = nlohmann::ordered_json::array();
  runs.push_back(Drive(router, work, o, "cluster"));
  if (!o.in_process_model.empty()) {
    absl::StatusOr<std::unique_ptr<InProcessTarget>> ip = InProcessTarget::Create(o.in_process_model, o.in_process_threads);
    if (!ip.ok()) return ip.status();
    runs.push_back(Drive(**ip, work, o, "in-process"));
  }
  out["runs"] = runs;
  if (o.json) {
    std::printf("%s\n", out.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("%d requests, %s, prompt %d-%d tokens, output %d-%d tokens\n", o.requests,
              o.rate > 0 ? absl::StrCat("Poisson ", o.rate, " req/s").c_str()
                         : absl::StrCat("concurrency ", o.concurrency).c_str(),
              o.prompt_min, o.prompt_max, o.output_min, o.output_max);
  std::printf("%-11s %6s %9s %9s   %-26s %-26s %-26s\n", "target", "failed", "tok/s", "req/s", "TTFT ms p50/p90/p99",
              "ITL ms p50/p90/p99", "E2E ms p50/p90/p99");
  for (const auto& r : runs) {
    auto f = [&](const char* k) {
      const auto& p = r[k];
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.2f/%.2f/%.2f", 1e3 * p["p50"].get<double>(), 1e3 * p["p90"].get<double>(),
                    1e3 * p["p99"].get<double>());
      return std::string(buf);
    };
    std::printf("%-11s %6d %9.1f %9.2f   %-26s %-26s %-26s\n", r["target"].get<std::string>().c_str(),
                r["failed"].get<int>(), r["output_tokens_per_second"].get<double>(),
                r["requests_per_second"].get<double>(), f("ttft_seconds").c_str(), f("itl_seconds").c_str(),
                f("e2e_seconds").c_str());
    if (r.contains("router_relay_seconds")) {
      std::printf("  router relay per message: p50 %.1f us, p99 %.1f us\n",
                  1e6 * r["router_relay_seconds"]["p50"].get<double>(), 1e6 * r["router_relay_seconds"]["p99"].get<double>());
    }
    if (r.contains("first_error")) std::printf("  first error: %s\n", r["first_error"].get<std::string>().c_str());
  }
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
