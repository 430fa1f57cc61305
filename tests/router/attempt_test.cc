#include "router/attempt.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kv_transfer/grant.h"
#include "tests/router/in_process_router.h"

namespace pdserve::router::testing {
namespace {

TEST(HostOfAddressTest, TheHostOfEachFormOfAddress) {
  EXPECT_EQ(HostOfAddress("10.0.0.7:7100"), "10.0.0.7");
  EXPECT_EQ(HostOfAddress("[::1]:7100"), "::1");
  EXPECT_EQ(HostOfAddress("prefill-0.pdserve:7100"), "prefill-0.pdserve");
  EXPECT_EQ(HostOfAddress("p0"), "p0");
}

class AttemptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rig_.AddWorker(Role::kPrefill, "p0");
    rig_.AddWorker(Role::kDecode, "d0");
    rig_.ProbeAll();
    request_ = InProcessRouter::Request(8);
  }
  InProcessRouter rig_;
  GenerationRequest request_;
};

TEST_F(AttemptTest, TheWorkRequestCarriesTheAttemptsIdAndEveryTokenAlreadyStreamed) {
  const std::vector<int32_t> streamed = {11, 12};
  Attempt a(request_, "req-1-7", streamed);
  EXPECT_EQ(a.work().request_id(), "req-1-7");
  EXPECT_EQ(std::vector<int32_t>(a.work().generated_ids().begin(), a.work().generated_ids().end()), streamed);
  EXPECT_EQ(a.work().max_tokens(), request_.params.max_tokens);
  std::vector<int32_t> context = request_.prompt;
  context.insert(context.end(), streamed.begin(), streamed.end());
  EXPECT_EQ(a.context(), context);
  EXPECT_TRUE(a.DecodeRequest(true).prefill_here());
  EXPECT_FALSE(a.DecodeRequest(false).prefill_here());
  EXPECT_EQ(a.DecodeRequest(false).request().request_id(), "req-1-7");
}

TEST_F(AttemptTest, WithoutAKeyThePrefillRequestCarriesNoGrant) {
  Attempt a(request_, "req-1-7", {});
  const worker::v1::PrefillRequest r =
      a.PrefillRequest(*rig_.Find(Role::kPrefill, "p0"), *rig_.Find(Role::kDecode, "d0"), nullptr, absl::Now(),
                       absl::Seconds(60));
  EXPECT_EQ(r.decode_kv_address(), "d0-kv");
  EXPECT_TRUE(r.kv_grant().empty());
}

TEST_F(AttemptTest, EachPrefillAttemptGetsItsOwnGrantBindingTheContext) {
  absl::StatusOr<kv::GrantKey> key = kv::GrantKey::FromBytes(std::string(32, 'k'));
  ASSERT_TRUE(key.ok()) << key.status();
  const std::vector<int32_t> streamed = {11};
  Attempt a(request_, "req-1-7", streamed);
  const absl::Time now = absl::FromUnixSeconds(1'800'000'000);
  const Worker& p = *rig_.Find(Role::kPrefill, "p0");
  const Worker& d = *rig_.Find(Role::kDecode, "d0");
  for (uint32_t attempt : {1u, 2u}) {
    const worker::v1::PrefillRequest r = a.PrefillRequest(p, d, &*key, now, absl::Seconds(60));
    absl::StatusOr<kv::Grant> g = kv::DecodeGrant(r.kv_grant());
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->request_id, "req-1-7");
    EXPECT_EQ(g->attempt, attempt);
    EXPECT_EQ(g->sender, "p0");
    EXPECT_EQ(g->receiver, "d0-kv");
    EXPECT_EQ(g->positions, static_cast<int32_t>(request_.prompt.size()) + request_.params.max_tokens);
    EXPECT_EQ(g->tokens_digest, kv::DigestTokens(a.context(), request_.cache_salt));
    kv::GrantRefusal why;
    EXPECT_TRUE(kv::VerifyGrant(*key, *g, "d0-kv", now + absl::Seconds(59), &why).ok());
    EXPECT_FALSE(kv::VerifyGrant(*key, *g, "d0-kv", now + absl::Seconds(61), &why).ok());
  }
}

}  // namespace
}  // namespace pdserve::router::testing
