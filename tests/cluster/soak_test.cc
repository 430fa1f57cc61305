// Soak: a random-weight Llama with the 32000-token SentencePiece tokenizer
// (byte fallback) behind a real disaggregated cluster, a few hundred sampled
// requests with seeded random prompts, several at a time. The model's output
// head favours the 256 byte tokens, so streams put bytes together in every
// way a trained model rarely does: characters split across tokens, runs that
// turn invalid part way, bytes next to words. Every stream must
// end with its final message and valid UTF-8, and the cluster must end with
// nothing in flight and no KV held (the prefix cache aside).
#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "model/safetensors.h"
#include "model/synthetic_model.h"
#include "text/unicode_util.h"
#include "gtest/gtest.h"
#include "tests/cluster/byte_model.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

constexpr int kRequests = 200;
constexpr int kClients = 8;
constexpr auto kRequestDeadline = std::chrono::seconds(30);

// Random token ids (never the special <unk>, <s>, </s>), sampled at
// temperature 1 with its own seed.
v1::GenerateRequest RandomRequest(std::mt19937& rng, int index) {
  v1::GenerateRequest r;
  r.set_request_id(absl::StrCat("soak-", index));
  const int len = std::uniform_int_distribution<int>(1, 96)(rng);
  std::uniform_int_distribution<int> id(3, kVocab - 1);
  for (int i = 0; i < len; ++i) r.mutable_token_ids()->add_ids(id(rng));
  r.set_max_tokens(std::uniform_int_distribution<int>(24, 48)(rng));
  r.mutable_sampling()->set_temperature(1.0f);
  r.mutable_sampling()->set_seed(rng());
  return r;
}

// Streams `req` and returns what is wrong with the stream ("" if nothing).
std::string CheckStream(v1::Generation::Stub& stub, const v1::GenerateRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kRequestDeadline);
  auto reader = stub.Generate(&ctx, req);
  std::vector<std::string> problems;
  std::vector<int32_t> tokens;
  std::string text;
  bool has_final = false;
  v1::GenerateFinal final;
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    if (has_final) problems.push_back("a message after the final one");
    if (m.has_chunk()) {
      tokens.insert(tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
      if (!tok::IsValidUtf8(m.chunk().text())) {
        problems.push_back(absl::StrCat("chunk text after ", tokens.size(), " tokens is not valid UTF-8"));
      }
      text += m.chunk().text();
    } else if (m.has_final()) {
      has_final = true;
      final = m.final();
    }
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) {
    problems.push_back(absl::StrCat("status ", status.error_code(), " (", status.error_message(), ") after ",
                                    tokens.size(), " tokens"));
  }
  if (!has_final) problems.push_back("no final message");
  if (has_final) {
    if (final.finish_reason() != v1::FINISH_REASON_LENGTH && final.finish_reason() != v1::FINISH_REASON_STOP) {
      problems.push_back(
          absl::StrCat("finish reason ", v1::FinishReason_Name(final.finish_reason()), ": ", final.error()));
    }
    if (final.usage().completion_tokens() != static_cast<int>(tokens.size())) {
      problems.push_back(
          absl::StrCat(tokens.size(), " token ids streamed, usage says ", final.usage().completion_tokens()));
    }
    if (final.usage().prompt_tokens() != req.token_ids().ids_size()) {
      problems.push_back(
          absl::StrCat("usage prompt_tokens ", final.usage().prompt_tokens(), ", sent ", req.token_ids().ids_size()));
    }
    if (final.finish_reason() == v1::FINISH_REASON_LENGTH && static_cast<int>(tokens.size()) != req.max_tokens()) {
      problems.push_back(absl::StrCat("length finish after ", tokens.size(), " of ", req.max_tokens(), " tokens"));
    }
  }
  if (!tok::IsValidUtf8(text)) problems.push_back("the text is not valid UTF-8");
  if (problems.empty()) return "";
  return absl::StrCat(req.request_id(), " (prompt ", req.token_ids().ids_size(), " ids, seed ", req.sampling().seed(),
                      ", max_tokens ", req.max_tokens(), "): ", absl::StrJoin(problems, "; "));
}

// The router's requests in flight: 0 as soon as it is, else the count when
// `wait` runs out.
int64_t InFlightAfterSettling(Cluster& c, absl::Duration wait = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + wait;
  int64_t in_flight = -1;
  while (absl::Now() < deadline) {
    in_flight = c.Status().requests_in_flight();
    if (in_flight == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return in_flight;
}

TEST(ClusterSoakTest, SampledStreamsFromAByteFallbackTokenizerEndCleanly) {
  const std::string dir = TempDir() + "/soak";
  // After the cluster stops; the logs stay for a failure's post-mortem.
  const absl::Cleanup remove_model = [&] { std::filesystem::remove_all(dir + "/model"); };
  Cluster c;
  c.model = MakeByteFallbackModel(dir + "/model");
  ASSERT_FALSE(testing::Test::HasFailure());
  const absl::Status started = c.Start(dir, /*colocated=*/false);
  ASSERT_TRUE(started.ok()) << started << "\n" << c.Logs();

  // The router tokenizes text with the fixture's tokenizer (BOS/EOS from its config).
  v1::GenerateRequest hello;
  hello.set_text("Hello, world");
  hello.set_max_tokens(4);
  const Output greeted = c.Generate(hello);
  ASSERT_TRUE(greeted.status.ok()) << greeted.status.error_message() << "\n" << c.Logs();
  EXPECT_GT(greeted.final.usage().prompt_tokens(), 0);

  std::mt19937 rng(17);
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < kRequests; ++i) requests.push_back(RandomRequest(rng, i));

  // After the first bad stream no new request starts: one is enough to fail,
  // and a hang would otherwise cost a deadline per request.
  std::atomic<int> next{0}, finished{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> clients;
  for (int t = 0; t < kClients; ++t) {
    clients.emplace_back([&] {
      for (int i = next++; i < kRequests && !stop; i = next++) {
        std::string problem = CheckStream(*c.stub(), requests[i]);
        ++finished;
        if (problem.empty()) continue;
        stop = true;
        std::lock_guard<std::mutex> lock(mu);
        failures.push_back(std::move(problem));
      }
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_TRUE(failures.empty()) << failures.size() << " bad streams in " << finished.load() << " of " << kRequests
                                << " requests sent:\n"
                                << absl::StrJoin(failures, "\n") << "\n"
                                << c.Logs();

  EXPECT_EQ(InFlightAfterSettling(c), 0) << c.Status().ShortDebugString();
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
}

}  // namespace
}  // namespace pdserve
