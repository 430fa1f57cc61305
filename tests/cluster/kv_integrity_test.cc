// KV that outlives or leaves the pool, checked, in real workers:
// - the prefix cache's second tier (--kv_tier2_dir): blocks a prefill
//   worker published before a restart are read back after it instead of
//   computed, and a damaged store (a truncated file, corrupted payloads) is
//   refused or caught by its checksums and the prefix computed;
// - a verified handoff (--kv_verify_handoffs): KV that does not match the
//   prefill worker's checksums is discarded and computed on the decode
//   worker;
// - a prefix pulled from the prefill worker that holds it: published in
//   the puller's cache when it matches its checksums (the prompt is not
//   computed again), discarded and computed when it does not;
// with the stream the same either way.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

// A prompt of several full blocks (kjv-tiny's context is 512 positions).
v1::GenerateRequest LongRequest() {
  v1::GenerateRequest r;
  r.set_text(
      "And it came to pass, when men began to multiply on the face of the earth, and daughters were born unto "
      "them, that the sons of God saw the daughters of men that they were fair; and they took them wives of all "
      "which they chose. And the LORD said, My spirit shall not always strive with man, for that he also is "
      "flesh: yet his days shall be an hundred and twenty years.");
  r.set_max_tokens(16);
  r.mutable_sampling()->set_temperature(0.8f);
  r.mutable_sampling()->set_seed(5);
  return r;
}

std::vector<std::string> Tier2Flags(const std::string& dir) { return {"--kv_tier2_dir", dir}; }

// Waits until `series` on the prefill worker's metrics reads at least `at_least`.
double AwaitPrefillMetric(Cluster& c, const std::string& series, double at_least) {
  double v = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  do {
    v = MetricValue(HttpGet(c.prefill_metrics(), "/metrics"), series);
    if (v >= at_least) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  return v;
}

// Serves LongRequest once on a fresh cluster whose prefill worker keeps its
// second tier in `tier2`, and waits until the tier has written its blocks.
Output ServeOnce(const std::string& dir, const std::string& tier2, Cluster& c) {
  absl::Status s = c.Start(dir, false, {}, {}, 1, Tier2Flags(tier2));
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return {};
  Output got = c.Generate(LongRequest());
  EXPECT_TRUE(got.status.ok()) << got.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(got.final.finish_reason(), v1::FINISH_REASON_LENGTH) << got.final.error();
  return got;
}

// LongRequest's full blocks (85 tokens, kjv-tiny's blocks of 16).
constexpr int kLongRequestBlocks = 5;

// Serves LongRequest once on a cluster of its own (gone on return) whose
// prefill worker keeps its second tier in `tier2`, once the tier has
// written every one of its blocks: the I/O threads write them in any
// order, so fewer could miss the chain's first and nothing would restore.
Output FillTier(const std::string& dir, const std::string& tier2) {
  Cluster c;
  Output got = ServeOnce(dir, tier2, c);
  EXPECT_GE(AwaitPrefillMetric(c, "pdserve_kv_tier2_writes_total{result=\"written\"}", kLongRequestBlocks),
            kLongRequestBlocks);
  return got;
}

std::vector<std::filesystem::path> BlockFiles(const std::string& tier2) {
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(tier2)) {
    if (e.path().extension() == ".kvb") files.push_back(e.path());
  }
  return files;
}

TEST(Tier2ClusterTest, BlocksWrittenBeforeARestartAreReadBackAfterItAndTheStreamIsTheSame) {
  const std::string dir = TempDir();
  const std::string tier2 = dir + "/tier2";
  const Output first = FillTier(dir + "/before", tier2);
  ASSERT_GE(BlockFiles(tier2).size(), 2u);
  Cluster c;
  const Output again = ServeOnce(dir + "/after", tier2, c);
  EXPECT_EQ(again.tokens, first.tokens);
  EXPECT_EQ(again.text, first.text);
  const std::string page = HttpGet(c.prefill_metrics(), "/metrics");
  EXPECT_GE(MetricValue(page, "pdserve_kv_tier2_restored_blocks_total"), 2) << page;
  EXPECT_EQ(MetricValue(page, "pdserve_kv_checksum_failures_total{path=\"tier2\"}"), 0) << page;
  EXPECT_GT(MetricValue(page, "pdserve_kv_tier2_restore_seconds_total"), 0) << page;
  // The router's status (pdctl status) shows the tier by worker.
  const v1::WorkerStatus st = c.Status().prefill(0);
  EXPECT_GE(st.kv_tier2_restored_blocks(), 2) << st.ShortDebugString();
  EXPECT_EQ(st.kv_tier2_capacity_bytes(), int64_t{4} << 30) << st.ShortDebugString();
  EXPECT_GE(st.kv_tier2_blocks(), 2) << st.ShortDebugString();
  EXPECT_GT(st.kv_tier2_bytes(), 0) << st.ShortDebugString();
  EXPECT_EQ(st.kv_checksum_failures(), 0) << st.ShortDebugString();
  EXPECT_EQ(c.Status().decode(0).kv_tier2_capacity_bytes(), 0) << "no second tier there";
  // The router measures the prefix cache by tier from the first tokens.
  EXPECT_GE(MetricValue(HttpGet(c.router_metrics(), "/metrics"), "pdserve_prefix_tier2_tokens_total"), 32);
  EXPECT_TRUE(absl::StrContains(c.Status().measured_report(), "read back from second tiers"))
      << c.Status().measured_report();
}

