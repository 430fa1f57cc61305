// The serving benchmark's pure parts: trace parsing, workload generation,
// goodput classification and the SVG picture, without a cluster.
#include "tools/pdctl/bench_workload.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/pdctl/bench_results.h"
#include "tools/pdctl/bench_svg.h"
#include "tools/pdctl/bench_trace.h"

namespace pdserve::pdctl {
namespace {

using ::testing::HasSubstr;

TEST(BenchTraceTest, ParsesLinesWithAndWithoutPrefixesAndSkipsBlankOnes) {
  const auto trace = ParseTraceJsonl(
      "{\"prompt_tokens\": 12, \"output_tokens\": 3}\n"
      "\n"
      "  \r\n"
      "{\"prompt_tokens\": 40, \"output_tokens\": 8, \"prefix_group\": 7, \"prefix_tokens\": 32, \"ts\": 1.5}\r\n"
      "{\"output_tokens\": 1, \"prompt_tokens\": 1}",
      "t.jsonl");
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_EQ(trace->size(), 3u);
  EXPECT_EQ((*trace)[0].prompt_tokens, 12);
  EXPECT_EQ((*trace)[0].output_tokens, 3);
  EXPECT_EQ((*trace)[0].prefix_group, -1);
  EXPECT_EQ((*trace)[1].prefix_group, 7);
  EXPECT_EQ((*trace)[1].prefix_tokens, 32);
  EXPECT_EQ((*trace)[2].prompt_tokens, 1);
}

TEST(BenchTraceTest, ErrorsNameTheSourceTheLineAndTheField) {
  struct Case {
    std::string text, message;
  };
  const std::string ok = "{\"prompt_tokens\": 4, \"output_tokens\": 4}\n";
  const std::vector<Case> cases = {
      {ok + "{\"prompt_tokens\": 4", "t.jsonl line 2: not valid JSON"},
      {ok + "\n[1, 2]", "t.jsonl line 3: expected a JSON object, got array"},
      {"{\"output_tokens\": 4}", "t.jsonl line 1: 'prompt_tokens' is missing"},
      {"{\"prompt_tokens\": 4}", "t.jsonl line 1: 'output_tokens' is missing"},
      {"{\"prompt_tokens\": 0, \"output_tokens\": 4}",
       "line 1: 'prompt_tokens' must be an integer in [1, 1048576], got 0"},
      {"{\"prompt_tokens\": 4, \"output_tokens\": -3}",
       "line 1: 'output_tokens' must be an integer in [1, 1048576], got -3"},
      {"{\"prompt_tokens\": 4.5, \"output_tokens\": 4}", "'prompt_tokens' must be an integer in [1, 1048576], got 4.5"},
      {"{\"prompt_tokens\": \"4\", \"output_tokens\": 4}",
       "'prompt_tokens' must be an integer in [1, 1048576], got \"4\""},
      {"{\"prompt_tokens\": 99999999999999999999, \"output_tokens\": 4}", "'prompt_tokens' must be an integer"},
      {"{\"prompt_tokens\": 4, \"output_tokens\": 4, \"prefix_group\": 1, \"prefix_tokens\": 5}",
       "'prefix_tokens' must be an integer in [0, 4], got 5"},
      {"{\"prompt_tokens\": 4, \"output_tokens\": 4, \"prefix_group\": -1, \"prefix_tokens\": 2}",
       "'prefix_group' must be an integer in [0, "},
      {"{\"prompt_tokens\": 4, \"output_tokens\": 4, \"prefix_tokens\": 2}",
       "line 1: 'prefix_tokens' needs 'prefix_group' beside it"},
      {"{\"prompt_tokens\": 4, \"output_tokens\": 4, \"prefix_group\": 2}",
       "line 1: 'prefix_group' needs 'prefix_tokens' beside it"},
      {"\n  \n", "t.jsonl: no requests (empty trace)"},
      {ok + "{\"prompt_tokens\": \"" + std::string(500, 'x') + "\", \"output_tokens\": 1}", "got \"xxxxxxxx"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text.substr(0, 80));
    const auto trace = ParseTraceJsonl(c.text, "t.jsonl");
    ASSERT_FALSE(trace.ok());
    EXPECT_EQ(trace.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(trace.status().message(), "t.jsonl")) << trace.status();
    EXPECT_THAT(trace.status().message(), HasSubstr(c.message));
    EXPECT_LT(trace.status().message().size(), 200u) << "a long value is cut short";
  }
}

TEST(BenchTraceTest, AMissingFileIsNotFound) {
  const auto trace = ReadTraceFile("/nonexistent/trace.jsonl");
  EXPECT_EQ(trace.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(trace.status().message(), HasSubstr("/nonexistent/trace.jsonl"));
}

size_t CommonPrefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  return std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin();
}

TEST(BenchWorkloadTest, SharedPrefixesAreExactPerGroupDistinctAcrossGroupsAndDrawnAtRandom) {
  WorkloadOptions o;
  o.vocab_size = 50;
  o.requests = 23;
  o.prompt_min = 3;
  o.prompt_max = 9;
  o.output_min = o.output_max = 5;
  o.shared_prefix_groups = 4;
  o.shared_prefix_tokens = 16;
  const auto work = MakeWorkload(o);
  ASSERT_TRUE(work.ok()) << work.status();
  ASSERT_EQ(work->size(), 23u);
  std::vector<int> per_group(4, 0);
  int lockstep = 0;  // Requests whose group is their index mod 4.
  for (size_t i = 0; i < work->size(); ++i) {
    const WorkloadRequest& w = (*work)[i];
    ASSERT_GE(w.prefix_group, 0);
    ASSERT_LT(w.prefix_group, 4);
    ++per_group[w.prefix_group];
    lockstep += w.prefix_group == static_cast<int64_t>(i % 4) ? 1 : 0;
    EXPECT_EQ(w.prefix_tokens, 16);
    EXPECT_GE(w.prompt.size(), 16u + 3);
    EXPECT_LE(w.prompt.size(), 16u + 9);
    EXPECT_EQ(w.max_tokens, 5);
    for (int32_t t : w.prompt) {
      EXPECT_GE(t, 0);
      EXPECT_LT(t, 50);
    }
    for (size_t j = 0; j < i; ++j) {
      const WorkloadRequest& v = (*work)[j];
      const size_t shared = CommonPrefix(w.prompt, v.prompt);
      if (v.prefix_group == w.prefix_group) {
        EXPECT_EQ(shared, 16u) << i << " and " << j << " share exactly the prefix";
      } else {
        EXPECT_EQ(shared, 0u) << i << " and " << j << " are in different groups";
      }
    }
  }
  for (int g = 0; g < 4; ++g) EXPECT_GT(per_group[g], 0) << "group " << g << " never drawn";
  // Uniform draws put about a quarter (23 / 4) in lockstep by chance.
  EXPECT_LE(lockstep, 11) << "groups drawn at random, not in lockstep with the request index";
  const auto again = MakeWorkload(o);
  ASSERT_TRUE(again.ok());
  for (size_t i = 0; i < work->size(); ++i) EXPECT_EQ((*again)[i].prompt, (*work)[i].prompt) << "seeded";
}

TEST(BenchWorkloadTest, MultiTurnTurnsResendTheirConversationsHistoryRoundByRound) {
  WorkloadOptions o;
  o.vocab_size = 1000;
  o.requests = 40;  // 10 conversations of 4 turns
  o.prompt_min = 8;
  o.prompt_max = 12;
  o.output_min = o.output_max = 5;
  o.multi_turn_turns = 4;
  o.multi_turn_system_tokens = 64;
  o.shared_prefix_groups = 3;
  o.draw_gaps = true;
  absl::StatusOr<std::vector<WorkloadRequest>> work = MakeWorkload(o);
  ASSERT_TRUE(work.ok()) << work.status();
  ASSERT_EQ(work->size(), 40u);
  std::map<int32_t, const WorkloadRequest*> last;  // by conversation
  std::map<int64_t, std::vector<int32_t>> systems;
  for (size_t i = 0; i < work->size(); ++i) {
    const WorkloadRequest& w = (*work)[i];
    EXPECT_EQ(w.turn, static_cast<int32_t>(i / 10)) << "every conversation's turn t before any turn t+1";
    EXPECT_GT(w.unit_gap, 0);
    ASSERT_GE(w.prompt.size(), 64u + 8u);
    const std::vector<int32_t> system(w.prompt.begin(), w.prompt.begin() + 64);
    auto [it, fresh] = systems.emplace(w.prefix_group, system);
    EXPECT_EQ(it->second, system) << "one system prompt per group";
    if (auto prev = last.find(w.conversation); prev != last.end()) {
      const std::vector<int32_t>& before = prev->second->prompt;
      // The earlier turn, its reply (5 tokens), then 8-12 new ones.
      ASSERT_GE(w.prompt.size(), before.size() + 5 + 8);
      EXPECT_LE(w.prompt.size(), before.size() + 5 + 12);
      EXPECT_TRUE(std::equal(before.begin(), before.end(), w.prompt.begin())) << "the history is resent whole";
      EXPECT_EQ(w.prefix_group, prev->second->prefix_group);
    } else {
      EXPECT_EQ(w.turn, 0);
    }
    last[w.conversation] = &w;
  }
  EXPECT_EQ(last.size(), 10u);
  EXPECT_LE(systems.size(), 3u);
  // Distinct system prompts differ from their first token on.
  std::set<int32_t> firsts;
  for (const auto& [g, p] : systems) firsts.insert(p[0]);
  EXPECT_EQ(firsts.size(), systems.size());
  // Two conversations on one system prompt part right after it.
  o.multi_turn_turns = 1;
  o.requests = 4;
  o.shared_prefix_groups = 1;
  work = MakeWorkload(o);
  ASSERT_TRUE(work.ok());
  EXPECT_NE((*work)[0].prompt[64], (*work)[1].prompt[64]);
}

TEST(BenchWorkloadTest, RandomLengthsStayInRangeAndGapsScaleWithRate) {
  WorkloadOptions o;
  o.vocab_size = 1000;
  o.requests = 200;
  o.prompt_min = 4;
  o.prompt_max = 12;
  o.output_min = 2;
  o.output_max = 6;
  o.draw_gaps = true;
  const auto work = MakeWorkload(o);
  ASSERT_TRUE(work.ok()) << work.status();
  double sum = 0;
  for (const WorkloadRequest& w : *work) {
    EXPECT_EQ(w.prefix_group, -1);
    EXPECT_GE(w.prompt.size(), 4u);
    EXPECT_LE(w.prompt.size(), 12u);
    EXPECT_GE(w.max_tokens, 2);
    EXPECT_LE(w.max_tokens, 6);
    EXPECT_GT(w.unit_gap, 0);
    sum += w.unit_gap;
  }
  EXPECT_NEAR(sum / 200, 1.0, 0.25) << "Exp(1) gaps";
  const std::vector<double> slow = ArrivalTimes(*work, 2), fast = ArrivalTimes(*work, 8);
  EXPECT_EQ(slow[0], 0);
  for (size_t i = 1; i < slow.size(); ++i) {
    EXPECT_GT(slow[i], slow[i - 1]);
    EXPECT_NEAR(fast[i] * 4, slow[i], 1e-9 * slow[i]);
  }
  o.draw_gaps = false;
  const auto closed = MakeWorkload(o);
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ((*closed)[0].prompt, (*work)[0].prompt) << "gaps are drawn after a request's lengths";
  EXPECT_EQ((*closed)[0].unit_gap, 0);
}

TEST(BenchWorkloadTest, TraceGivesLengthsAndGroupsInItsOrder) {
  WorkloadOptions o;
  o.vocab_size = 100;
  o.trace = {{10, 2, -1, 0}, {8, 3, 42, 6}, {20, 4, 5, 12}, {9, 1, 42, 4}, {6, 5, 42, 6}};
  const auto work = MakeWorkload(o);
  ASSERT_TRUE(work.ok()) << work.status();
  ASSERT_EQ(work->size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ((*work)[i].prompt.size(), static_cast<size_t>(o.trace[i].prompt_tokens));
    EXPECT_EQ((*work)[i].max_tokens, o.trace[i].output_tokens);
  }
  EXPECT_EQ((*work)[1].prefix_group, 0) << "groups numbered in order of appearance";
  EXPECT_EQ((*work)[2].prefix_group, 1);
  EXPECT_EQ(CommonPrefix((*work)[1].prompt, (*work)[4].prompt), 6u);
  EXPECT_EQ(CommonPrefix((*work)[1].prompt, (*work)[3].prompt), 4u);
  EXPECT_EQ(CommonPrefix((*work)[1].prompt, (*work)[2].prompt), 0u);
}

TEST(BenchWorkloadTest, ImpossibleOptionsAreInvalidArguments) {
  WorkloadOptions o;
  o.vocab_size = 3;
  o.shared_prefix_groups = 4;
  o.shared_prefix_tokens = 8;
  EXPECT_THAT(MakeWorkload(o).status().message(), HasSubstr("4 groups, more than the vocabulary's 3 ids"));
  o.shared_prefix_groups = 2;
  o.shared_prefix_tokens = 0;
  EXPECT_EQ(MakeWorkload(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.shared_prefix_groups = 0;
  o.prompt_min = 5;
  o.prompt_max = 4;
  EXPECT_THAT(MakeWorkload(o).status().message(), HasSubstr("--prompt-tokens"));
  o.prompt_max = 5;
  o.trace = {{1, 1, 0, 1}, {1, 1, 1, 1}, {1, 1, 2, 1}, {1, 1, 3, 1}};
  EXPECT_THAT(MakeWorkload(o).status().message(), HasSubstr("4 prefix groups"));
}

RequestResult Completed(double ttft, std::vector<double> itl) {
  RequestResult r;
  r.outcome = RequestOutcome::kCompleted;
  r.ttft = ttft;
  r.e2e = ttft;
  for (double g : itl) r.e2e += g;
  r.tokens = static_cast<int32_t>(itl.size()) + 1;
  r.itl = std::move(itl);
  return r;
}

TEST(BenchGoodputTest, AGoodRequestMeetsTtftAndItsOwnP99Itl) {
  const LatencyTargets targets{0.100, 0.020};
  EXPECT_TRUE(MeetsTargets(Completed(0.100, {0.010, 0.020}), targets)) << "at the targets is good";
  EXPECT_FALSE(MeetsTargets(Completed(0.101, {0.010}), targets));
  EXPECT_FALSE(MeetsTargets(Completed(0.050, {0.010, 0.030}), targets)) << "p99 of few gaps is the largest";
  std::vector<double> many(199, 0.010);
  many.push_back(0.500);
  EXPECT_TRUE(MeetsTargets(Completed(0.050, many), targets)) << "one stall in 200 gaps is past the p99";
  EXPECT_TRUE(MeetsTargets(Completed(0.050, {}), targets)) << "one token: no gaps";
  EXPECT_TRUE(MeetsTargets(Completed(5, {5}), LatencyTargets{})) << "no targets: every completed request";
  RequestResult rejected = Completed(0.01, {});
  rejected.outcome = RequestOutcome::kRejected;
  EXPECT_FALSE(MeetsTargets(rejected, LatencyTargets{}));
}

// The first gap (token 1 -> 2, where a handoff shows) apart from the
// steady gaps after it; one-token requests have neither.
TEST(BenchGoodputTest, FirstGapIsSummarizedApartFromTheSteadyGaps) {
  const BenchRow row = Summarize({Completed(0.05, {0.030, 0.010, 0.010}), Completed(0.05, {0.050, 0.012}),
                                  Completed(0.05, {})},
                                 1.0, LatencyTargets{});
  EXPECT_EQ(row.first_gap.sorted, (std::vector<double>{0.030, 0.050}));
  EXPECT_EQ(row.steady_itl.sorted, (std::vector<double>{0.010, 0.010, 0.012}));
  EXPECT_EQ(row.itl.sorted.size(), 5u);
  const auto j = RowJson(row);
  EXPECT_DOUBLE_EQ(j["first_gap_seconds"]["p99"].get<double>(), 0.050);
  EXPECT_DOUBLE_EQ(j["steady_itl_seconds"]["p50"].get<double>(), 0.010);
}

TEST(BenchGoodputTest, SummarizeCountsRejectedApartFromFailedAndComputesGoodput) {
  std::vector<RequestResult> results = {Completed(0.05, {0.01, 0.01}), Completed(0.5, {0.01, 0.01}),
                                        Completed(0.05, {0.01, 0.09})};
  RequestResult rejected;
  rejected.outcome = RequestOutcome::kRejected;
  rejected.error = "KV pool full";
  RequestResult failed;
  failed.outcome = RequestOutcome::kFailed;
  failed.error = "worker gone";
  results.push_back(rejected);
  results.push_back(rejected);
  results.push_back(failed);
  const BenchRow row = Summarize(results, 2.0, LatencyTargets{0.1, 0.05});
  EXPECT_EQ(row.requests, 6);
  EXPECT_EQ(row.completed, 3);
  EXPECT_EQ(row.rejected, 2);
  EXPECT_EQ(row.failed, 1);
  EXPECT_EQ(row.good, 1);
  EXPECT_EQ(row.first_error, "KV pool full");
  EXPECT_DOUBLE_EQ(row.requests_per_second, 1.5);
  EXPECT_DOUBLE_EQ(row.tokens_per_second, 4.5);
  EXPECT_DOUBLE_EQ(row.good_requests_per_second, 0.5);
  EXPECT_DOUBLE_EQ(row.good_tokens_per_second, 1.5);
  EXPECT_EQ(row.ttft.sorted, (std::vector<double>{0.05, 0.05, 0.5}));
  EXPECT_EQ(row.itl.sorted.size(), 6u);
  EXPECT_DOUBLE_EQ(row.ttft.p50, 0.05);
  const nlohmann::ordered_json j = RowJson(row);
  EXPECT_EQ(j["rejected"], 2);
  EXPECT_EQ(j["failed"], 1);
  EXPECT_DOUBLE_EQ(j["goodput"]["requests_per_second"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(j["throughput"]["output_tokens_per_second"].get<double>(), 4.5);
  for (const char* k : {"ttft_seconds", "itl_seconds", "e2e_seconds"}) {
    for (const char* p : {"p50", "p90", "p99"}) EXPECT_TRUE(j[k].contains(p)) << k << " " << p;
  }
}

TEST(BenchGoodputTest, PrefixCacheFiguresCountCompletedRequestsOnly) {
  std::vector<RequestResult> results = {Completed(0.05, {0.01}), Completed(0.05, {0.01}), Completed(0.05, {0.01})};
  results[0].prompt_tokens = 200;
  results[1].prompt_tokens = 200;
  results[1].cached_prompt_tokens = 160;
  results[2].prompt_tokens = 100;
  results[2].cached_prompt_tokens = 80;
  results[2].local_prefill = true;
  RequestResult failed;
  failed.prompt_tokens = 1000;  // Not completed: not counted.
  failed.cached_prompt_tokens = 1000;
  results.push_back(failed);
  const BenchRow row = Summarize(results, 1.0, LatencyTargets{});
  EXPECT_EQ(row.prompt_tokens, 500);
  EXPECT_EQ(row.cached_prompt_tokens, 240);
  EXPECT_EQ(row.local_prefills, 1);
  EXPECT_DOUBLE_EQ(row.prefix_hit_rate(), 0.48);
  const nlohmann::ordered_json j = RowJson(row);
  EXPECT_DOUBLE_EQ(j["prefix_cache"]["hit_rate"].get<double>(), 0.48);
  EXPECT_EQ(j["prefix_cache"]["local_prefills"], 1);
  // The in-process engine reports none: no prefix_cache object.
  EXPECT_FALSE(RowJson(Summarize({Completed(0.05, {0.01})}, 1.0, LatencyTargets{})).contains("prefix_cache"));
}

// Checks that tags nest and close (a small XML well-formedness check: no
// DTD, comments or CDATA in what the renderer writes) and returns the
// element names in document order.
std::vector<std::string> CheckWellFormed(const std::string& svg) {
  std::vector<std::string> stack, names;
  size_t i = 0;
  EXPECT_TRUE(absl::StartsWith(svg, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg "));
  i = svg.find("?>") + 2;
  while ((i = svg.find('<', i)) != std::string::npos) {
    const size_t end = svg.find('>', i);
    if (end == std::string::npos) {
      ADD_FAILURE() << "unclosed tag at " << i;
      break;
    }
    std::string tag = svg.substr(i + 1, end - i - 1);
    EXPECT_EQ(tag.find('<'), std::string::npos) << tag;
    EXPECT_EQ(std::count(tag.begin(), tag.end(), '"') % 2, 0) << "unbalanced quotes in " << tag;
    if (tag[0] == '/') {
      EXPECT_FALSE(stack.empty()) << tag;
      if (!stack.empty()) {
        EXPECT_EQ(stack.back(), tag.substr(1));
        stack.pop_back();
      }
    } else {
      const std::string name = tag.substr(0, tag.find_first_of(" />"));
      names.push_back(name);
      if (tag.back() != '/') stack.push_back(name);
    }
    i = end + 1;
  }
  EXPECT_TRUE(stack.empty()) << "unclosed: " << (stack.empty() ? "" : stack.back());
  // Every '&' starts an entity.
  for (size_t a = svg.find('&'); a != std::string::npos; a = svg.find('&', a + 1)) {
    const std::string rest = svg.substr(a, 6);
    EXPECT_TRUE(absl::StartsWith(rest, "&amp;") || absl::StartsWith(rest, "&lt;") || absl::StartsWith(rest, "&gt;") ||
                absl::StartsWith(rest, "&quot;") || absl::StartsWith(rest, "&apos;"))
        << rest;
  }
  return names;
}

BenchRow Row(const std::string& target, double rate, double ttft) {
  std::vector<RequestResult> results;
  for (int i = 0; i < 20; ++i) results.push_back(Completed(ttft * (1 + 0.05 * i), {0.01, 0.012, 0.015}));
  BenchRow row = Summarize(results, 10.0 / rate, LatencyTargets{ttft * 1.5, 0.014});
  row.target = target;
  row.rate = rate;
  return row;
}

TEST(BenchSvgTest, HasEveryRowsCdfsAndThroughputAndGoodputAgainstRate) {
  const std::vector<BenchRow> rows = {Row("cluster", 2, 0.04), Row("cluster", 4, 0.05), Row("cluster", 8, 0.09),
                                      Row("in-process", 2, 0.03)};
  const std::string svg = RenderBenchSvg(rows, "bench <a & b>");
  const std::vector<std::string> names = CheckWellFormed(svg);
  EXPECT_EQ(names.front(), "svg");
  EXPECT_THAT(svg, HasSubstr("xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_THAT(svg, HasSubstr("bench &lt;a &amp; b&gt;"));
  for (const char* label : {"TTFT (ms)", "ITL (ms)", "offered rate (requests/s)", "output tokens/s",
                            "completed requests/s", "fraction of requests"}) {
    EXPECT_THAT(svg, HasSubstr(label));
  }
  for (const BenchRow& r : rows) {
    for (const char* panel : {"ttft-cdf", "itl-cdf"}) {
      EXPECT_THAT(svg, HasSubstr(std::string("data-panel=\"") + panel + "\" data-series=\"" + r.Label() + "\""))
          << panel << " " << r.Label();
    }
  }
  for (const char* panel : {"requests-rate", "tokens-rate"}) {
    for (const char* series :
         {"cluster throughput", "cluster goodput", "in-process throughput", "in-process goodput"}) {
      EXPECT_THAT(svg, HasSubstr(std::string("data-panel=\"") + panel + "\" data-series=\"" + series + "\""))
          << panel << " " << series;
    }
  }
  // The cluster's throughput line has one point per rate.
  const size_t at = svg.find("data-panel=\"requests-rate\" data-series=\"cluster throughput\" points=\"");
  ASSERT_NE(at, std::string::npos);
  const size_t from = svg.find("points=\"", at) + 8;
  const std::string points = svg.substr(from, svg.find('"', from) - from);
  EXPECT_EQ(std::count(points.begin(), points.end(), ','), 3) << points;
}

TEST(BenchSvgTest, ClosedLoopAndEmptyRowsStillMakeAValidPicture) {
  BenchRow closed = Row("cluster", 1, 0.05);
  closed.rate = 0;
  closed.concurrency = 8;
  BenchRow empty = Summarize({}, 1.0, LatencyTargets{});
  empty.target = "cluster";
  empty.rate = 4;
  const std::string svg = RenderBenchSvg({closed, empty}, "closed");
  CheckWellFormed(svg);
  EXPECT_THAT(svg, HasSubstr("data-series=\"cluster c=8\""));
  EXPECT_THAT(svg, HasSubstr("cluster 4 req/s (no data)"));
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::pdctl
