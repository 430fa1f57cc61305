#include "tools/pdctl/bench_serving.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include <event2/buffer.h>
#include <event2/bufferevent_ssl.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "engine/generation.h"
#include "engine/engine.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tools/pdctl/bench_results.h"
#include "tools/pdctl/cluster_commands.h"
#include "tools/pdctl/bench_svg.h"
#include "tools/pdctl/bench_trace.h"
#include "tools/pdctl/bench_workload.h"
#include "engine/model_stack.h"

namespace pdserve::pdctl {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Records chunk arrivals: a chunk of n tokens after a gap g counts as n
// inter-token gaps of g / n.
struct Recorder {
  Clock::time_point sent, last;
  RequestResult s;
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
  // Settles the outcome once the stream has ended.
  void Finish(bool rejected, int32_t max_tokens) {
    if (rejected) {
      s.outcome = RequestOutcome::kRejected;
    } else if (s.error.empty() && s.tokens == max_tokens) {
      s.outcome = RequestOutcome::kCompleted;
    } else {
      s.outcome = RequestOutcome::kFailed;
      if (s.error.empty()) s.error = absl::StrCat("the stream ended after ", s.tokens, " of ", max_tokens, " tokens");
    }
  }
};

class Target {
 public:
  virtual ~Target() = default;
  virtual RequestResult Run(const WorkloadRequest& w) = 0;
};

class RouterTarget final : public Target {
 public:
  explicit RouterTarget(const std::string& address)
      : stub_(v1::Generation::NewStub(RouterChannel(address))) {}
  RequestResult Run(const WorkloadRequest& w) override {
    v1::GenerateRequest req;
    req.mutable_token_ids()->mutable_ids()->Assign(w.prompt.begin(), w.prompt.end());
    req.set_max_tokens(w.max_tokens);
    req.set_ignore_eos(true);
    req.mutable_sampling()->set_temperature(0);
    grpc::ClientContext ctx;
    AddApiKey(ctx);
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
        r.s.prompt_tokens = m.final().usage().prompt_tokens();
        r.s.cached_prompt_tokens = m.final().timings().cached_prompt_tokens();
        r.s.local_prefill = m.final().timings().local_prefill();
      }
    }
    const grpc::Status st = reader->Finish();
    r.s.e2e = Seconds(r.sent, Clock::now());
    if (!st.ok()) r.s.error = st.error_message();
    r.Finish(st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED, w.max_tokens);
    return std::move(r.s);
  }
  absl::StatusOr<v1::ClusterStatusResponse> ClusterStatus() {
    grpc::ClientContext ctx;
    AddApiKey(ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ClusterStatusResponse out;
    const grpc::Status st = stub_->ClusterStatus(&ctx, {}, &out);
    if (!st.ok()) return absl::UnavailableError(absl::StrCat("ClusterStatus failed: ", st.error_message()));
    return out;
  }
  // The served model's vocabulary size, or why ListModels failed.
  absl::StatusOr<int32_t> VocabSize() {
    grpc::ClientContext ctx;
    AddApiKey(ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ListModelsResponse out;
    const grpc::Status st = stub_->ListModels(&ctx, {}, &out);
    if (!st.ok()) {
      return absl::UnavailableError(absl::StrCat("ListModels failed: ", st.error_message(), " (code ",
                                                 static_cast<int>(st.error_code()), ")"));
    }
    if (out.models().empty()) return absl::UnavailableError("ListModels listed no model");
    return out.models(0).vocab_size();
  }

 private:
  std::unique_ptr<v1::Generation::Stub> stub_;
};

// The same requests through the router's OpenAI HTTP API: POST
// /v1/completions with the prompt as token ids, streamed, usage included.
// libevent's HTTP client, one keep-alive connection per driving thread.
// Each SSE event is one chunk the router relayed (one token, unless the
// decode worker sent several at once: then the ITL gaps are as coarse as
// the gRPC row's would be for the same chunk).
class OpenAiTarget final : public Target {
 public:
  // `url`: http://HOST:PORT or https://HOST:PORT, with or without a
  // trailing /v1; https checks the server against `ca` (PEM).
  static absl::StatusOr<std::unique_ptr<OpenAiTarget>> Create(const std::string& url, const std::string& ca) {
    absl::string_view rest = url;
    const bool https = absl::ConsumePrefix(&rest, "https://");
    if (!https && !absl::ConsumePrefix(&rest, "http://")) {
      return absl::InvalidArgumentError(absl::StrCat("--openai: '", url, "' does not start with http:// or https://"));
    }
    absl::ConsumeSuffix(&rest, "/");
    absl::ConsumeSuffix(&rest, "/v1");
    const size_t colon = rest.rfind(':');
    int port = 0;
    if (colon == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(colon + 1), &port) || port <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("--openai: '", url, "': expected http://HOST:PORT[/v1]"));
    }
    std::string host(rest.substr(0, colon));
    if (absl::StartsWith(host, "[")) host = host.substr(1, host.size() - 2);
    auto t = std::unique_ptr<OpenAiTarget>(new OpenAiTarget(std::move(host), port));
    if (https) {
      if (ca.empty()) return absl::InvalidArgumentError("--openai https://...: give --tls_ca (the server's CA)");
      t->ssl_ctx_ = SSL_CTX_new(TLS_client_method());
      SSL_CTX_set_verify(t->ssl_ctx_, SSL_VERIFY_PEER, nullptr);
      if (SSL_CTX_load_verify_locations(t->ssl_ctx_, ca.c_str(), nullptr) != 1) {
        return absl::InvalidArgumentError(absl::StrCat("--tls_ca ", ca, ": cannot be loaded"));
      }
    }
    return t;
  }
  ~OpenAiTarget() override {
    if (ssl_ctx_ != nullptr) SSL_CTX_free(ssl_ctx_);
  }

  // The model's vocabulary size from GET /v1/models (0: failed).
  int32_t VocabSize() {
    Exchange x = Send(EVHTTP_REQ_GET, "/v1/models", "");
    const nlohmann::json j = nlohmann::json::parse(x.body, nullptr, false);
    if (x.status != 200 || !j.is_object() || !j.contains("data") || j["data"].empty()) return 0;
    return j["data"][0].value("/pdserve/vocab_size"_json_pointer, 0);
  }

  RequestResult Run(const WorkloadRequest& w) override {
    const nlohmann::json body = {{"prompt", w.prompt},          {"max_tokens", w.max_tokens},
                                 {"ignore_eos", true},          {"temperature", 0},
                                 {"stream", true},              {"stream_options", {{"include_usage", true}}}};
    Recorder r;
    r.sent = Clock::now();
    int32_t completion_tokens = -1;
    Exchange x = Send(EVHTTP_REQ_POST, "/v1/completions", body.dump(), [&](const std::string& event) {
      const nlohmann::json j = nlohmann::json::parse(event, nullptr, false);
      if (!j.is_object()) return;
      if (j.contains("error")) {
        r.s.error = j["error"].value("message", "error event");
        return;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        completion_tokens = j["usage"].value("completion_tokens", -1);
        r.s.prompt_tokens = j["usage"].value("prompt_tokens", 0);
        r.s.cached_prompt_tokens = j["usage"].value("/prompt_tokens_details/cached_tokens"_json_pointer, 0);
        const nlohmann::json& t = j["pdserve"]["timings"];
        r.s.relay_p50 = t.value("router_relay_p50_s", -1.0);
        r.s.relay_p99 = t.value("router_relay_p99_s", -1.0);
        r.s.local_prefill = t.value("local_prefill", false);
      }
      if (!j.contains("choices") || j["choices"].empty()) return;
      const nlohmann::json& c = j["choices"][0];
      if (c["finish_reason"].is_null()) r.Chunk(1, Clock::now());
    });
    r.s.e2e = Seconds(r.sent, Clock::now());
    if (x.status != 200 && r.s.error.empty()) {
      const nlohmann::json j = nlohmann::json::parse(x.body, nullptr, false);
      r.s.error = j.is_object() && j.contains("error") ? j["error"].value("message", x.body)
                                                       : absl::StrCat("HTTP ", x.status, " ", x.body);
    }
    // Chunks of several tokens: the usage count is the truth.
    if (completion_tokens > r.s.tokens && r.s.error.empty()) r.s.tokens = completion_tokens;
    r.Finish(x.status == 429, w.max_tokens);
    return std::move(r.s);
  }

 private:
  OpenAiTarget(std::string host, int port) : host_(std::move(host)), port_(port) {}

  struct Exchange {
    int status = 0;
    std::string body;  // not streamed: the whole body
  };
  // This thread's event loop and connection (kept alive across requests).
  struct Conn {
    event_base* base = nullptr;
    evhttp_connection* conn = nullptr;
    ~Conn() {
      if (conn != nullptr) evhttp_connection_free(conn);
      if (base != nullptr) event_base_free(base);
    }
  };
  struct Pending {
    Exchange x;
    std::string sse;  // event-stream bytes not yet split into events
    bool stream = false;
    const std::function<void(const std::string&)>* on_event = nullptr;
    bool done = false;
  };

  static void OnChunk(evhttp_request* req, void* arg) {
    auto* p = static_cast<Pending*>(arg);
    evbuffer* in = evhttp_request_get_input_buffer(req);
    const size_t n = evbuffer_get_length(in);
    std::string bytes(n, '\0');
    evbuffer_remove(in, bytes.data(), n);
    if (evhttp_request_get_response_code(req) != 200 || p->on_event == nullptr) {
      p->x.body += bytes;
      return;
    }
    p->sse += bytes;
    size_t end;
    while ((end = p->sse.find("\n\n")) != std::string::npos) {
      absl::string_view event(p->sse.data(), end);
      if (absl::ConsumePrefix(&event, "data: ") && event != "[DONE]") (*p->on_event)(std::string(event));
      p->sse.erase(0, end + 2);
    }
  }
  static void OnDone(evhttp_request* req, void* arg) {
    auto* p = static_cast<Pending*>(arg);
    p->done = true;
    if (req == nullptr) return;  // connection failed
    p->x.status = evhttp_request_get_response_code(req);
    evbuffer* in = evhttp_request_get_input_buffer(req);
    const size_t n = evbuffer_get_length(in);
    if (n > 0) {
      std::string bytes(n, '\0');
      evbuffer_remove(in, bytes.data(), n);
      p->x.body += bytes;
    }
  }

  Exchange Send(evhttp_cmd_type method, const std::string& path, const std::string& body,
                const std::function<void(const std::string&)>& on_event = nullptr) {
    thread_local std::map<const OpenAiTarget*, std::unique_ptr<Conn>> conns;
    std::unique_ptr<Conn>& c = conns[this];
    if (c == nullptr) {
      c = std::make_unique<Conn>();
      c->base = event_base_new();
      if (ssl_ctx_ == nullptr) {
        c->conn = evhttp_connection_base_new(c->base, nullptr, host_.c_str(), static_cast<uint16_t>(port_));
      } else {
        // TLS, the server's certificate checked against the CA and the host.
        SSL* ssl = SSL_new(ssl_ctx_);
        SSL_set_tlsext_host_name(ssl, host_.c_str());
        X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
        if (X509_VERIFY_PARAM_set1_ip_asc(param, host_.c_str()) != 1) X509_VERIFY_PARAM_set1_host(param, host_.c_str(), 0);
        bufferevent* bev = bufferevent_openssl_socket_new(c->base, -1, ssl, BUFFEREVENT_SSL_CONNECTING,
                                                          BEV_OPT_CLOSE_ON_FREE | BEV_OPT_DEFER_CALLBACKS);
        c->conn = evhttp_connection_base_bufferevent_new(c->base, nullptr, bev, host_.c_str(),
                                                         static_cast<uint16_t>(port_));
      }
      evhttp_connection_set_timeout(c->conn, 600);
    }
    Pending p;
    if (on_event) p.on_event = &on_event;
    evhttp_request* req = evhttp_request_new(&OnDone, &p);
    evhttp_request_set_chunked_cb(req, &OnChunk);
    evkeyvalq* h = evhttp_request_get_output_headers(req);
    const std::string host = absl::StrCat(host_, ":", port_);
    evhttp_add_header(h, "Host", host.c_str());
    if (method == EVHTTP_REQ_POST) {
      evhttp_add_header(h, "Content-Type", "application/json");
      evbuffer_add(evhttp_request_get_output_buffer(req), body.data(), body.size());
    }
    if (evhttp_make_request(c->conn, req, method, path.c_str()) != 0) return p.x;
    while (!p.done) event_base_loop(c->base, EVLOOP_ONCE);
    return p.x;
  }

  const std::string host_;
  const int port_;
  SSL_CTX* ssl_ctx_ = nullptr;  // https
};

