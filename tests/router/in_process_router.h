// The router's parts wired together in-process, over fake workers and a
// fake clock: what router_service.cc builds, minus gRPC. Tests add fake
// workers, probe them once, and run relays.
#ifndef PDSERVE_TESTS_ROUTER_IN_PROCESS_ROUTER_H_
#define PDSERVE_TESTS_ROUTER_IN_PROCESS_ROUTER_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/generation.h"
#include "base/metrics.h"
#include "text/tokenizer.h"
#include "gtest/gtest.h"
#include "router/admission.h"
#include "router/measured.h"
#include "router/placement.h"
#include "router/prefix_index.h"
#include "router/relay.h"
#include "router/request_queue.h"
#include "router/selection.h"
#include "router/worker_pool.h"
#include "tests/router/fake_clock.h"
#include "tests/router/fake_workers.h"

namespace pdserve::router::testing {

struct RigOptions {
  bool colocated = false;
  std::string prefill_policy = "prefix_aware";
  std::string decode_policy = "prefix_aware";
  int64_t local_prefill_max_tokens = 0;
  int64_t pull_min_tokens = 0;  // PlacementOptions'
  absl::Duration pull_overhead = absl::ZeroDuration();
  bool pull_always = false;
  std::optional<AdmissionOptions> admission;  // its clock is set to the rig's
  // The queue for decode KV room (on the real clock: its waits are real).
  std::optional<RequestQueueOptions> queue;
};

// What one relay did.
struct Relayed {
  absl::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  std::optional<v1::GenerateFinal> final;
  std::vector<RelayState> trace;
};

class InProcessRouter {
 public:
  explicit InProcessRouter(RigOptions o = {}) : measured(OptionsOn<MeasuredOptions>(clock)), relay_metrics(metrics) {
    WorkerPoolOptions po;
    po.clock = clock.clock();
    pool = std::make_unique<WorkerPool>(po, &workers, &measured, &index);
    PlacementOptions pl;
    pl.colocated = o.colocated;
    pl.local_prefill_max_tokens = o.local_prefill_max_tokens;
    pl.pull_min_tokens = o.pull_min_tokens;
    pl.pull_overhead = o.pull_overhead;
    pl.pull_always = o.pull_always;
    pl.clock = clock.clock();
    if (o.queue.has_value()) {
      queue = std::make_unique<RequestQueue>(*o.queue);
      room.set_on_room([this] { queue->Poke(); });
      pl.room = &room;
      context.queue = queue.get();
      context.room = &room;
    }
    placement = std::make_unique<Placement>(pl, pool.get(), &index, &measured,
                                            *MakeSelector(o.prefill_policy, Pool::kPrefill),
                                            *MakeSelector(o.decode_policy, Pool::kDecode));
    if (o.admission.has_value()) {
      o.admission->clock = clock.clock();
      admission = std::make_unique<AdmissionController>(*o.admission);
      context.admission = admission.get();
      context.admission_min_samples = o.admission->min_samples;
    }
    tokenizer = *tok::Tokenizer::Load(std::string(PDSERVE_SOURCE_DIR) + "/deploy/models/kjv-tiny");
    context.options.colocated = o.colocated;
    context.options.clock = clock.clock();
    // Nothing changes the fake cluster while a relay waits: its wait runs out.
    context.options.await_serving = [this](uint64_t, absl::Duration d) { clock.now += d; };
    context.pool = pool.get();
    context.placement = placement.get();
    context.transport = &workers;
    context.measured = &measured;
    context.tokenizer = tokenizer.get();
    context.metrics = &relay_metrics;
    context.in_flight = &in_flight;
    context.next_id = &next_id;
  }

  // A fake worker known to the pool (serving once probed).
  FakeWorker& AddWorker(Role role, const std::string& address) {
    FakeWorker& w = workers.Add(role, address);
    pool->Add(role, address);
    return w;
  }
  WorkerPtr Find(Role role, const std::string& address) const {
    for (const WorkerPtr& w : pool->Snapshot(role)) {
      if (w->address() == address) return w;
    }
    return nullptr;
  }
  // Probes every worker; the ledger reads their reports, as the router's
  // probe thread has it do after each round.
  void ProbeAll() {
    pool->ProbeDue(/*force_all=*/true);
    if (queue != nullptr) room.Refresh(pool->Snapshot(Role::kDecode));
  }

  static GenerationRequest Request(int32_t max_tokens, uint64_t seed = 7, int prompt_len = 40) {
    GenerationRequest r;
    for (int i = 0; i < prompt_len; ++i) r.prompt.push_back(100 + i);
    r.params.max_tokens = max_tokens;
    r.params.seed = seed;
    r.params.temperature = 0;
    return r;
  }
  static std::vector<int32_t> Expected(const GenerationRequest& r) {
    std::vector<int32_t> t;
    for (int i = 0; i < r.params.max_tokens; ++i) t.push_back(FakeToken(*r.params.seed, i));
    return t;
  }

  // Runs one relay to its end; `on_relay` sees it before it runs, and
  // `on_end` is called once it has run, before it is destroyed: whoever
  // calls the relay from another thread (Cancel) stops there, as a
  // server's front drops its pointer under a lock before the relay goes.
  Relayed Run(const GenerationRequest& r, const std::function<void(Relay&)>& on_relay = nullptr,
              const std::function<void()>& on_end = nullptr) {
    Relay relay(context, r, "test", std::nullopt);
    if (on_relay) on_relay(relay);
    Relayed out;
    out.status = relay.Run([&out](const v1::GenerateResponse& m) {
      if (m.has_chunk()) {
        out.tokens.insert(out.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
        out.text += m.chunk().text();
      } else if (m.has_final()) {
        out.final = m.final();
      }
      return true;
    });
    out.trace = relay.trace();
    if (on_end) on_end();
    return out;
  }

  double Count(const std::string& name, const std::string& labels = "") const {
    const std::string text = metrics.Render();
    const std::string key = labels.empty() ? name + " " : name + "{" + labels + "} ";
    const size_t at = text.find("\n" + key);
    return at == std::string::npos ? -1 : std::stod(text.substr(at + 1 + key.size()));
  }

  FakeClock clock;
  FakeWorkers workers;
  PrefixIndex index;
  MeasuredInputs measured;
  MetricsRegistry metrics;
  RelayMetrics relay_metrics;
  std::unique_ptr<WorkerPool> pool;
  DecodeRoom room;
  std::unique_ptr<RequestQueue> queue;
  std::unique_ptr<Placement> placement;
  std::unique_ptr<AdmissionController> admission;
  std::unique_ptr<tok::Tokenizer> tokenizer;
  std::atomic<int64_t> in_flight{0};
  std::atomic<uint64_t> next_id{1};
  RelayContext context;
};

}  // namespace pdserve::router::testing

#endif  // PDSERVE_TESTS_ROUTER_IN_PROCESS_ROUTER_H_
