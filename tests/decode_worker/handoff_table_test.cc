#include "decode_worker/handoff_table.h"

#include <memory>
#include <vector>

#include "kv/kv_manager.h"
#include "gtest/gtest.h"

namespace pdserve::decode {
namespace {

using engine::RequestId;
using S = HandoffState;
using Commit = HandoffTable::CommitOutcome;
using Call = HandoffTable::CallOutcome;

// A Decode call as the table sees it: what it was told.
struct Waiter : HandoffWaiter {
  void OnHandoff(HandedOff seq) override { got.push_back(std::move(seq)); }
  void OnNoHandoff(NoHandoff why) override { told.push_back(why); }
  std::vector<HandedOff> got;
  std::vector<NoHandoff> told;
};

class HandoffTableTest : public ::testing::Test {
 protected:
  HandoffTableTest() {
    absl::StatusOr<std::unique_ptr<KvManager>> kv =
        KvManager::Create({.num_layers = 2, .num_kv_heads = 1, .head_dim = 4, .block_size = 4, .dtype = DType::kF32,
                           .num_blocks = 16});
    EXPECT_TRUE(kv.ok()) << kv.status();
    kv_ = *std::move(kv);
  }

  // A handoff holding `blocks` of the pool, with first token `token`.
  HandedOff Kv(int32_t blocks, int32_t token = 7) {
    HandedOff h;
    h.kv = kv_->NewSequence();
    EXPECT_TRUE(kv_->Grow(h.kv, blocks * 4).ok());
    h.first.token = token;
    return h;
  }
  int32_t used() { return kv_->Counts().used; }