// The same workload through the continuous-batching engine in this process.
class InProcessTarget final : public Target {
 public:
  static absl::StatusOr<std::unique_ptr<InProcessTarget>> Create(const std::string& model_dir, int threads) {
    ModelStackOptions eo;
    eo.model_dir = model_dir;
    eo.threads = threads;
    eo.kv_positions = 65536;
    absl::StatusOr<ModelStack> e = LoadModelStack(eo);
    if (!e.ok()) return e.status();
    return std::unique_ptr<InProcessTarget>(new InProcessTarget(*std::move(e)));
  }
  ~InProcessTarget() override { engine_->Stop(); }
  RequestResult Run(const WorkloadRequest& w) override {
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
      bool rejected = false;
    };
    auto sh = std::make_shared<Shared>();
    sh->r.sent = Clock::now();
    engine::RequestCallbacks c;
    c.on_token = [sh](const TokenEvent&, int32_t) {
      absl::MutexLock lock(&sh->mu);
      sh->r.Chunk(1, Clock::now());
    };
    c.on_end = [sh](const absl::Status& s) {
      absl::MutexLock lock(&sh->mu);
      if (!s.ok()) {
        sh->r.s.error = std::string(s.message());
        sh->rejected = absl::IsResourceExhausted(s);
      }
      sh->done = true;
    };
    engine_->Submit(std::make_shared<engine::Request>(engine::RequestId(absl::StrCat("bench-", next_++)),
                                                      engine::RequestMode::kLocal,
                                                      std::make_unique<Generation>(std::move(gr), nullptr), c));
    absl::MutexLock lock(&sh->mu);
    sh->mu.Await(absl::Condition(&sh->done));
    sh->r.s.e2e = Seconds(sh->r.sent, Clock::now());
    sh->r.Finish(sh->rejected, w.max_tokens);
    return sh->r.s;
  }

 private:
  explicit InProcessTarget(ModelStack e) : e_(std::move(e)) {
    engine_ = std::make_unique<engine::Engine>(*e_.model, *e_.kv, engine::EngineOptions{.max_batch = 256});
    engine_->Start();
  }
  ModelStack e_;
  std::unique_ptr<engine::Engine> engine_;
  std::atomic<uint64_t> next_{1};
};

