#include "engine/request.h"

#include <atomic>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace pdserve::engine {
namespace {

using S = RequestState;
using R = EndReason;

const S kStates[] = {S::kWaiting,  S::kWaitingForKv, S::kPrefilling, S::kHandingOff,
                     S::kDecoding, S::kPreempted,    S::kFinished};
const R kReasons[] = {R::kNone, R::kStop, R::kLength, R::kCancelled, R::kError, R::kHandedOff};

// The diagram in request.h, written out edge by edge (independently of
// IsLegalTransition's switch).
std::set<std::tuple<S, S, R>> LegalEdges() {
  std::set<std::tuple<S, S, R>> e = {
      {S::kWaiting, S::kPrefilling, R::kNone},       {S::kWaiting, S::kWaitingForKv, R::kNone},
      {S::kWaitingForKv, S::kDecoding, R::kNone},    {S::kPrefilling, S::kDecoding, R::kNone},
      {S::kPrefilling, S::kHandingOff, R::kNone},    {S::kPrefilling, S::kPreempted, R::kNone},
      {S::kDecoding, S::kPreempted, R::kNone},       {S::kPreempted, S::kPrefilling, R::kNone},
      {S::kPrefilling, S::kFinished, R::kStop},      {S::kPrefilling, S::kFinished, R::kLength},
      {S::kWaitingForKv, S::kFinished, R::kStop},    {S::kWaitingForKv, S::kFinished, R::kLength},
      {S::kDecoding, S::kFinished, R::kStop},        {S::kDecoding, S::kFinished, R::kLength},
      {S::kHandingOff, S::kFinished, R::kHandedOff},
  };
  for (S s : kStates) {
    if (s == S::kFinished) continue;
    e.insert({s, S::kFinished, R::kCancelled});
    e.insert({s, S::kFinished, R::kError});
  }
  return e;
}

// A lifecycle brought to `s` along legal edges.
void BringTo(RequestLifecycle& l, S s) {
  auto step = [&l](S to, R r = R::kNone) { ASSERT_TRUE(l.Transition(to, r).ok()); };
  switch (s) {
    case S::kWaiting: break;
    case S::kWaitingForKv: step(S::kWaitingForKv); break;
    case S::kPrefilling: step(S::kPrefilling); break;
    case S::kHandingOff: step(S::kPrefilling); step(S::kHandingOff); break;
    case S::kDecoding: step(S::kPrefilling); step(S::kDecoding); break;
    case S::kPreempted: step(S::kPrefilling); step(S::kDecoding); step(S::kPreempted); break;
    case S::kFinished: step(S::kFinished, R::kCancelled); break;
  }
  ASSERT_EQ(l.state(), s);
}

TEST(RequestLifecycleTest, EveryTransitionIsLegalExactlyWhenTheDiagramHasIt) {
  const std::set<std::tuple<S, S, R>> legal = LegalEdges();
  int checked = 0, allowed = 0;
  for (S from : kStates) {
    for (S to : kStates) {
      for (R reason : kReasons) {
        const bool want = legal.contains({from, to, reason});
        SCOPED_TRACE(testing::Message() << RequestStateName(from) << " -> " << RequestStateName(to) << " ("
                                        << EndReasonName(reason) << ")");
        EXPECT_EQ(IsLegalTransition(from, to, reason), want);
        RequestLifecycle l;
        BringTo(l, from);
        const R before = l.end_reason();
        const absl::Status st = l.Transition(to, reason);
        if (want) {
          EXPECT_TRUE(st.ok()) << st;
          EXPECT_EQ(l.state(), to);
          EXPECT_EQ(l.end_reason(), reason);
          ++allowed;
        } else {
          EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
          EXPECT_TRUE(absl::StrContains(st.message(), RequestStateName(from))) << st;
          EXPECT_EQ(l.state(), from) << "a refused transition changed the state";
          EXPECT_EQ(l.end_reason(), before);
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, kNumRequestStates * kNumRequestStates * kNumEndReasons);
  EXPECT_EQ(allowed, static_cast<int>(legal.size()));
}

TEST(RequestLifecycleTest, NamesAreDistinct) {
  absl::flat_hash_set<std::string> names;
  for (S s : kStates) names.insert(RequestStateName(s));
  EXPECT_EQ(names.size(), static_cast<size_t>(kNumRequestStates));
  names.clear();
  for (R r : kReasons) names.insert(EndReasonName(r));
  EXPECT_EQ(names.size(), static_cast<size_t>(kNumEndReasons));
}

TEST(RequestLifecycleTest, FinishReasonsMapToEndReasons) {
  EXPECT_EQ(EndReasonFor(FinishReason::kNone), R::kNone);
  EXPECT_EQ(EndReasonFor(FinishReason::kStop), R::kStop);
  EXPECT_EQ(EndReasonFor(FinishReason::kLength), R::kLength);
}

// Two threads ending one request (say the engine's error and the caller's
// cancel): exactly one of them ends it, and its reason stays.
TEST(RequestLifecycleTest, RacingFinishesEndTheRequestOnce) {
  for (int round = 0; round < 200; ++round) {
    RequestLifecycle l;
    ASSERT_TRUE(l.Transition(S::kPrefilling).ok());
    ASSERT_TRUE(l.Transition(S::kDecoding).ok());
    std::atomic<int> won{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (R r : {R::kCancelled, R::kError, R::kStop, R::kLength}) {
      threads.emplace_back([&, r] {
        while (!go.load()) {
        }
        if (l.Transition(S::kFinished, r).ok()) won.fetch_add(1);
      });
    }
    go = true;
    for (auto& t : threads) t.join();
    EXPECT_EQ(won.load(), 1);
    EXPECT_TRUE(l.finished());
    EXPECT_NE(l.end_reason(), R::kNone);
  }
}

TEST(RequestIdTest, ComparesAndHashesByValue) {
  absl::flat_hash_set<RequestId> ids = {RequestId("a"), RequestId("b"), RequestId("a")};
  EXPECT_EQ(ids.size(), 2u);
  EXPECT_TRUE(ids.contains(RequestId("b")));
  EXPECT_EQ(RequestId("x"), RequestId(std::string("x")));
  EXPECT_NE(RequestId("x"), RequestId("y"));
  EXPECT_TRUE(RequestId().empty());
}

}  // namespace
}  // namespace pdserve::engine