TEST(Tier2ClusterTest, ADamagedStoreIsRefusedOrCaughtAndThePrefixIsComputed) {
  const std::string dir = TempDir();
  const std::string tier2 = dir + "/tier2";
  const Output first = FillTier(dir + "/before", tier2);
  std::vector<std::filesystem::path> files = BlockFiles(tier2);
  ASSERT_GE(files.size(), 3u);
  // The prompt's first block is the one whose parent (header bytes 40-56)
  // is the zero salt: its payload gets a flipped byte, so the read back
  // fails its check at once; another file is cut short, so it is refused
  // when the store opens.
  auto parent_is_zero = [](const std::filesystem::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::string parent(16, '\1');
    f.seekg(40);
    f.read(parent.data(), 16);
    return parent == std::string(16, '\0');
  };
  auto first_block = std::find_if(files.begin(), files.end(), parent_is_zero);
  ASSERT_NE(first_block, files.end());
  std::iter_swap(files.begin(), first_block);
  {
    std::fstream f(files[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(200);
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x01);
    f.seekp(200);
    f.write(&b, 1);
  }
  std::filesystem::resize_file(files[1], std::filesystem::file_size(files[1]) - 7);
  Cluster c;
  const Output again = ServeOnce(dir + "/after", tier2, c);
  EXPECT_EQ(again.tokens, first.tokens);
  EXPECT_EQ(again.text, first.text);
  const std::string page = HttpGet(c.prefill_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(page, "pdserve_kv_tier2_discarded_files_total"), 1) << page;
  EXPECT_EQ(MetricValue(page, "pdserve_kv_checksum_failures_total{path=\"tier2\"}"), 1) << page;
  EXPECT_EQ(MetricValue(page, "pdserve_kv_tier2_restored_blocks_total"), 0) << page;
  EXPECT_EQ(c.Status().prefill(0).kv_checksum_failures(), 1);
}

TEST(HandoffChecksumClusterTest, KvThatFailsItsCheckIsComputedOnTheDecodeWorkerAndTheStreamIsTheSame) {
  const std::string dir = TempDir();
  Output want;
  {
    Cluster c;
    ASSERT_TRUE(c.Start(dir + "/intact", false, {"--kv_verify_handoffs", "all"}).ok());
    want = c.Generate(LongRequest());
    ASSERT_TRUE(want.status.ok()) << want.status.error_message() << "\n" << c.Logs();
    const std::string page = HttpGet(c.decode_metrics(), "/metrics");
    EXPECT_EQ(MetricValue(page, "pdserve_kv_handoffs_verified_total"), 1) << page;
    EXPECT_EQ(MetricValue(page, "pdserve_kv_checksum_failures_total{path=\"handoff\"}"), 0) << page;
  }
  Cluster c;
  ASSERT_TRUE(c.Start(dir + "/corrupt", false, {"--kv_verify_handoffs", "all"}, {}, 1,
                      {"--fault_wrong_kv_checksums"})
                  .ok());
  const Output got = c.Generate(LongRequest());
  ASSERT_TRUE(got.status.ok()) << got.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.text, want.text);
  const std::string page = HttpGet(c.decode_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(page, "pdserve_kv_handoffs_verified_total"), 1) << page;
  EXPECT_EQ(MetricValue(page, "pdserve_kv_checksum_failures_total{path=\"handoff\"}"), 1) << page;
  EXPECT_GT(MetricValue(page, "pdserve_kv_recomputed_positions_total"), 16) << page;
  EXPECT_EQ(c.Status().decode(0).kv_checksum_failures(), 1);
  std::ifstream f(dir + "/corrupt/decode0.log");
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(absl::StrContains(log, "kv_checksum_mismatch")) << log;
  EXPECT_TRUE(absl::StrContains(log, "\"producer\":\"127.0.0.1\"")) << log;
}