  std::unique_ptr<KvManager> kv_;
  ManualTimer timer_;
  HandoffTable table_{&timer_, {.wait = absl::Seconds(30), .remember = absl::Minutes(5)}};
  const RequestId a_{"a"};
};

TEST(HandoffTransitions, TheDiagramAndNothingElse) {
  const std::optional<S> none;
  EXPECT_TRUE(IsLegalHandoffTransition(none, S::kAwaitingCall));
  EXPECT_TRUE(IsLegalHandoffTransition(none, S::kAwaitingKv));
  EXPECT_TRUE(IsLegalHandoffTransition(none, S::kReleased));
  EXPECT_FALSE(IsLegalHandoffTransition(none, S::kClaimed));
  EXPECT_FALSE(IsLegalHandoffTransition(none, S::kAbandoned));

  EXPECT_TRUE(IsLegalHandoffTransition(S::kAwaitingCall, S::kClaimed));
  EXPECT_TRUE(IsLegalHandoffTransition(S::kAwaitingCall, S::kAbandoned));
  EXPECT_TRUE(IsLegalHandoffTransition(S::kAwaitingCall, S::kReleased));
  EXPECT_FALSE(IsLegalHandoffTransition(S::kAwaitingCall, S::kAwaitingKv));
  EXPECT_FALSE(IsLegalHandoffTransition(S::kAwaitingCall, S::kAwaitingCall));

  EXPECT_TRUE(IsLegalHandoffTransition(S::kAwaitingKv, S::kAwaitingKv));
  EXPECT_TRUE(IsLegalHandoffTransition(S::kAwaitingKv, S::kClaimed));
  EXPECT_TRUE(IsLegalHandoffTransition(S::kAwaitingKv, S::kAbandoned));
  EXPECT_TRUE(IsLegalHandoffTransition(S::kAwaitingKv, S::kReleased));
  EXPECT_FALSE(IsLegalHandoffTransition(S::kAwaitingKv, S::kAwaitingCall));

  // A claimed id never waits again, and nothing comes back from released.
  for (S to : {S::kAwaitingCall, S::kAwaitingKv, S::kClaimed, S::kAbandoned}) {
    EXPECT_FALSE(IsLegalHandoffTransition(S::kClaimed, to)) << HandoffStateName(to);
    EXPECT_FALSE(IsLegalHandoffTransition(S::kReleased, to)) << HandoffStateName(to);
  }
  EXPECT_TRUE(IsLegalHandoffTransition(S::kClaimed, S::kReleased));
  EXPECT_FALSE(IsLegalHandoffTransition(S::kReleased, S::kReleased));

  EXPECT_TRUE(IsLegalHandoffTransition(S::kAbandoned, S::kAwaitingKv));
  EXPECT_TRUE(IsLegalHandoffTransition(S::kAbandoned, S::kReleased));
  EXPECT_FALSE(IsLegalHandoffTransition(S::kAbandoned, S::kAwaitingCall));
  EXPECT_FALSE(IsLegalHandoffTransition(S::kAbandoned, S::kClaimed));
}

TEST_F(HandoffTableTest, CommitThenCallDeliversAndADuplicateIsFreed) {
  EXPECT_EQ(table_.Commit(a_, Kv(2, 11)), Commit::kParked);
  EXPECT_EQ(table_.state(a_), S::kAwaitingCall);
  EXPECT_EQ(table_.parked_kv(), 1);
  EXPECT_EQ(used(), 2);

  auto w = std::make_shared<Waiter>();
  EXPECT_EQ(table_.Call(a_, w), Call::kDelivered);
  ASSERT_EQ(w->got.size(), 1u);
  EXPECT_EQ(w->got[0].first.token, 11);
  EXPECT_EQ(table_.state(a_), S::kClaimed);
  EXPECT_EQ(table_.parked_kv(), 0);

  // A retried prefill's second commit: freed at once, the first kept.
  EXPECT_EQ(table_.Commit(a_, Kv(3)), Commit::kDuplicate);
  EXPECT_EQ(used(), 2);
  // A second call finds the KV taken, and is refused at once.
  EXPECT_EQ(table_.Call(a_, std::make_shared<Waiter>()), Call::kTaken);
  EXPECT_EQ(w->got.size(), 1u);
}

TEST_F(HandoffTableTest, CallThenCommitDeliversToTheWaiter) {
  auto w = std::make_shared<Waiter>();
  EXPECT_EQ(table_.Call(a_, w), Call::kParked);
  EXPECT_EQ(table_.state(a_), S::kAwaitingKv);
  EXPECT_TRUE(w->got.empty());
  EXPECT_EQ(table_.Commit(a_, Kv(1, 5)), Commit::kDelivered);
  ASSERT_EQ(w->got.size(), 1u);
  EXPECT_EQ(w->got[0].first.token, 5);
  EXPECT_EQ(table_.state(a_), S::kClaimed);
  EXPECT_TRUE(w->told.empty());
}

TEST_F(HandoffTableTest, AnUnclaimedCommitIsFreedAtItsOwnDeadline) {
  EXPECT_EQ(table_.Commit(a_, Kv(2)), Commit::kParked);
  timer_.Advance(absl::Seconds(29));
  EXPECT_EQ(used(), 2);
  EXPECT_EQ(table_.state(a_), S::kAwaitingCall);
  timer_.Advance(absl::Seconds(1));
  EXPECT_EQ(used(), 0);
  EXPECT_EQ(table_.parked_kv(), 0);
  EXPECT_EQ(table_.state(a_), S::kAbandoned);
  // A call that comes late waits for a new commit (a retried prefill).
  auto w = std::make_shared<Waiter>();
  EXPECT_EQ(table_.Call(a_, w), Call::kParked);
  EXPECT_EQ(table_.Commit(a_, Kv(1)), Commit::kDelivered);
  EXPECT_EQ(w->got.size(), 1u);
}

TEST_F(HandoffTableTest, AWaitingCallTimesOutAndALateCommitIsFreedOnArrival) {
  auto w = std::make_shared<Waiter>();
  EXPECT_EQ(table_.Call(a_, w), Call::kParked);
  timer_.Advance(absl::Seconds(30));
  ASSERT_EQ(w->told.size(), 1u);
  EXPECT_EQ(w->told[0], NoHandoff::kTimedOut);
  EXPECT_EQ(table_.state(a_), S::kAbandoned);
  EXPECT_EQ(table_.Commit(a_, Kv(2)), Commit::kNoTaker);
  EXPECT_EQ(used(), 0);
  EXPECT_TRUE(w->got.empty());
}

TEST_F(HandoffTableTest, EndStatesAreRememberedThenForgotten) {
  auto w = std::make_shared<Waiter>();
  table_.Call(a_, w);
  table_.CallEnded(a_, w.get());
  EXPECT_EQ(table_.state(a_), S::kAbandoned);
  EXPECT_TRUE(w->told.empty());  // It ended itself: nothing to tell it.
  timer_.Advance(absl::Minutes(5) - absl::Seconds(1));
  EXPECT_EQ(table_.state(a_), S::kAbandoned);
  timer_.Advance(absl::Seconds(1));
  EXPECT_EQ(table_.state(a_), std::nullopt);
  EXPECT_EQ(table_.size(), 0);
  EXPECT_EQ(timer_.pending(), 0u);  // No timer outlives its entry.
}

TEST_F(HandoffTableTest, ANewerCallDisplacesTheWaitingOneAndRestartsTheDeadline) {
  auto first = std::make_shared<Waiter>();
  auto second = std::make_shared<Waiter>();
  table_.Call(a_, first);
  timer_.Advance(absl::Seconds(20));
  EXPECT_EQ(table_.Call(a_, second), Call::kParked);
  ASSERT_EQ(first->told.size(), 1u);
  EXPECT_EQ(first->told[0], NoHandoff::kDisplaced);
  // The displaced call's own end does not touch the newer one's wait.
  table_.CallEnded(a_, first.get());
  EXPECT_EQ(table_.state(a_), S::kAwaitingKv);
  timer_.Advance(absl::Seconds(20));  // 40 s after the first, 20 after the second.
  EXPECT_TRUE(second->told.empty());
  EXPECT_EQ(table_.Commit(a_, Kv(1)), Commit::kDelivered);
  EXPECT_EQ(second->got.size(), 1u);
  EXPECT_TRUE(first->got.empty());
}

TEST_F(HandoffTableTest, ReleaseFreesParkedKvTellsAWaiterAndRefusesWhatComesLater) {
  EXPECT_EQ(table_.Commit(a_, Kv(3)), Commit::kParked);
  EXPECT_TRUE(table_.Release(a_));
  EXPECT_EQ(used(), 0);
  EXPECT_EQ(table_.state(a_), S::kReleased);
  EXPECT_EQ(table_.Call(a_, std::make_shared<Waiter>()), Call::kReleased);
  EXPECT_EQ(table_.Commit(a_, Kv(1)), Commit::kNoTaker);
  EXPECT_EQ(used(), 0);
  EXPECT_FALSE(table_.Release(a_));  // Again: nothing more to free.

  const RequestId b("b");
  auto w = std::make_shared<Waiter>();
  table_.Call(b, w);
  EXPECT_FALSE(table_.Release(b));
  ASSERT_EQ(w->told.size(), 1u);
  EXPECT_EQ(w->told[0], NoHandoff::kReleased);

  // Released before anything came: both sides are settled on arrival.
  const RequestId c("c");
  EXPECT_FALSE(table_.Release(c));
  EXPECT_EQ(table_.Commit(c, Kv(2)), Commit::kNoTaker);
  EXPECT_EQ(used(), 0);
}

TEST_F(HandoffTableTest, AnAbandonedIdTakesANewCall) {
  auto w = std::make_shared<Waiter>();
  table_.Call(a_, w);
  table_.CallEnded(a_, w.get());
  EXPECT_EQ(table_.Commit(a_, Kv(1)), Commit::kNoTaker);
  auto again = std::make_shared<Waiter>();
  EXPECT_EQ(table_.Call(a_, again), Call::kParked);
  EXPECT_EQ(table_.state(a_), S::kAwaitingKv);
  EXPECT_EQ(table_.Commit(a_, Kv(1)), Commit::kDelivered);
  EXPECT_EQ(again->got.size(), 1u);
}

TEST_F(HandoffTableTest, AWaiterMayCallBackInWhenTold) {
  // A timed-out call ends itself, which reports CallEnded: no deadlock, and
  // the entry stays abandoned.
  struct Reentrant : HandoffWaiter {
    HandoffTable* table = nullptr;
    RequestId id;
    void OnHandoff(HandedOff) override {}
    void OnNoHandoff(NoHandoff) override { table->CallEnded(id, this); }
  };
  auto w = std::make_shared<Reentrant>();
  w->table = &table_;
  w->id = a_;
  table_.Call(a_, w);
  timer_.Advance(absl::Seconds(30));
  EXPECT_EQ(table_.state(a_), S::kAbandoned);
}

TEST_F(HandoffTableTest, DestroyingTheTableFreesParkedKvAndItsTimers) {
  {
    HandoffTable t(&timer_, {});
    t.Commit(a_, Kv(4));
    t.Call(RequestId("b"), std::make_shared<Waiter>());
    EXPECT_EQ(used(), 4);
    EXPECT_EQ(timer_.pending(), 2u);
  }
  EXPECT_EQ(used(), 0);
  EXPECT_EQ(timer_.pending(), 0u);
}

}  // namespace
}  // namespace pdserve::decode
