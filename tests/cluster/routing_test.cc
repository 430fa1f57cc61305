// Prefix-aware routing and conditional disaggregation with real processes:
// the router follows the workers' KV events and sends a prompt to the
// worker that holds its prefix; a dead worker's entries go; a decode
// worker prefills short requests itself with the tokens the handoff path
// gives.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

constexpr int kPrefix = 160;  // 10 blocks of 16.

// A prompt of the shared prefix then `suffix_len` tokens particular to `variant`.
v1::GenerateRequest PrefixRequest(int variant, int suffix_len = 24, int max_tokens = 6) {
  v1::GenerateRequest r;
  for (int i = 0; i < kPrefix; ++i) r.mutable_token_ids()->add_ids(100 + (i * 37) % 3000);
  for (int i = 0; i < suffix_len; ++i) r.mutable_token_ids()->add_ids(200 + variant * 131 + i);
  r.set_max_tokens(max_tokens);
  r.mutable_sampling()->set_temperature(0.7f);
  r.mutable_sampling()->set_seed(5 + static_cast<uint64_t>(variant));
  return r;
}

// Polls ClusterStatus until `pred` holds (true) or `wait` runs out (false).
template <typename Pred>
bool StatusEventually(Cluster& c, Pred pred, absl::Duration wait = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + wait;
  while (absl::Now() < deadline) {
    if (pred(c.Status())) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

// The prefill worker the router's index shows holding blocks (-1: none or several).
int Holder(const v1::ClusterStatusResponse& st) {
  int holder = -1;
  for (int i = 0; i < st.prefill_size(); ++i) {
    if (st.prefill(i).prefix_index_blocks() == 0) continue;
    if (holder >= 0) return -1;
    holder = i;
  }
  return holder;
}

TEST(PrefixRoutingTest, ASharedPrefixGoesToTheWorkerThatHoldsIt) {
  const std::string dir = TempDir() + "/prefix";
  Cluster c;
  ASSERT_TRUE(c.Start(dir, false, {}, {}, /*num_prefill=*/2).ok());
  const Output first = c.Generate(PrefixRequest(0));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.final.timings().cached_prompt_tokens(), 0);
  // The worker's stored events reach the router's index.
  int holder = -1;
  ASSERT_TRUE(StatusEventually(c, [&](const v1::ClusterStatusResponse& st) {
    holder = Holder(st);
    return holder >= 0 && st.prefill(holder).prefix_index_blocks() == st.prefill(holder).kv_cached_blocks();
  })) << c.Status().DebugString() << c.Logs();
  const int64_t prompt_blocks = (kPrefix + 24 - 1) / 16;
  EXPECT_EQ(c.Status().prefill(holder).prefix_index_blocks(), prompt_blocks);

  // Every later request shares the prefix, so it goes where the prefix is
  // and computes only its own part.
  for (int v = 1; v <= 5; ++v) {
    const Output got = c.Generate(PrefixRequest(v));
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.final.timings().cached_prompt_tokens(), kPrefix) << "request " << v;
  }
  const v1::ClusterStatusResponse st = c.Status();
  const v1::WorkerStatus& other = st.prefill(1 - holder);
  EXPECT_EQ(other.kv_cached_blocks(), 0) << "a prompt went to the worker without the prefix";
  EXPECT_EQ(other.prefix_index_blocks(), 0);
  const std::string router = HttpGet(c.router_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(router, "pdserve_prefix_cached_tokens_total"), 5 * kPrefix) << router;
  EXPECT_EQ(MetricValue(router, "pdserve_prefill_placements_total{placement=\"prefill_pool\"}"), 6);
  // The measured capacity is exported too.
  EXPECT_GT(MetricValue(router, "pdserve_stage_capacity_requests_per_second{stage=\"prefill\"}"), 0) << router;
  EXPECT_GT(MetricValue(router, "pdserve_arrival_rate_requests_per_second"), 0);
}

TEST(PrefixRoutingTest, RoundRobinIgnoresThePrefix) {
  const std::string dir = TempDir() + "/rr";
  Cluster c;
  c.extra_router_flags = {"--prefill_policy", "round_robin"};
  ASSERT_TRUE(c.Start(dir, false, {}, {}, /*num_prefill=*/2).ok());
  int hits = 0;
  for (int v = 0; v < 4; ++v) {
    const Output got = c.Generate(PrefixRequest(v));
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    hits += got.final.timings().cached_prompt_tokens() > 0 ? 1 : 0;
  }
  // Each worker computes the prefix once: requests 0 and 1 miss.
  EXPECT_EQ(hits, 2);
  const v1::ClusterStatusResponse st = c.Status();
  EXPECT_GT(st.prefill(0).kv_cached_blocks(), 0);
  EXPECT_GT(st.prefill(1).kv_cached_blocks(), 0);
}

