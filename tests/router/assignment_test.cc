#include "router/assignment.h"

#include <memory>
#include <utility>

#include "gtest/gtest.h"

namespace pdserve::router {
namespace {

WorkerPtr NewWorker(Role role) { return std::make_shared<Worker>("w:1", role, nullptr); }

TEST(AssignmentTest, TakesInFlightAndQueuedTokensAndGivesThemBackWhenDestroyed) {
  WorkerPtr w = NewWorker(Role::kPrefill);
  {
    Assignment a(w, 300);
    EXPECT_TRUE(a.held());
    EXPECT_EQ(w->in_flight.load(), 1);
    EXPECT_EQ(w->queued_tokens.load(), 300);
    Assignment b(w, 20);
    EXPECT_EQ(w->in_flight.load(), 2);
    EXPECT_EQ(w->queued_tokens.load(), 320);
  }
  EXPECT_EQ(w->in_flight.load(), 0);
  EXPECT_EQ(w->queued_tokens.load(), 0);
}

TEST(AssignmentTest, DequeuedTokensAreGivenBackOnceAndInFlightStaysHeld) {
  WorkerPtr w = NewWorker(Role::kPrefill);
  Assignment a(w, 300);
  a.DequeueTokens();
  a.DequeueTokens();
  EXPECT_EQ(w->queued_tokens.load(), 0);
  EXPECT_EQ(w->in_flight.load(), 1);
  a.Release();
  a.Release();
  EXPECT_FALSE(a.held());
  EXPECT_EQ(w->in_flight.load(), 0);
  EXPECT_EQ(w->queued_tokens.load(), 0);
}

TEST(AssignmentTest, AMoveCarriesTheClaimAndAssigningOverAHeldOneGivesThatBack) {
  WorkerPtr first = NewWorker(Role::kDecode);
  WorkerPtr second = NewWorker(Role::kDecode);
  Assignment a(first, 0);
  Assignment moved(std::move(a));
  EXPECT_FALSE(a.held());  // NOLINT(bugprone-use-after-move): a moved-from Assignment holds nothing
  EXPECT_EQ(first->in_flight.load(), 1);
  moved = Assignment(second, 0);  // a migration to another decode worker
  EXPECT_EQ(first->in_flight.load(), 0);
  EXPECT_EQ(second->in_flight.load(), 1);
  moved = Assignment();
  EXPECT_EQ(second->in_flight.load(), 0);
}

}  // namespace
}  // namespace pdserve::router
