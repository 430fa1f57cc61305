// The byte grammar and its matcher: combinators, calls and returns, the
// closed state, digests, and the builder's refusals.
#include "grammar/grammar.h"

#include <gtest/gtest.h>

namespace pdserve::grammar {
namespace {

std::shared_ptr<const Grammar> Build(Builder& b, uint32_t root) {
  absl::StatusOr<std::shared_ptr<const Grammar>> g = b.Build(root, 16);
  EXPECT_TRUE(g.ok()) << g.status();
  return *g;
}

bool Accepts(const std::shared_ptr<const Grammar>& g, absl::string_view s, bool* complete = nullptr) {
  Matcher m(g);
  if (!m.Advance(s)) return false;
  if (complete != nullptr) *complete = m.state().complete();
  return m.state().can_end;
}

TEST(GrammarTest, SequencesAlternativesAndRepeats) {
  Builder b(1000);
  const uint32_t r = b.NewRule();
  // ("ab" | "c")* "!"
  b.Define(r, b.Seq({b.Star(b.Alt({b.Literal("ab"), b.Literal("c")})), b.Literal("!")}));
  auto g = Build(b, r);
  bool complete = false;
  EXPECT_TRUE(Accepts(g, "abcab!", &complete));
  EXPECT_TRUE(complete);
  EXPECT_TRUE(Accepts(g, "!"));
  EXPECT_FALSE(Accepts(g, "a!"));
  Matcher m(g);
  EXPECT_TRUE(m.Advance("abc"));
  EXPECT_FALSE(m.state().can_end);
  EXPECT_FALSE(m.Advance("x"));
  EXPECT_TRUE(m.Advance("!"));  // A refused byte left the state as it was.
  EXPECT_TRUE(m.state().complete());
}

TEST(GrammarTest, RulesCallEachOtherAndRecurse) {
  Builder b(1000);
  const uint32_t list = b.NewRule();
  // list := "[" (list ("," list)*)? "]"
  Frag more = b.Star(b.Seq({b.Literal(","), b.Call(list)}));
  b.Define(list, b.Seq({b.Literal("["), b.Opt(b.Seq({b.Call(list), more})), b.Literal("]")}));
  auto g = Build(b, list);
  EXPECT_TRUE(Accepts(g, "[]"));
  EXPECT_TRUE(Accepts(g, "[[],[[]]]"));
  EXPECT_FALSE(Accepts(g, "[[]"));
  EXPECT_FALSE(Accepts(g, "[],"));
}

TEST(GrammarTest, NestingPastTheDepthBoundIsNotGenerated) {
  Builder b(1000);
  const uint32_t list = b.NewRule();
  b.Define(list, b.Seq({b.Literal("["), b.Opt(b.Call(list)), b.Literal("]")}));
  absl::StatusOr<std::shared_ptr<const Grammar>> g = b.Build(list, 4);
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(Accepts(*g, "[[[[]]]]"));
  EXPECT_FALSE(Accepts(*g, "[[[[["));
}

TEST(GrammarTest, LeftRecursionIsRefused) {
  Builder b(1000);
  const uint32_t a = b.NewRule(), c = b.NewRule();
  b.Define(a, b.Alt({b.Call(c), b.Literal("x")}));
  b.Define(c, b.Seq({b.Opt(b.Literal("y")), b.Call(a)}));
  absl::StatusOr<std::shared_ptr<const Grammar>> g = b.Build(a, 16);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument) << g.status();
}

TEST(GrammarTest, TheNodeBudgetIsEnforced) {
  Builder b(10);
  const uint32_t r = b.NewRule();
  b.Define(r, b.Literal("more than ten bytes"));
  EXPECT_EQ(b.Build(r, 16).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(GrammarTest, EqualInputsGiveEqualDigestsAndDifferentOnesDiffer) {
  Builder b(1000);
  const uint32_t r = b.NewRule();
  b.Define(r, b.Star(b.Alt({b.Literal("ab"), b.Literal("a")})));
  auto g = Build(b, r);
  Matcher x(g), y(g), z(g);
  ASSERT_TRUE(x.Advance("aba"));
  ASSERT_TRUE(y.Advance("ab"));
  ASSERT_TRUE(y.Advance("a"));
  ASSERT_TRUE(z.Advance("ab"));
  EXPECT_EQ(x.Digest(), y.Digest());
  EXPECT_EQ(x.state(), y.state());
  EXPECT_NE(x.Digest(), z.Digest());
}

}  // namespace
}  // namespace pdserve::grammar