TEST(PrefixRoutingTest, ADeadWorkersEntriesAreDropped) {
  const std::string dir = TempDir() + "/dead";
  Cluster c;
  ASSERT_TRUE(c.Start(dir, false, {}, {}, /*num_prefill=*/2).ok());
  ASSERT_TRUE(c.Generate(PrefixRequest(0)).status.ok());
  int holder = -1;
  ASSERT_TRUE(StatusEventually(c, [&](const v1::ClusterStatusResponse& st) { return (holder = Holder(st)) >= 0; }))
      << c.Logs();
  c.prefill(holder).Kill();
  ASSERT_TRUE(StatusEventually(c, [&](const v1::ClusterStatusResponse& st) {
    return !st.prefill(holder).healthy() && st.prefill(holder).prefix_index_blocks() == 0;
  })) << c.Status().DebugString();
  // The prefix is computed again on the survivor, whose index then holds it.
  const Output got = c.Generate(PrefixRequest(1));
  ASSERT_TRUE(got.status.ok()) << got.status.error_message() << c.Logs();
  EXPECT_EQ(got.final.timings().cached_prompt_tokens(), 0);
  ASSERT_TRUE(StatusEventually(c, [&](const v1::ClusterStatusResponse& st) {
    return st.prefill(1 - holder).prefix_index_blocks() > 0;
  }));
  EXPECT_EQ(c.Generate(PrefixRequest(2)).final.timings().cached_prompt_tokens(), kPrefix);
}

// A pool of 24 blocks holds two of these prompts at most: later ones evict
// earlier ones, and the router's index follows the removals.
TEST(PrefixRoutingTest, TheIndexFollowsEvictions) {
  const std::string dir = TempDir() + "/evict";
  Cluster c;
  ASSERT_TRUE(c.Start(dir, false, {}, {}, /*num_prefill=*/1, {"--kv_positions", "384"}).ok());
  for (int v = 0; v < 6; ++v) {
    v1::GenerateRequest r;
    for (int i = 0; i < 180; ++i) r.mutable_token_ids()->add_ids(300 + v * 400 + i);
    r.set_max_tokens(2);
    ASSERT_TRUE(c.Generate(r).status.ok());
  }
  const std::string prefill = HttpGet(MetricsPort(dir + "/prefill0.ready"), "/metrics");
  EXPECT_GT(MetricValue(prefill, "pdserve_prefix_cache_evictions_total"), 0) << prefill;
  ASSERT_TRUE(StatusEventually(c, [](const v1::ClusterStatusResponse& st) {
    return st.prefill(0).prefix_index_blocks() == st.prefill(0).kv_cached_blocks();
  })) << c.Status().DebugString();
  // Six prompts stored 66 blocks in all: without the removed events the
  // index would hold more than the 24-block pool can.
  EXPECT_LE(c.Status().prefill(0).prefix_index_blocks(), 24) << "removed events were not applied";
}

TEST(ConditionalDisaggregationTest, ShortUncachedPartsPrefillOnTheDecodeWorkerWithTheSameTokens) {
  const std::string dir = TempDir() + "/local";
  // Reference: every request through a prefill worker and a handoff.
  std::vector<Output> want;
  const std::vector<v1::GenerateRequest> reqs = {SeededRequest(12), PrefixRequest(0, 24, 12),
                                                 PrefixRequest(1, 8, 12)};
  {
    Cluster ref;
    ASSERT_TRUE(ref.Start(dir + "/ref", false).ok());
    for (const auto& r : reqs) {
      want.push_back(ref.Generate(r));
      ASSERT_TRUE(want.back().status.ok());
      EXPECT_FALSE(want.back().final.timings().local_prefill());
    }
  }
  Cluster c;
  c.extra_router_flags = {"--local_prefill_max_tokens", "32"};
  ASSERT_TRUE(c.Start(dir + "/cond", false).ok());
  // 1: a short prompt: prefilled on the decode worker.
  Output got = c.Generate(reqs[0]);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_TRUE(got.final.timings().local_prefill());
  EXPECT_EQ(got.tokens, want[0].tokens);
  // 2: 184 tokens, none cached on the decode worker: the prefill pool.
  got = c.Generate(reqs[1]);
  ASSERT_TRUE(got.status.ok());
  EXPECT_FALSE(got.final.timings().local_prefill());
  EXPECT_EQ(got.tokens, want[1].tokens);
  // 3: the same prefix, which the decode worker now caches (published when
  // the handoff committed), and 8 new tokens: prefilled there.
  ASSERT_TRUE(StatusEventually(c, [](const v1::ClusterStatusResponse& st) {
    return st.decode(0).prefix_index_blocks() >= kPrefix / 16;
  })) << c.Status().DebugString();
  got = c.Generate(reqs[2]);
  ASSERT_TRUE(got.status.ok());
  EXPECT_TRUE(got.final.timings().local_prefill());
  EXPECT_EQ(got.final.timings().cached_prompt_tokens(), kPrefix);
  EXPECT_EQ(got.tokens, want[2].tokens) << "local prefill from the cached prefix changed the tokens";
  const std::string router = HttpGet(c.router_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(router, "pdserve_prefill_placements_total{placement=\"decode_local\"}"), 2) << router;
  EXPECT_EQ(MetricValue(router, "pdserve_prefill_placements_total{placement=\"prefill_pool\"}"), 1);
  // Nothing left held once the streams are done.
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0);
}

}  // namespace
}  // namespace pdserve
