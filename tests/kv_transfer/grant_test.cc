#include "kv_transfer/grant.h"

#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace pdserve::kv {
namespace {

GrantKey Key(char c) { return *GrantKey::FromBytes(std::string(40, c)); }

GrantFields Fields(std::string request, uint32_t attempt, std::string sender, std::string receiver,
                   absl::Time expires) {
  return {.request_id = std::move(request),
          .attempt = attempt,
          .sender = std::move(sender),
          .receiver = std::move(receiver),
          .expires = expires,
          .positions = 96,
          .tokens_digest = DigestTokens({1, 2, 3})};
}

TEST(GrantTest, RoundTripsAndVerifiesForItsReceiverUntilItExpires) {
  const absl::Time now = absl::FromUnixSeconds(2'000'000'000);
  absl::StatusOr<Grant> g = MintGrant(Key('a'), Fields("req-1", 3, "10.0.0.1", "10.0.0.2:7300", now + absl::Seconds(60)));
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<Grant> back = DecodeGrant(EncodeGrant(*g));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->request_id, "req-1");
  EXPECT_EQ(back->attempt, 3u);
  EXPECT_EQ(back->sender, "10.0.0.1");
  EXPECT_EQ(back->receiver, "10.0.0.2:7300");
  EXPECT_EQ(back->positions, 96);
  EXPECT_EQ(back->tokens_digest, DigestTokens({1, 2, 3}));
  EXPECT_NE(back->tokens_digest, DigestTokens({1, 2, 4}));
  EXPECT_NE(DigestTokens({}), DigestTokens({0}));
  GrantRefusal why;
  EXPECT_TRUE(VerifyGrant(Key('a'), *back, "10.0.0.2:7300", now, &why).ok());
  EXPECT_EQ(why, GrantRefusal::kNone);
  EXPECT_FALSE(VerifyGrant(Key('b'), *back, "10.0.0.2:7300", now, &why).ok());
  EXPECT_EQ(why, GrantRefusal::kBadMac);
  EXPECT_FALSE(VerifyGrant(Key('a'), *back, "10.0.0.3:7300", now, &why).ok());
  EXPECT_EQ(why, GrantRefusal::kWrongReceiver);
  absl::Status late = VerifyGrant(Key('a'), *back, "10.0.0.2:7300", now + absl::Seconds(60), &why);
  EXPECT_EQ(late.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(why, GrantRefusal::kExpired);
}

TEST(GrantTest, EveryFieldIsCoveredByTheMac) {
  const absl::Time now = absl::FromUnixSeconds(2'000'000'000);
  const Grant g = *MintGrant(Key('a'), Fields("req-1", 3, "10.0.0.1", "10.0.0.2:7300", now + absl::Seconds(60)));
  const std::string bytes = EncodeGrant(g);
  // Flip each byte after the magic in turn: the grant no longer verifies
  // (or no longer decodes).
  for (size_t i = 4; i < bytes.size(); ++i) {
    std::string b = bytes;
    b[i] ^= 0x01;
    absl::StatusOr<Grant> d = DecodeGrant(b);
    if (!d.ok()) continue;
    GrantRefusal why;
    EXPECT_FALSE(VerifyGrant(Key('a'), *d, d->receiver, now, &why).ok()) << "byte " << i;
  }
}

TEST(GrantTest, MalformedGrantsAreRefusedWithoutTrustingCounts) {
  EXPECT_FALSE(DecodeGrant("").ok());
  EXPECT_FALSE(DecodeGrant("XXXX").ok());
  const Grant g = *MintGrant(Key('a'), Fields("r", 1, "h", "d:1", absl::Now() + absl::Seconds(1)));
  const std::string bytes = EncodeGrant(g);
  for (size_t n = 0; n < bytes.size(); ++n) EXPECT_FALSE(DecodeGrant(bytes.substr(0, n)).ok()) << n;
  EXPECT_FALSE(DecodeGrant(bytes + "x").ok());
  std::string huge = "PDG2";
  huge += std::string("\xff\xff\xff\x7f", 4);  // A string "longer" than the buffer and the limit.
  EXPECT_FALSE(DecodeGrant(huge).ok());
  EXPECT_FALSE(MintGrant(Key('a'), Fields(std::string(kGrantMaxField + 1, 'r'), 1, "h", "d:1", absl::Now())).ok());
  GrantFields none = Fields("r", 1, "h", "d:1", absl::Now());
  none.positions = 0;
  EXPECT_FALSE(MintGrant(Key('a'), none).ok());
}

TEST(GrantTest, SenderBindsToTheConnectionsAddressWhenItIsAnIpLiteral) {
  EXPECT_TRUE(SenderMatches("10.0.0.1", "10.0.0.1"));
  EXPECT_FALSE(SenderMatches("10.0.0.1", "10.0.0.7"));
  EXPECT_FALSE(SenderMatches("::1", "127.0.0.1"));
  EXPECT_TRUE(SenderMatches("prefill-0.pdserve", "10.0.0.7"));  // A name: not resolved (docs/security.md).
  EXPECT_TRUE(SenderMatches("10.0.0.1", ""));                   // A transport that cannot tell.
}

TEST(GrantTest, KeysComeFromFilesOfAtLeast32Bytes) {
  const std::string dir = testing::TempDir();
  {
    std::ofstream(dir + "/short.key") << "0123456789\n";
    std::ofstream(dir + "/good.key") << std::string(64, 'f') << "\n";
  }
  absl::StatusOr<GrantKey> short_key = GrantKey::FromFile(dir + "/short.key");
  EXPECT_EQ(short_key.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(short_key.status().message()).find("short.key"), std::string::npos);
  absl::StatusOr<GrantKey> good = GrantKey::FromFile(dir + "/good.key");
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->bytes(), std::string(64, 'f'));  // The newline is not part of it.
  EXPECT_EQ(GrantKey::FromFile(dir + "/missing.key").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve::kv
