#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "proto/convert.h"

namespace pdserve::rpc {
namespace {

// As the router resolves one (every sampling field set).
worker::v1::WorkRequest Work() {
  GenerationRequest r;
  r.prompt = {5, 6};
  r.params.max_tokens = 4;
  r.params.seed = 7;
  worker::v1::WorkRequest w;
  ToWork(r, &w);
  return w;
}

WorkLimits Limits() { return {.eos_ids = {2}, .vocab_size = 10, .max_positions = 8}; }

void ExpectRefused(const worker::v1::WorkRequest& w, const std::string& field, const WorkLimits& limits = Limits()) {
  absl::StatusOr<std::unique_ptr<Generation>> made = AcceptWork(w, limits);
  ASSERT_FALSE(made.ok()) << field;
  EXPECT_TRUE(absl::IsInvalidArgument(made.status())) << made.status();
  EXPECT_TRUE(absl::StartsWith(made.status().message(), field)) << made.status();
}

TEST(AcceptWorkTest, AValidRequestIsConvertedOnceWithItsGeneratedIdsReplayed) {
  worker::v1::WorkRequest w = Work();
  w.add_generated_ids(8);
  absl::StatusOr<std::unique_ptr<Generation>> made = AcceptWork(w, Limits());
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ((*made)->request().prompt, (std::vector<int32_t>{5, 6}));
  EXPECT_EQ((*made)->request().params.max_tokens, 4);
  EXPECT_EQ((*made)->request().eos_ids, (std::vector<int32_t>{2}));
  EXPECT_EQ((*made)->AllTokens(), (std::vector<int32_t>{5, 6, 8}));
  EXPECT_FALSE((*made)->finished());
}

TEST(AcceptWorkTest, EachInvalidFieldIsRefusedByName) {
  worker::v1::WorkRequest empty = Work();
  empty.clear_prompt_ids();
  ExpectRefused(empty, "prompt_ids: empty");
  worker::v1::WorkRequest outside = Work();
  outside.add_prompt_ids(10);
  ExpectRefused(outside, "prompt_ids: 10 is outside the vocabulary");
  worker::v1::WorkRequest negative = Work();
  negative.set_temperature(-1);
  ExpectRefused(negative, "sampling: 'temperature'");
  worker::v1::WorkRequest too_long = Work();
  too_long.set_max_tokens(7);
  ExpectRefused(too_long, "max_tokens: prompt (2) + max_tokens (7) exceeds the context (8)");
  worker::v1::WorkRequest bad_generated = Work();
  bad_generated.add_generated_ids(-1);
  ExpectRefused(bad_generated, "generated_ids: -1 is outside the vocabulary");
  worker::v1::WorkRequest finished = Work();
  finished.add_generated_ids(2);  // EOS
  ExpectRefused(finished, "generated_ids: already finished");
}

TEST(AcceptWorkTest, TheContextIsCheckedOnlyWhereTheWorkerHoldsTheSequence) {
  worker::v1::WorkRequest w = Work();
  w.set_max_tokens(7);
  WorkLimits prefill = Limits();
  prefill.max_positions = 0;
  EXPECT_TRUE(AcceptWork(w, prefill).ok());
}

}  // namespace
}  // namespace pdserve::rpc