// Two prefill workers taken in turn (round robin), grants on (TLS): request
// 1 and 2 warm each worker; LongRequest then runs on worker 0 (computed)
// and again on worker 1, which lacks it and pulls it from worker 0 first.
// The pull is taken whatever the prediction would say
// (--prefix_pull_always): under the suite's load the measured link and
// prefill speeds can make a transfer look slower, and what is tested here
// is the pull itself (the prediction is PlacementTest's).
struct PullRun {
  Output computed;  // LongRequest on worker 0
  Output pulled;    // LongRequest on worker 1
};

PullRun RunPull(Cluster& c, const std::string& dir, const std::vector<std::string>& prefill_flags) {
  c.extra_router_flags = {"--prefill_policy", "round_robin", "--prefix_pull_min_tokens", "16",
                          "--prefix_pull_always"};
  absl::Status s = c.Start(dir, false, {"--kv_verify_handoffs", "off"}, {}, 2, prefill_flags);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return {};
  for (const char* text : {"In the beginning God created the heaven and the earth.",
                           "And the earth was without form, and void; and darkness was upon the face of the deep."}) {
    v1::GenerateRequest warm;
    warm.set_text(text);
    warm.set_max_tokens(2);
    const Output o = c.Generate(warm);
    EXPECT_TRUE(o.status.ok()) << o.status.error_message() << "\n" << c.Logs();
  }
  PullRun run;
  run.computed = c.Generate(LongRequest());
  run.pulled = c.Generate(LongRequest());
  EXPECT_TRUE(run.computed.status.ok()) << run.computed.status.error_message() << "\n" << c.Logs();
  EXPECT_TRUE(run.pulled.status.ok()) << run.pulled.status.error_message() << "\n" << c.Logs();
  return run;
}

TEST(PrefixPullClusterTest, APrefixAnotherPrefillWorkerHoldsIsPulledNotComputedAndTheStreamIsTheSame) {
  const std::string dir = TempDir();
  Cluster c;
  const PullRun run = RunPull(c, dir, {});
  EXPECT_EQ(run.pulled.tokens, run.computed.tokens);
  EXPECT_EQ(run.pulled.text, run.computed.text);
  const std::string router = HttpGet(c.router_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(router, "pdserve_prefix_pulls_total{outcome=\"pulled\"}"), 1) << router << c.Logs();
  EXPECT_EQ(MetricValue(router, "pdserve_prefix_pulls_total{outcome=\"failed\"}"), 0) << router;
  EXPECT_GE(MetricValue(router, "pdserve_prefix_pulled_tokens_total"), 64) << router;
  EXPECT_GT(MetricValue(router, "pdserve_prefix_pull_bytes_total"), 0) << router;
  // Nothing another worker held was computed again.
  EXPECT_EQ(MetricValue(router, "pdserve_prefill_tokens_cached_elsewhere_total"), 0) << router;
  const std::string holder = HttpGet(MetricsPort(dir + "/prefill0.ready"), "/metrics");
  EXPECT_EQ(MetricValue(holder, "pdserve_kv_pushes_total{result=\"pushed\"}"), 1) << holder;
  EXPECT_GT(MetricValue(holder, "pdserve_kv_push_bytes_total"), 0) << holder;
  const std::string puller = HttpGet(MetricsPort(dir + "/prefill1.ready"), "/metrics");
  EXPECT_EQ(MetricValue(puller, "pdserve_kv_pulls_total{result=\"published\"}"), 1) << puller;
  EXPECT_EQ(MetricValue(puller, "pdserve_kv_checksum_failures_total{path=\"pull\"}"), 0) << puller;
  // The pulled blocks were hits of the prefill that followed.
  EXPECT_GE(MetricValue(puller, "pdserve_prefix_cache_blocks_total{result=\"hit\"}"), 4) << puller;
  // Greedy too: another prompt, computed on worker 0, then pulled to 1.
  v1::GenerateRequest greedy = LongRequest();
  greedy.set_text(absl::StrCat("There were giants in the earth in those days. ", greedy.text()));
  greedy.mutable_sampling()->set_temperature(0);
  const Output computed = c.Generate(greedy);
  const Output pulled = c.Generate(greedy);
  ASSERT_TRUE(computed.status.ok() && pulled.status.ok()) << c.Logs();
  EXPECT_EQ(pulled.tokens, computed.tokens);
  EXPECT_EQ(pulled.text, computed.text);
  EXPECT_EQ(MetricValue(HttpGet(c.router_metrics(), "/metrics"), "pdserve_prefix_pulls_total{outcome=\"pulled\"}"),
            2);
}