// One run of `work` against `target`: open loop at `arrivals` (seconds after
// the start), or closed loop at `concurrency` when arrivals is empty.
BenchRow Drive(Target& target, const std::vector<WorkloadRequest>& work, const std::vector<double>& arrivals,
               int concurrency, const LatencyTargets& targets, const std::string& name,
               std::vector<std::vector<double>>* token_times = nullptr) {
  std::vector<RequestResult> results(work.size());
  std::vector<double> sent_at(work.size());
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
  if (!arrivals.empty()) {
    // Open loop: one thread per request, started at its arrival time.
    for (size_t i = 0; i < work.size(); ++i) {
      const auto at = start + std::chrono::microseconds(static_cast<int64_t>(arrivals[i] * 1e6));
      std::this_thread::sleep_until(at);
      threads.emplace_back([&, i] {
        sent_at[i] = Seconds(start, Clock::now());
        results[i] = target.Run(work[i]);
        ++done;
      });
    }
  } else {
    for (int c = 0; c < concurrency; ++c) {
      threads.emplace_back([&] {
        for (size_t i = next++; i < work.size(); i = next++) {
          sent_at[i] = Seconds(start, Clock::now());
          results[i] = target.Run(work[i]);
          ++done;
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  const double wall = Seconds(start, Clock::now());
  progress.join();
  if (token_times != nullptr) {
    // Each completed stream's token arrivals, seconds after the row began.
    for (size_t i = 0; i < results.size(); ++i) {
      const RequestResult& r = results[i];
      if (r.outcome != RequestOutcome::kCompleted) continue;
      std::vector<double>& t = token_times->emplace_back();
      t.push_back(sent_at[i] + r.ttft);
      for (double gap : r.itl) t.push_back(t.back() + gap);
    }
  }
  return Summarize(results, wall, targets);
}

// The drain of a row (--drain-at): waits until the decode pool runs all
// but one of `streams` sequences, then drain_at seconds more, then
// SIGTERMs the worker. Stops early once Stop is called.
class Drainer {
 public:
  Drainer(RouterTarget* router, const ServingBenchOptions& o, int streams)
      : thread_([this, router, o, streams] { Run(router, o, streams); }) {}
  ~Drainer() { Stop(); }
  void Stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
  }
  double drained_at() const { return drained_at_; }  // Seconds into the row; < 0: never.
  double step_seconds() const { return step_seconds_; }  // The drained worker's pool's slowest step, before.

 private:
  void Run(RouterTarget* router, const ServingBenchOptions& o, int streams) {
    const auto start = Clock::now();
    while (!done_) {
      absl::StatusOr<v1::ClusterStatusResponse> s = router->ClusterStatus();
      int running = 0;
      double step = 0;
      if (s.ok()) {
        for (const v1::WorkerStatus& d : s->decode()) {
          running += d.running();
          step = std::max(step, d.step_seconds());
        }
      }
      // All but one: the first stream may end, or its worker's report lag,
      // just as the last starts.
      if (running >= std::max(1, streams - 1)) {
        step_seconds_ = step;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const auto at = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(o.drain_at * 1e6));
    while (!done_ && Clock::now() < at) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (done_) return;
    if (kill(o.drain_pid, SIGTERM) != 0) {
      std::fprintf(stderr, "bench: SIGTERM to pid %d failed\n", o.drain_pid);
      return;
    }
    drained_at_ = Seconds(start, Clock::now());
    std::fprintf(stderr, "bench: SIGTERM to decode worker pid %d, %.1f s into the run\n", o.drain_pid, drained_at_.load());
  }

  std::atomic<bool> done_{false};
  std::atomic<double> drained_at_{-1};
  std::atomic<double> step_seconds_{0};
  std::thread thread_;
};

// What a drained row went through: each stream's largest gap between two
// tokens from the drain on (the switch, for a stream that moved or was
// replayed; its ordinary gap on the worker that stayed, for the rest), and
// the router's moves, replays and context positions prefilled again
// (beyond each request's own prompt) over the row.
nlohmann::ordered_json DrainReport(const BenchRow& row, const std::vector<std::vector<double>>& token_times,
                                   const Drainer& d, const v1::ClusterStatusResponse& before,
                                   const v1::ClusterStatusResponse& after) {
  std::vector<double> gaps;
  for (const std::vector<double>& t : token_times) {
    double largest = -1;
    for (size_t i = 1; i < t.size(); ++i) {
      if (t[i] >= d.drained_at()) largest = std::max(largest, t[i] - t[i - 1]);
    }
    if (largest >= 0) gaps.push_back(largest);
  }
  const int64_t moves = after.decode_moves() - before.decode_moves();
  const double move_seconds = after.decode_move_seconds() - before.decode_move_seconds();
  const int64_t move_bytes = after.decode_move_bytes() - before.decode_move_bytes();
  const int64_t context = after.prefill_context_tokens() - before.prefill_context_tokens();
  const int64_t cached = after.prefix_cached_tokens() - before.prefix_cached_tokens();
  std::sort(gaps.begin(), gaps.end());
  auto at = [&gaps](double p) {
    return gaps.empty() ? 0.0 : gaps[std::min(gaps.size() - 1, static_cast<size_t>(p * (gaps.size() - 1) + 0.5))];
  };
  const double per_move = moves > 0 ? move_seconds / static_cast<double>(moves) : 0;
  return {{"drained_at_seconds", d.drained_at()},
          {"streams", gaps.size()},
          {"largest_gap_seconds", {{"p50", at(0.5)}, {"p75", at(0.75)}, {"max", at(1.0)}}},
          {"moves", moves},
          {"moves_replayed", after.decode_moves_replayed() - before.decode_moves_replayed()},
          {"replays", after.migrations() - before.migrations()},
          {"move_bytes", move_bytes},
          {"move_bytes_per_second", move_seconds > 0 ? static_cast<double>(move_bytes) / move_seconds : 0.0},
          {"context_positions_prefilled_again", context - row.prompt_tokens},
          {"positions_computed_again", (context - cached) - (row.prompt_tokens - row.cached_prompt_tokens)},
          {"decode_step_seconds", d.step_seconds()},
          {"stall_bound_seconds", 3 * d.step_seconds() + per_move}};
}

void PrintDrain(const BenchRow& row) {
  const nlohmann::ordered_json& r = row.drain;
  if (r.empty()) return;
  if (r["drained_at_seconds"].get<double>() < 0) {
    std::printf("  drain: the run ended before the drain came (lower --drain-at, or raise --output-tokens)\n");
    return;
  }
  const nlohmann::ordered_json& g = r["largest_gap_seconds"];
  std::printf(
      "  drain at %.1f s: each stream's largest inter-token gap from then on (%d streams) p50 %.1f ms, p75 %.1f ms, "
      "max %.1f ms",
      r["drained_at_seconds"].get<double>(), r["streams"].get<int>(), 1e3 * g["p50"].get<double>(),
      1e3 * g["p75"].get<double>(), 1e3 * g["max"].get<double>());
  if (r["moves"].get<int64_t>() > 0) {
    // The steps are the pool's slowest before the drain; the target's after
    // it run a larger batch, which the bound does not allow for.
    std::printf("; bound for a move (3 decode steps of %.1f ms before the drain + its KV at the moves' %.2f GB/s) "
                "%.1f ms",
                1e3 * r["decode_step_seconds"].get<double>(), r["move_bytes_per_second"].get<double>() / 1e9,
                1e3 * r["stall_bound_seconds"].get<double>());
  }
  std::printf("\n");
  std::printf(
      "  drain: moved %lld (%.1f MiB of KV), replayed %lld (of them %lld whose move failed); context positions "
      "prefilled again %lld, computed again %lld\n",
      static_cast<long long>(r["moves"].get<int64_t>()), static_cast<double>(r["move_bytes"].get<int64_t>()) / (1 << 20),
      static_cast<long long>(r["replays"].get<int64_t>()), static_cast<long long>(r["moves_replayed"].get<int64_t>()),
      static_cast<long long>(r["context_positions_prefilled_again"].get<int64_t>()),
      static_cast<long long>(r["positions_computed_again"].get<int64_t>()));
}

nlohmann::ordered_json Percentiles(const Distribution& d) {
  return {{"p50", d.p50}, {"p90", d.p90}, {"p99", d.p99}};
}

std::string Millis(const Distribution& d) {
  return absl::StrFormat("%.2f/%.2f/%.2f", 1e3 * d.p50, 1e3 * d.p90, 1e3 * d.p99);
}

// The router-reported prefix-cache figures of a row (cluster rows only),
// and the prefill pool's by tier where the row has them.
void PrintPrefixCache(const BenchRow& row) {
  if (row.prompt_tokens <= 0) return;
  std::printf("  prefix cache: %lld of %lld prompt tokens cached (hit rate %.1f %%); decode-local prefills: %d\n",
              static_cast<long long>(row.cached_prompt_tokens), static_cast<long long>(row.prompt_tokens),
              100 * row.prefix_hit_rate(), row.local_prefills);
  if (row.tiers.empty()) return;
  const nlohmann::ordered_json& t = row.tiers;
  const double blocks = std::max<double>(1, t["prompt_blocks"].get<double>());
  std::printf(
      "  prefill prefix cache by tier: %lld of %lld prompt blocks hit in the pools (%.1f %%), %lld read back from "
      "tier 2 (%.1f %%); pulls from another worker put %lld blocks in the pools (each pull's whole prefix)\n",
      static_cast<long long>(t["pool_hit_blocks"].get<int64_t>()),
      static_cast<long long>(t["prompt_blocks"].get<int64_t>()), 100 * t["pool_hit_blocks"].get<double>() / blocks,
      static_cast<long long>(t["tier2_restored_blocks"].get<int64_t>()),
      100 * t["tier2_restored_blocks"].get<double>() / blocks,
      static_cast<long long>(t["pulled_blocks"].get<int64_t>()));
}

// The prefill pool's prefix cache over a row: `after` less `before`, per
// tier, beside the row's prompt blocks (in the first prefill worker's
// block size).
nlohmann::ordered_json Tiers(const v1::ClusterStatusResponse& before, const v1::ClusterStatusResponse& after,
                             int64_t prompt_tokens) {
  auto sum = [](const v1::ClusterStatusResponse& s, int64_t (v1::WorkerStatus::*field)() const) {
    int64_t n = 0;
    for (const v1::WorkerStatus& w : s.prefill()) n += (w.*field)();
    return n;
  };
  const int64_t bs = after.prefill_size() > 0 && after.prefill(0).kv_block_size() > 0 ? after.prefill(0).kv_block_size()
                                                                                      : 16;
  return {{"prompt_blocks", prompt_tokens / bs},
          {"pool_hit_blocks",
           sum(after, &v1::WorkerStatus::kv_prefix_hit_blocks) - sum(before, &v1::WorkerStatus::kv_prefix_hit_blocks)},
          {"pulled_blocks",
           sum(after, &v1::WorkerStatus::kv_pulled_blocks) - sum(before, &v1::WorkerStatus::kv_pulled_blocks)},
          {"tier2_restored_blocks", sum(after, &v1::WorkerStatus::kv_tier2_restored_blocks) -
                                        sum(before, &v1::WorkerStatus::kv_tier2_restored_blocks)}};
}

// The single-run report, as pdctl has always printed it (a "rejected" count
// and line appear only when the server rejected requests).
int64_t DiscardedTokens(const v1::ClusterStatusResponse& s) {
  int64_t n = 0;
  for (const v1::WorkerStatus& w : s.prefill()) n += w.prefill_discarded_tokens();
  return n;
}

// The decode pool's tokens and busy seconds (summed over its workers).
std::pair<int64_t, double> DecodeWork(const v1::ClusterStatusResponse& s) {
  int64_t tokens = 0;
  double busy = 0;
  for (const v1::WorkerStatus& w : s.decode()) {
    tokens += w.decode_tokens();
    busy += w.busy_seconds();
  }
  return {tokens, busy};
}

// The router's counters over a row: `after` less `before`. The decode
// pool's rate while busy (its tokens over its engines' working seconds, per worker,
// summed over the pool) is what the decode stage can give at the batches it
// ran: the row's output rate against it says how much of the run the
// cluster kept the decode stage working.
nlohmann::ordered_json RouterSide(const v1::ClusterStatusResponse& before, const v1::ClusterStatusResponse& after) {
  const v1::QueueStatus& qb = before.queue();
  const v1::QueueStatus& qa = after.queue();
  const int64_t waited = qa.placed_waited() - qb.placed_waited();
  const double wait_sum = qa.waited_seconds() - qb.waited_seconds();
  const auto [tokens_before, busy_before] = DecodeWork(before);
  const auto [tokens_after, busy_after] = DecodeWork(after);
  const double busy = busy_after - busy_before;
  const int workers = std::max(1, after.decode_size());
  // Busy seconds are summed over workers that run side by side: the pool's
  // rate is each worker's tokens over its own busy time, i.e. the total over
  // the mean busy time.
  const double decode_rate =
      busy > 0 ? static_cast<double>(tokens_after - tokens_before) / (busy / workers) : 0.0;
  return {{"decode_tokens_per_second_busy", decode_rate},
          {"prefill_ejections", after.prefill_ejections() - before.prefill_ejections()},
          {"decode_ejections", after.decode_ejections() - before.decode_ejections()},
          {"placed", qa.placed() - qb.placed()},
          {"queued_then_placed", waited},
          {"mean_queue_seconds", waited > 0 ? wait_sum / static_cast<double>(waited) : 0.0},
          {"refused_queue_full", qa.refused_full() - qb.refused_full()},
          {"refused_queue_wait", qa.refused_wait() - qb.refused_wait()},
          // Inside the router: its receipt of the request to the refusal.
          {"refused_queue_full_mean_seconds",
           qa.refused_full() > qb.refused_full()
               ? (qa.refused_full_seconds() - qb.refused_full_seconds()) /
                     static_cast<double>(qa.refused_full() - qb.refused_full())
               : 0.0},
          {"refused_queue_full_max_seconds", qa.refused_full_max_seconds()},
          {"prefill_tokens_discarded", DiscardedTokens(after) - DiscardedTokens(before)},
          {"router_peak_resident_bytes", after.router_peak_resident_bytes()}};
}

void PrintRouterSide(const BenchRow& row) {
  const nlohmann::ordered_json& r = row.router_side;
  if (r.empty()) return;
  if (r["refused_queue_full"].get<int64_t>() > 0) {
    std::printf("  refused for a full queue, inside the router (receipt to refusal): mean %.3f ms, max %.3f ms\n",
                1e3 * r["refused_queue_full_mean_seconds"].get<double>(),
                1e3 * r["refused_queue_full_max_seconds"].get<double>());
  }
  if (const double rate = r["decode_tokens_per_second_busy"].get<double>(); rate > 0) {
    std::printf("  decode pool while busy: %.1f tok/s; this row's output rate is %.2fx below it\n", rate,
                row.tokens_per_second > 0 ? rate / row.tokens_per_second : 0.0);
  }
  std::printf(
      "  router side: ejected %lld prefill / %lld decode; %lld placed on workers, %lld of them after queueing (mean "
      "wait %.2f s); refused %lld (queue full) / %lld (waited too long); prefill tokens discarded %lld; router peak "
      "RSS %.0f MiB\n",
      static_cast<long long>(r["prefill_ejections"].get<int64_t>()),
      static_cast<long long>(r["decode_ejections"].get<int64_t>()), static_cast<long long>(r["placed"].get<int64_t>()),
      static_cast<long long>(r["queued_then_placed"].get<int64_t>()), r["mean_queue_seconds"].get<double>(),
      static_cast<long long>(r["refused_queue_full"].get<int64_t>()),
      static_cast<long long>(r["refused_queue_wait"].get<int64_t>()),
      static_cast<long long>(r["prefill_tokens_discarded"].get<int64_t>()),
      static_cast<double>(r["router_peak_resident_bytes"].get<int64_t>()) / (1 << 20));
}

void PrintSingleRun(const ServingBenchOptions& o, const std::vector<BenchRow>& rows) {
  nlohmann::ordered_json runs = nlohmann::ordered_json::array();
  for (const BenchRow& row : rows) {
    nlohmann::ordered_json r = {{"target", row.target}, {"requests", row.requests}, {"failed", row.failed}};
    if (row.rejected > 0) {
      r["rejected"] = row.rejected;
      r["rejected_e2e_seconds"] = Percentiles(row.rejected_e2e);
    }
    r["wall_seconds"] = row.wall_seconds;
    r["output_tokens_per_second"] = row.tokens_per_second;
    r["requests_per_second"] = row.requests_per_second;
    r["ttft_seconds"] = Percentiles(row.ttft);
    r["itl_seconds"] = Percentiles(row.itl);
    r["e2e_seconds"] = Percentiles(row.e2e);
    r["first_gap_seconds"] = Percentiles(row.first_gap);
    r["steady_itl_seconds"] = Percentiles(row.steady_itl);
    const nlohmann::ordered_json full = RowJson(row);
    if (full.contains("router_relay_seconds")) r["router_relay_seconds"] = full["router_relay_seconds"];
    if (full.contains("prefix_cache")) r["prefix_cache"] = full["prefix_cache"];
    if (!row.first_error.empty()) r["first_error"] = row.first_error;
    if (!row.router_side.empty()) r["router_side"] = row.router_side;
    if (!row.drain.empty()) r["drain"] = row.drain;
    runs.push_back(std::move(r));
  }
  if (o.json) {
    nlohmann::ordered_json out;
    out["workload"] = {{"requests", o.requests},        {"concurrency", o.rate > 0 ? 0 : o.concurrency},
                       {"rate", o.rate},                {"prompt_tokens", {o.prompt_min, o.prompt_max}},
                       {"output_tokens", {o.output_min, o.output_max}}};
    out["runs"] = runs;
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }
  std::printf("%d requests, %s, prompt %d-%d tokens, output %d-%d tokens\n", o.requests,
              o.rate > 0 ? absl::StrCat("Poisson ", o.rate, " req/s").c_str()
                         : absl::StrCat("concurrency ", o.concurrency).c_str(),
              o.prompt_min, o.prompt_max, o.output_min, o.output_max);
  std::printf("%-11s %6s %9s %9s   %-26s %-26s %-26s\n", "target", "failed", "tok/s", "req/s", "TTFT ms p50/p90/p99",
              "ITL ms p50/p90/p99", "E2E ms p50/p90/p99");
  for (size_t i = 0; i < rows.size(); ++i) {
    const BenchRow& row = rows[i];
    const nlohmann::ordered_json& r = runs[i];
    std::printf("%-11s %6d %9.1f %9.2f   %-26s %-26s %-26s\n", row.target.c_str(), row.failed, row.tokens_per_second,
                row.requests_per_second, Millis(row.ttft).c_str(), Millis(row.itl).c_str(), Millis(row.e2e).c_str());
    if (!row.first_gap.sorted.empty()) {
      std::printf("  first gap (token 1 -> 2) ms p50/p99: %.2f / %.2f; steady ITL (after token 2) ms p50/p99: "
                  "%.2f / %.2f\n",
                  1e3 * row.first_gap.p50, 1e3 * row.first_gap.p99, 1e3 * row.steady_itl.p50,
                  1e3 * row.steady_itl.p99);
    }
    if (r.contains("router_relay_seconds")) {
      std::printf("  router relay per message: p50 %.1f us, p99 %.1f us\n",
                  1e6 * r["router_relay_seconds"]["p50"].get<double>(), 1e6 * r["router_relay_seconds"]["p99"].get<double>());
    }
    PrintPrefixCache(row);
    if (row.rejected > 0) {
      std::printf("  rejected (RESOURCE_EXHAUSTED / 429): %d, each answered in ms p50/p99/max %.2f / %.2f / %.2f\n",
                  row.rejected, 1e3 * row.rejected_e2e.p50, 1e3 * row.rejected_e2e.p99,
                  1e3 * row.rejected_e2e.sorted.back());
    }
    if (!row.first_error.empty()) std::printf("  first error: %s\n", row.first_error.c_str());
    PrintRouterSide(row);
    PrintDrain(row);
  }
}

std::string RangeText(int lo, int hi) { return lo == hi ? absl::StrCat(lo) : absl::StrCat(lo, "-", hi); }

// One line saying what was sent, for the table and the picture's title.
std::string WorkloadText(const ServingBenchOptions& o, size_t requests) {
  std::string load = o.rates.empty() ? (o.rate > 0 ? absl::StrCat("Poisson ", o.rate, " req/s")
                                                   : absl::StrCat("concurrency ", o.concurrency))
                                     : absl::StrCat("Poisson ", absl::StrJoin(o.rates, ", "), " req/s");
  std::string lengths;
  if (!o.trace_file.empty()) {
    lengths = absl::StrCat("lengths from ", o.trace_file);
  } else if (o.multi_turn_turns > 0) {
    lengths = absl::StrCat("multi-turn chat: ", o.multi_turn_turns, " turns per conversation, each resending its "
                           "history, over ", o.shared_prefix_groups > 0 ? o.shared_prefix_groups : 64, " ",
                           o.multi_turn_system_tokens, "-token system prompts; user turns ",
                           RangeText(o.prompt_min, o.prompt_max), " tokens, replies ",
                           RangeText(o.output_min, o.output_max), " tokens");
  } else if (o.shared_prefix_groups > 0) {
    lengths = absl::StrCat(o.shared_prefix_groups, " groups sharing ", o.shared_prefix_tokens,
                           "-token prefixes, then ", RangeText(o.prompt_min, o.prompt_max), " tokens each, output ",
                           RangeText(o.output_min, o.output_max), " tokens");
  } else {
    lengths = absl::StrCat("prompt ", RangeText(o.prompt_min, o.prompt_max), " tokens, output ",
                           RangeText(o.output_min, o.output_max), " tokens");
  }
  return absl::StrCat(requests, " requests per row, ", load, ", ", lengths);
}

std::string TargetsText(const LatencyTargets& t) {
  if (!t.any()) return "good = every completed request (no --ttft-target-ms or --itl-target-ms)";
  std::vector<std::string> parts;
  if (t.ttft > 0) parts.push_back(absl::StrCat("TTFT <= ", 1e3 * t.ttft, " ms"));
  if (t.itl > 0) parts.push_back(absl::StrCat("its own p99 ITL <= ", 1e3 * t.itl, " ms"));
  return absl::StrCat("good = completed with ", absl::StrJoin(parts, " and "));
}

void PrintRows(const ServingBenchOptions& o, const std::vector<BenchRow>& rows, const LatencyTargets& targets,
               size_t requests) {
  if (o.json) {
    nlohmann::ordered_json out;
    nlohmann::ordered_json workload = {{"requests", requests}};
    if (!o.rates.empty()) {
      workload["rates"] = o.rates;
    } else if (o.rate > 0) {
      workload["rates"] = {o.rate};
    } else {
      workload["concurrency"] = o.concurrency;
    }
    if (!o.trace_file.empty()) {
      workload["trace"] = o.trace_file;
    } else {
      workload["prompt_tokens"] = {o.prompt_min, o.prompt_max};
      workload["output_tokens"] = {o.output_min, o.output_max};
      if (o.multi_turn_turns > 0) {
        workload["multi_turn"] = {{"turns", o.multi_turn_turns},
                                  {"system_prompts", o.shared_prefix_groups > 0 ? o.shared_prefix_groups : 64},
                                  {"system_tokens", o.multi_turn_system_tokens}};
      } else if (o.shared_prefix_groups > 0) {
        workload["shared_prefix"] = {{"groups", o.shared_prefix_groups}, {"prefix_tokens", o.shared_prefix_tokens}};
      }
    }
    workload["seed"] = o.seed;
    out["workload"] = workload;
    out["targets"] = {{"ttft_ms", o.ttft_target_ms}, {"itl_ms", o.itl_target_ms}, {"itl_statistic", "per-request p99"}};
    nlohmann::ordered_json json_rows = nlohmann::ordered_json::array();
    for (const BenchRow& row : rows) json_rows.push_back(RowJson(row));
    out["rows"] = json_rows;
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }
  std::printf("%s\n%s\n", WorkloadText(o, requests).c_str(), TargetsText(targets).c_str());
  std::printf("%-11s %7s %5s %5s %5s %9s %8s %10s %9s   %-24s %-24s %-24s\n", "target", "rate", "done", "rej", "fail",
              "tok/s", "req/s", "good tok/s", "good req/s", "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99",
              "E2E ms p50/p90/p99");
  for (const BenchRow& row : rows) {
    const std::string rate = row.rate > 0 ? absl::StrCat(row.rate) : absl::StrCat("c=", row.concurrency);
    std::printf("%-11s %7s %5d %5d %5d %9.1f %8.2f %10.1f %9.2f   %-24s %-24s %-24s\n", row.target.c_str(),
                rate.c_str(), row.completed, row.rejected, row.failed, row.tokens_per_second, row.requests_per_second,
                row.good_tokens_per_second, row.good_requests_per_second, Millis(row.ttft).c_str(),
                Millis(row.itl).c_str(), Millis(row.e2e).c_str());
    PrintPrefixCache(row);
    if (!row.first_error.empty()) std::printf("  first error: %s\n", row.first_error.c_str());
  }
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write the picture"));
  return absl::OkStatus();
}

}  // namespace

absl::Status RunServingBench(const ServingBenchOptions& o) {
  if (o.router.empty() && o.openai.empty()) {
    return absl::InvalidArgumentError("bench needs --router HOST:PORT and/or --openai http://HOST:PORT");
  }
  if (o.requests < 1) return absl::InvalidArgumentError("--requests must be at least 1");
  if (!o.rates.empty() && o.rate > 0) return absl::InvalidArgumentError("give --rate or --rates, not both");
  for (double r : o.rates) {
    if (!(r > 0)) return absl::InvalidArgumentError(absl::StrCat("--rates: ", r, " is not a positive rate"));
  }
  const bool open_loop = o.rate > 0 || !o.rates.empty();
  if (!open_loop && o.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be at least 1");
  if (o.prompt_min < 1 || o.prompt_max < o.prompt_min) return absl::InvalidArgumentError("--prompt-len: need 1 <= min <= max");
  if (o.output_min < 1 || o.output_max < o.output_min) return absl::InvalidArgumentError("--output-len: need 1 <= min <= max");
  if (o.ttft_target_ms < 0 || o.itl_target_ms < 0) {
    return absl::InvalidArgumentError("--ttft-target-ms and --itl-target-ms must not be negative");
  }
  if (!o.trace_file.empty() && o.shared_prefix_groups > 0) {
    return absl::InvalidArgumentError("--trace and --shared-prefix do not go together (the trace names its groups)");
  }
  if (!o.trace_file.empty() && o.multi_turn_turns > 0) {
    return absl::InvalidArgumentError("--trace and --multi-turn do not go together");
  }
  if (o.drain_at >= 0 && (o.drain_pid <= 0 || o.router.empty() || open_loop)) {
    return absl::InvalidArgumentError(
        "--drain-at needs --drain-pid PID (a decode worker's), --router, and a closed loop (--concurrency)");
  }
  WorkloadOptions wo;
  wo.requests = o.requests;
  wo.prompt_min = o.prompt_min;
  wo.prompt_max = o.prompt_max;
  wo.output_min = o.output_min;
  wo.output_max = o.output_max;
  wo.shared_prefix_groups = o.shared_prefix_groups;
  wo.shared_prefix_tokens = o.shared_prefix_tokens;
  wo.multi_turn_turns = o.multi_turn_turns;
  wo.multi_turn_system_tokens = o.multi_turn_system_tokens;
  wo.draw_gaps = open_loop;
  wo.seed = o.seed;
  if (!o.trace_file.empty()) {
    absl::StatusOr<std::vector<TraceEntry>> trace = ReadTraceFile(o.trace_file);
    if (!trace.ok()) return trace.status();
    wo.trace = *std::move(trace);
  }
  std::unique_ptr<RouterTarget> router;
  std::unique_ptr<OpenAiTarget> openai;
  if (!o.router.empty()) {
    router = std::make_unique<RouterTarget>(o.router);
    absl::StatusOr<int32_t> vocab = router->VocabSize();
    if (!vocab.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "router ", o.router, ": ", vocab.status().message(),
          o.tls_ca.empty() ? "; a TLS cluster needs --tls_ca FILE (deploy/cluster.sh writes the CA's path to "
                             "/tmp/pdserve-cluster/tls_ca)"
                           : ""));
    }
    wo.vocab_size = *vocab;
  }
  if (!o.openai.empty()) {
    absl::StatusOr<std::unique_ptr<OpenAiTarget>> t = OpenAiTarget::Create(o.openai, o.tls_ca);
    if (!t.ok()) return t.status();
    openai = *std::move(t);
    const int32_t vocab = openai->VocabSize();
    if (vocab <= 0) return absl::UnavailableError(absl::StrCat(o.openai, ": GET /v1/models failed"));
    if (wo.vocab_size > 0 && vocab != wo.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("--router and --openai serve different models (vocabularies ", wo.vocab_size, " and ", vocab, ")"));
    }
    wo.vocab_size = vocab;
  }
  absl::StatusOr<std::vector<WorkloadRequest>> work = MakeWorkload(wo);
  if (!work.ok()) return work.status();
  const LatencyTargets targets{o.ttft_target_ms / 1e3, o.itl_target_ms / 1e3};
  const bool per_row = o.PerRowReport();
  const std::vector<double> rates = !o.rates.empty() ? o.rates : std::vector<double>{o.rate};
  std::unique_ptr<InProcessTarget> in_process;
  // With both APIs in one run, the HTTP row's prompts are the gRPC row's
  // with every id moved by one: the same lengths and shared-prefix shape,
  // none of the prefix cache the gRPC row left behind.
  std::vector<WorkloadRequest> http_work = *work;
  if (router != nullptr && openai != nullptr) {
    for (WorkloadRequest& w : http_work) {
      for (int32_t& t : w.prompt) t = (t + 1) % wo.vocab_size;
    }
  }
  std::vector<BenchRow> rows;
  for (double rate : rates) {
    const std::vector<double> arrivals = rate > 0 ? ArrivalTimes(*work, rate) : std::vector<double>{};
    for (const char* which : {"cluster", "http", "in-process"}) {
      const std::string name = which;
      const bool cluster = name != "in-process";
      if (name == "cluster" && router == nullptr) continue;
      if (name == "http" && openai == nullptr) continue;
      if (!cluster && o.in_process_model.empty()) continue;
      if (!cluster && in_process == nullptr) {
        absl::StatusOr<std::unique_ptr<InProcessTarget>> ip =
            InProcessTarget::Create(o.in_process_model, o.in_process_threads);
        if (!ip.ok()) return ip.status();
        in_process = *std::move(ip);
      }
      Target& target = name == "cluster" ? static_cast<Target&>(*router)
                       : name == "http"  ? static_cast<Target&>(*openai)
                                         : *in_process;
      const std::string progress_name = per_row && rate > 0 ? absl::StrCat(name, " ", rate, " req/s") : name;
      // A burst's rows also say what the router went through.
      std::optional<v1::ClusterStatusResponse> before;
      const bool tiers = (o.multi_turn_turns > 0 || o.shared_prefix_groups > 0) && name == "cluster";
      const bool drain = o.drain_at >= 0 && name == "cluster";
      if ((o.burst > 0 || tiers || drain) && cluster && router != nullptr) {
        absl::StatusOr<v1::ClusterStatusResponse> s = router->ClusterStatus();
        if (!s.ok()) return s.status();
        before = *std::move(s);
      }
      std::unique_ptr<Drainer> drainer;
      std::vector<std::vector<double>> token_times;
      if (drain) {
        drainer = std::make_unique<Drainer>(router.get(), o, std::min(o.concurrency, static_cast<int>(work->size())));
      }
      BenchRow row = Drive(target, name == "http" ? http_work : *work, arrivals, o.concurrency, targets, progress_name,
                           drain ? &token_times : nullptr);
      if (drainer != nullptr) drainer->Stop();
      if (before.has_value()) {
        absl::StatusOr<v1::ClusterStatusResponse> after = router->ClusterStatus();
        if (!after.ok()) return after.status();
        if (o.burst > 0) row.router_side = RouterSide(*before, *after);
        if (tiers) row.tiers = Tiers(*before, *after, row.prompt_tokens);
        if (drain) row.drain = DrainReport(row, token_times, *drainer, *before, *after);
      }
      row.target = name;
      row.rate = rate;
      row.concurrency = rate > 0 ? 0 : o.concurrency;
      rows.push_back(std::move(row));
    }
  }
  if (!per_row) {
    PrintSingleRun(o, rows);
    return absl::OkStatus();
  }
  if (!o.svg_file.empty()) {
    const std::string title = absl::StrCat("pdctl bench: ", WorkloadText(o, work->size()));
    if (absl::Status s = WriteFile(o.svg_file, RenderBenchSvg(rows, title)); !s.ok()) return s;
  }
  PrintRows(o, rows, targets, work->size());
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
