// API keys: the file's format (errors name the line), checks against the
// hashes, reloads when the file changes (on the injected clock's schedule),
// and that a broken file keeps the keys last read.
#include "router/api_keys.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/router/fake_clock.h"

namespace pdserve::router {
namespace {

class ApiKeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = absl::StrCat(::testing::TempDir(), "/keys-", getpid(), "-",
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { std::remove(path_.c_str()); }
  // Replaces the file (a new inode, as a Secret update does).
  void Write(const std::string& text) {
    const std::string tmp = path_ + ".tmp";
    std::ofstream(tmp) << text;
    std::filesystem::rename(tmp, path_);
  }
  std::string path_;
  FakeClock clock_;
};

TEST(Sha256HexTest, MatchesTheKnownDigest) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST_F(ApiKeysTest, AValidKeyGivesItsIdAndOthersAreRefusedWithoutQuotingThem) {
  Write(absl::StrCat("# team keys\n\nalice:", Sha256Hex("sk-alice-1"), "\nbob:", Sha256Hex("sk-bob-2"), "\n"));
  absl::StatusOr<std::unique_ptr<ApiKeys>> keys = ApiKeys::Load(path_, clock_.clock());
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ((*keys)->size(), 2u);
  EXPECT_EQ(*(*keys)->Check("Bearer sk-bob-2"), "bob");
  EXPECT_EQ(*(*keys)->Check("bearer   sk-alice-1"), "alice");
  EXPECT_EQ(*(*keys)->Check("sk-alice-1"), "alice");  // gRPC clients may send the key alone
  const absl::StatusOr<std::string> wrong = (*keys)->Check("Bearer sk-mallory");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong.status().message(), "invalid API key");
  const absl::StatusOr<std::string> none = (*keys)->Check("");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(absl::StartsWith(none.status().message(), "no API key"));
}

TEST_F(ApiKeysTest, AChangedFileIsReadAgainWithinASecond) {
  Write(absl::StrCat("alice:", Sha256Hex("k1"), "\n"));
  std::unique_ptr<ApiKeys> keys = *ApiKeys::Load(path_, clock_.clock());
  Write(absl::StrCat("carol:", Sha256Hex("k2"), "\n"));
  // Not yet due: the old keys still hold.
  EXPECT_EQ(*keys->Check("Bearer k1"), "alice");
  clock_.now += absl::Seconds(1);
  EXPECT_EQ(*keys->Check("Bearer k2"), "carol");
  EXPECT_FALSE(keys->Check("Bearer k1").ok());
}

TEST_F(ApiKeysTest, ABrokenFileKeepsTheKeysLastRead) {
  Write(absl::StrCat("alice:", Sha256Hex("k1"), "\n"));
  std::unique_ptr<ApiKeys> keys = *ApiKeys::Load(path_, clock_.clock());
  Write("alice:not-a-hash\n");
  clock_.now += absl::Seconds(1);
  EXPECT_EQ(*keys->Check("Bearer k1"), "alice");
}

TEST_F(ApiKeysTest, ErrorsNameTheLine) {
  Write(absl::StrCat("alice:", Sha256Hex("k1"), "\nbob:sk-plain-key\n"));
  absl::StatusOr<std::unique_ptr<ApiKeys>> keys = ApiKeys::Load(path_, clock_.clock());
  ASSERT_FALSE(keys.ok());
  EXPECT_TRUE(absl::StrContains(keys.status().message(), ":2: the hash must be 64 lowercase hex digits"))
      << keys.status();
  Write(absl::StrCat("alice:", Sha256Hex("k1"), "\nalice:", Sha256Hex("k2"), "\n"));
  EXPECT_TRUE(absl::StrContains(ApiKeys::Load(path_).status().message(), ":2: key id 'alice' repeated"));
  Write("no colon here\n");
  EXPECT_TRUE(absl::StrContains(ApiKeys::Load(path_).status().message(), ":1: expected ID:SHA256HEX"));
  EXPECT_EQ(ApiKeys::Load(path_ + ".missing").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ApiKeysTest, LimitsParseAndBadOnesNameTheLine) {
  const std::string h = Sha256Hex("k");
  Write(absl::StrCat("a:", h, " rate=2.5 concurrency=3\nb:", h.substr(0, 63), "0 burst=4 rate=1\n"));
  EXPECT_TRUE(ApiKeys::Load(path_, clock_.clock()).ok());
  for (const std::string& bad : {absl::StrCat("a:", h, " rate=0"), absl::StrCat("a:", h, " rate=x"),
                                 absl::StrCat("a:", h, " speed=3"), absl::StrCat("a:", h, " concurrency=1.5"),
                                 absl::StrCat("a b:", h), absl::StrCat("a\"x:", h)}) {
    Write(bad);
    absl::StatusOr<std::unique_ptr<ApiKeys>> k = ApiKeys::Load(path_, clock_.clock());
    EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(k.status().message(), ":1: ")) << k.status();
  }
}

TEST_F(ApiKeysTest, ARateLimitedKeyGetsItsBurstThenOneRequestPerInterval) {
  Write(absl::StrCat("alice:", Sha256Hex("sk-a"), " rate=2 burst=3\nbob:", Sha256Hex("sk-b"), "\n"));
  std::unique_ptr<ApiKeys> keys = *ApiKeys::Load(path_, clock_.clock());
  std::vector<KeyLease> held;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<KeyLease> l = keys->Admit("Bearer sk-a");
    ASSERT_TRUE(l.ok()) << i << ": " << l.status();
    EXPECT_EQ(l->id(), "alice");
    held.push_back(*std::move(l));
  }
  const absl::StatusOr<KeyLease> over = keys->Admit("Bearer sk-a");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.status().message(), "API key 'alice': over its limit of 2 requests/s"))
      << over.status();
  EXPECT_FALSE(absl::StrContains(over.status().message(), "sk-a"));
  // An empty bucket refills at 2/s: one more in half a second.
  EXPECT_EQ(std::string(*over.status().GetPayload(kRetryAfterPayload)), "0.5");
  clock_.now += absl::Milliseconds(500);
  EXPECT_TRUE(keys->Admit("Bearer sk-a").ok());
  EXPECT_FALSE(keys->Admit("Bearer sk-a").ok());
  // Another key has its own limits (none here).
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(keys->Admit("Bearer sk-b").ok());
  // A bad key is refused as before.
  EXPECT_EQ(keys->Admit("Bearer nope").status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(ApiKeysTest, AConcurrencyLimitCountsLeasesUntilTheyEndAcrossAReload) {
  Write(absl::StrCat("alice:", Sha256Hex("sk-a"), " concurrency=2\n"));
  std::unique_ptr<ApiKeys> keys = *ApiKeys::Load(path_, clock_.clock());
  std::optional<KeyLease> first = *keys->Admit("sk-a");
  KeyLease second = *keys->Admit("Bearer sk-a");
  const absl::StatusOr<KeyLease> third = keys->Admit("Bearer sk-a");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(third.status().message(), "2 requests in flight, its limit")) << third.status();
  first.reset();  // a generation ends
  KeyLease again = *keys->Admit("Bearer sk-a");
  EXPECT_EQ(again.id(), "alice");
  // A reload (a new limit) keeps the key's requests in flight.
  Write(absl::StrCat("alice:", Sha256Hex("sk-a"), " concurrency=3\n"));
  clock_.now += absl::Seconds(2);
  KeyLease third_now = *keys->Admit("Bearer sk-a");
  EXPECT_FALSE(keys->Admit("Bearer sk-a").ok());
  // A moved lease is released once.
  KeyLease moved = std::move(second);
  moved = KeyLease();
  EXPECT_TRUE(keys->Admit("Bearer sk-a").ok());
}

}  // namespace
}  // namespace pdserve::router