// The holder's pool has let the prefix go but its second tier keeps it
// (and the router, following both tiers, still counts it there): the push
// reads the blocks back from disk and sends them from there.
TEST(PrefixPullClusterTest, APrefixHeldOnlyInTheHoldersSecondTierIsReadBackAndPulled) {
  const std::string dir = TempDir();
  Cluster c;
  c.extra_router_flags = {"--prefill_policy", "round_robin", "--prefix_pull_min_tokens", "16",
                          "--prefix_pull_always"};
  // Pools of 8 blocks, each worker's second tier a directory of its own.
  c.extra_prefill_flags = {{0, Tier2Flags(dir + "/tier2_0")}, {1, Tier2Flags(dir + "/tier2_1")}};
  ASSERT_TRUE(c.Start(dir, false, {"--kv_verify_handoffs", "off"}, {}, 2, {"--kv_positions", "128"}).ok())
      << c.Logs();
  const int holder = MetricsPort(dir + "/prefill0.ready");
  auto generate = [&](const std::string& text, int max_tokens) {
    v1::GenerateRequest r;
    r.set_text(text);
    r.set_max_tokens(max_tokens);
    const Output o = c.Generate(r);
    EXPECT_TRUE(o.status.ok()) << o.status.error_message() << "\n" << c.Logs();
  };
  // Turns go 0, 1, 0, 1, ...: both workers measured first.
  generate("In the beginning God created the heaven and the earth.", 2);
  generate("And the earth was without form, and void; and darkness was upon the face of the deep.", 2);
  const Output computed = c.Generate(LongRequest());  // worker 0
  ASSERT_TRUE(computed.status.ok()) << c.Logs();
  const double written =
      AwaitPrefillMetric(c, "pdserve_kv_tier2_writes_total{result=\"written\"}", kLongRequestBlocks);
  ASSERT_GE(written, kLongRequestBlocks) << "worker 0's blocks reached its second tier";
  generate("And God said, Let there be light: and there was light.", 2);  // worker 1
  // Worker 0 again: a prompt of its own that fills its pool.
  generate(
      "And God called the firmament Heaven. And the evening and the morning were the second day. And God said, Let "
      "the waters under the heaven be gathered together unto one place, and let the dry land appear: and it was "
      "so. And God called the dry land Earth; and the gathering together of the waters called he Seas: and God "
      "saw that it was good.",
      2);
  const Output pulled = c.Generate(LongRequest());  // worker 1: pulls from worker 0's second tier
  ASSERT_TRUE(pulled.status.ok()) << c.Logs();
  EXPECT_EQ(pulled.tokens, computed.tokens);
  EXPECT_EQ(pulled.text, computed.text);
  const std::string router = HttpGet(c.router_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(router, "pdserve_prefix_pulls_total{outcome=\"pulled\"}"), 1) << router << c.Logs();
  const std::string held = HttpGet(holder, "/metrics");
  EXPECT_GE(MetricValue(held, "pdserve_kv_push_tier2_blocks_total"), 1) << held;
  EXPECT_GE(MetricValue(held, "pdserve_kv_tier2_restored_blocks_total"), 1) << held;
  const std::string puller = HttpGet(MetricsPort(dir + "/prefill1.ready"), "/metrics");
  EXPECT_EQ(MetricValue(puller, "pdserve_kv_pulls_total{result=\"published\"}"), 1) << puller;
}

TEST(PrefixPullClusterTest, APulledPrefixThatFailsItsCheckIsDiscardedAndComputed) {
  const std::string dir = TempDir();
  Cluster c;
  // Every checksum a prefill worker sends is one bit off (decode workers
  // verify no handoff here, so only the pull is checked).
  const PullRun run = RunPull(c, dir, {"--fault_wrong_kv_checksums"});
  EXPECT_EQ(run.pulled.tokens, run.computed.tokens);
  EXPECT_EQ(run.pulled.text, run.computed.text);
  const std::string puller = HttpGet(MetricsPort(dir + "/prefill1.ready"), "/metrics");
  EXPECT_EQ(MetricValue(puller, "pdserve_kv_checksum_failures_total{path=\"pull\"}"), 1) << puller << c.Logs();
  EXPECT_EQ(MetricValue(puller, "pdserve_kv_pulls_total{result=\"published\"}"), 0) << puller;
  EXPECT_EQ(MetricValue(puller, "pdserve_prefix_cache_blocks_total{result=\"hit\"}"), 0) << puller;
  EXPECT_EQ(c.Status().prefill(1).kv_checksum_failures(), 1);
  std::ifstream f(dir + "/prefill1.log");
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(absl::StrContains(log, "kv_checksum_mismatch")) << log;
  EXPECT_TRUE(absl::StrContains(log, "\"path\":\"pull\"")) << log;
}

}  // namespace
}  // namespace pdserve
