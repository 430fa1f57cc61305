#include "router/prefix_index.h"

#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace pdserve::router {
namespace {

BlockHash H(uint64_t v) { return BlockHash{v, ~v}; }

KvEvent Stored(uint64_t id, uint64_t h, uint64_t parent) {
  return KvEvent{id, KvEventKind::kStored, H(h), parent == 0 ? BlockHash{} : H(parent)};
}
KvEvent Removed(uint64_t id, uint64_t h) { return KvEvent{id, KvEventKind::kRemoved, H(h), {}}; }
KvEvent Cleared(uint64_t id) { return KvEvent{id, KvEventKind::kCleared, {}, {}}; }

const absl::Time kNow = absl::FromUnixSeconds(1000);

TEST(PrefixIndexTest, FollowsStoredRemovedAndClearedEvents) {
  PrefixIndex index;
  EXPECT_EQ(index.NextAfter("w"), 0u);
  const std::vector<KvEvent> first = {Cleared(1), Stored(2, 10, 0), Stored(3, 11, 10), Stored(4, 12, 11)};
  index.Apply("w", 7, first, false, 4);
  EXPECT_EQ(index.NextAfter("w"), 4u);
  EXPECT_EQ(index.NumBlocks("w"), 3);
  const std::vector<BlockHash> prompt = {H(10), H(11), H(12), H(13)};
  EXPECT_EQ(index.MatchBlocks("w", prompt, kNow), 3);
  // Removing the middle block ends the match there, as the worker's lookup would.
  const std::vector<KvEvent> second = {Removed(5, 11)};
  index.Apply("w", 7, second, false, 5);
  EXPECT_EQ(index.MatchBlocks("w", prompt, kNow), 1);
  const std::vector<KvEvent> third = {Cleared(6), Stored(7, 20, 0)};
  index.Apply("w", 7, third, false, 7);
  EXPECT_EQ(index.MatchBlocks("w", prompt, kNow), 0);
  EXPECT_EQ(index.NumBlocks("w"), 1);
  // Other workers are untouched and unknown ones match nothing.
  EXPECT_EQ(index.MatchBlocks("other", prompt, kNow), 0);
}

TEST(PrefixIndexTest, ASnapshotReplacesWhatWasKnown) {
  PrefixIndex index;
  const std::vector<KvEvent> a = {Cleared(1), Stored(2, 10, 0), Stored(3, 11, 10)};
  index.Apply("w", 7, a, false, 3);
  const std::vector<KvEvent> snap = {Cleared(40), Stored(40, 30, 0)};
  index.Apply("w", 7, snap, true, 40);
  EXPECT_EQ(index.NumBlocks("w"), 1);
  EXPECT_EQ(index.NextAfter("w"), 40u);
  const std::vector<BlockHash> p = {H(30)};
  EXPECT_EQ(index.MatchBlocks("w", p, kNow), 1);
}

TEST(PrefixIndexTest, AGapEmptiesTheEntryAndAsksForEverythingAgain) {
  PrefixIndex index;
  const std::vector<KvEvent> a = {Cleared(1), Stored(2, 10, 0)};
  index.Apply("w", 7, a, false, 2);
  const std::vector<KvEvent> skipped = {Stored(5, 11, 10)};  // 3 and 4 are missing.
  index.Apply("w", 7, skipped, false, 5);
  EXPECT_EQ(index.NumBlocks("w"), 0);
  EXPECT_EQ(index.NextAfter("w"), 0u);
}

TEST(PrefixIndexTest, ARestartedWorkerStartsFromNothing) {
  PrefixIndex index;
  const std::vector<KvEvent> a = {Cleared(1), Stored(2, 10, 0), Stored(3, 11, 10)};
  index.Apply("w", 7, a, false, 3);
  // The new process (instance 8) answers "after 3" with its own events 4..:
  // they are not a continuation, so nothing is applied and the next read
  // starts from 0.
  const std::vector<KvEvent> foreign = {Stored(4, 50, 0)};
  index.Apply("w", 8, foreign, false, 4);
  EXPECT_EQ(index.NumBlocks("w"), 0);
  EXPECT_EQ(index.NextAfter("w"), 0u);
  const std::vector<KvEvent> fresh = {Cleared(1), Stored(2, 50, 0), Stored(3, 51, 50), Stored(4, 52, 51)};
  index.Apply("w", 8, fresh, false, 4);
  EXPECT_EQ(index.NumBlocks("w"), 3);
}

TEST(PrefixIndexTest, ADroppedWorkerMatchesNothing) {
  PrefixIndex index;
  const std::vector<KvEvent> a = {Cleared(1), Stored(2, 10, 0)};
  index.Apply("dead", 7, a, false, 2);
  index.Apply("alive", 9, a, false, 2);
  index.Drop("dead");
  const std::vector<BlockHash> p = {H(10)};
  EXPECT_EQ(index.MatchBlocks("dead", p, kNow), 0);
  EXPECT_EQ(index.NumBlocks("dead"), 0);
  EXPECT_EQ(index.NextAfter("dead"), 0u);
  EXPECT_EQ(index.MatchBlocks("alive", p, kNow), 1);
}

TEST(PrefixIndexTest, ExpectedBlocksCountUntilTheyExpireOrAreRemoved) {
  PrefixIndex index;
  const std::vector<KvEvent> a = {Cleared(1), Stored(2, 10, 0)};
  index.Apply("w", 7, a, false, 2);
  const std::vector<BlockHash> p = {H(10), H(11), H(12)};
  index.Expect("w", p, kNow, absl::Seconds(2));
  EXPECT_EQ(index.MatchBlocks("w", p, kNow + absl::Seconds(1)), 3);
  EXPECT_EQ(index.MatchBlocks("w", p, kNow + absl::Seconds(3)), 1);  // Expired.
  EXPECT_EQ(index.NumBlocks("w"), 1);                                  // Not counted as stored.
  // The worker's events win over an expectation.
  index.Expect("w", p, kNow, absl::Seconds(2));
  const std::vector<KvEvent> b = {Stored(3, 11, 10), Removed(4, 11)};
  index.Apply("w", 7, b, false, 4);
  EXPECT_EQ(index.MatchBlocks("w", p, kNow + absl::Seconds(1)), 1);
}

}  // namespace
}  // namespace pdserve::router
