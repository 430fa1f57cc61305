// Generation under a response format: every sampled token follows the
// format whatever the logits, end tokens only where the document may end,
// generation stops at a complete document, a seeded stream is the same on
// a replay, and a replayed token the format refuses is an error.
#include "engine/generation.h"

#include <gtest/gtest.h>

#include <memory>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "grammar/constraint.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

// Multi-byte tokens, then every printable ASCII byte alone (real
// vocabularies hold all 256 bytes, so a document always has a way on: the
// mask allows a token whose bytes are a valid prefix), then EOS.
const std::vector<std::string>& Pieces() {
  static const auto* p = [] {
    auto* v = new std::vector<std::string>{"{\"", "\":", "\": ", ", \"", "name", "age", "true", "false", "null",
                                           "\"}", "23", "\"ok", "\"name\":"};
    for (char c = 0x20; c < 0x7F; ++c) v->push_back(std::string(1, c));
    v->push_back("\n");
    return v;
  }();
  return *p;
}
int32_t Id(const std::string& piece) {
  return static_cast<int32_t>(std::find(Pieces().begin(), Pieces().end(), piece) - Pieces().begin());
}
const int32_t kEos = static_cast<int32_t>(Pieces().size());
const int32_t kVocab = kEos + 1;

std::shared_ptr<const grammar::Vocabulary> Vocab() {
  std::vector<std::optional<std::string>> v(Pieces().begin(), Pieces().end());
  v.push_back(std::nullopt);  // EOS.
  return std::make_shared<const grammar::Vocabulary>(std::move(v));
}

struct Rig {
  grammar::GrammarCache cache{{}, Vocab()};
  std::string Text(const Generation& g) {
    std::string out;
    for (int32_t t : g.generated()) {
      if (const std::string* b = g.request().constraint->masker->vocab().bytes(t)) out += *b;
    }
    return out;
  }
  GenerationRequest Request(const std::string& schema, uint64_t seed, float temperature = 1.0f) {
    GenerationRequest r;
    r.prompt = {0};
    r.params.temperature = temperature;
    r.params.seed = seed;
    r.params.max_tokens = 200;
    r.eos_ids = {kEos};
    r.constraint = *cache.FromSchema(schema);
    return r;
  }
};

constexpr char kPerson[] = R"({"type":"object","properties":{"name":{"type":"string","maxLength":6},
  "age":{"type":"integer"},"ok":{"type":"boolean"}},"required":["name","age"],"additionalProperties":false})";

TEST(GenerationTest, EveryTokenFollowsTheFormatWhateverTheLogitsAndTheOutputEndsComplete) {
  Rig rig;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 4);
  int complete = 0;
  for (uint64_t seed = 1; seed <= 50; ++seed) {
    Generation g(rig.Request(kPerson, seed), nullptr);
    std::vector<float> logits(kVocab);
    while (!g.finished()) {
      for (float& l : logits) l = normal(rng);
      logits[kEos] = 10;  // The model wants to stop at once: allowed only where the document may end.
      absl::StatusOr<TokenEvent> e = g.Accept(logits);
      ASSERT_TRUE(e.ok()) << e.status() << " after '" << rig.Text(g) << "'";
    }
    if (g.finish() != FinishReason::kStop) continue;
    ++complete;
    const std::string text = rig.Text(g);
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_TRUE(j.is_object()) << text;
    EXPECT_TRUE(j["name"].is_string() && j["name"].get<std::string>().size() <= 6) << text;
    EXPECT_TRUE(j["age"].is_number_integer()) << text;
    // A closed object ends the output: no EOS was needed (none sampled).
    EXPECT_NE(g.generated().back(), kEos) << text;
  }
  EXPECT_GE(complete, 45);
}

TEST(GenerationTest, AReplayOfTheSameTokensReachesTheSameStateAndASeededStreamRepeats) {
  Rig rig;
  auto run = [&](uint64_t seed) {
    Generation g(rig.Request(kPerson, seed, 0.9f), nullptr);
    std::vector<float> logits(kVocab);
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0, 3);
    while (!g.finished()) {
      for (float& l : logits) l = normal(rng);
      if (!g.Accept(logits).ok()) {
        ADD_FAILURE() << "Accept failed";
        break;
      }
    }
    return std::make_pair(g.generated(), g.grammar_digest());
  };
  const auto [tokens, digest] = run(3);
  EXPECT_EQ(run(3).first, tokens);
  Generation replayed(rig.Request(kPerson, 3, 0.9f), nullptr);
  for (size_t i = 0; i + 1 < tokens.size(); ++i) {
    TokenEvent e;
    e.token = tokens[i];
    ASSERT_TRUE(replayed.Replay(e).ok());
  }
  Generation half(rig.Request(kPerson, 3, 0.9f), nullptr);
  TokenEvent first;
  first.token = tokens[0];
  ASSERT_TRUE(half.Replay(first).ok());
  EXPECT_NE(half.grammar_digest(), replayed.grammar_digest());
  TokenEvent last;
  last.token = tokens.back();
  ASSERT_TRUE(replayed.Replay(last).ok());
  EXPECT_EQ(replayed.grammar_digest(), digest);
  EXPECT_TRUE(replayed.finished());
}

TEST(GenerationTest, AReplayedTokenTheFormatRefusesIsAnError) {
  Rig rig;
  Generation g(rig.Request(kPerson, 1), nullptr);
  TokenEvent e;
  e.token = Id("x");  // A document starts with '{'.
  absl::StatusOr<TokenEvent> r = g.Replay(e);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  e.token = kEos;  // Nor may it end before it began.
  EXPECT_FALSE(g.Replay(e).ok());
  e.token = Id("{\"");
  EXPECT_TRUE(g.Replay(e).ok());
}

TEST(GenerationTest, EosEndsAnOutputOnlyWhereTheDocumentMayEnd) {
  Rig rig;
  // A bare integer may end after any digit, or go on: EOS decides.
  Generation g(rig.Request(R"({"type":"integer"})", 1, 0.0f), nullptr);
  std::vector<float> logits(kVocab, 0);
  logits[kEos] = 5;
  logits[Id("23")] = 4;
  absl::StatusOr<TokenEvent> e = g.Accept(logits);  // EOS may not come first.
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->token, Id("23"));
  e = g.Accept(logits);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->token, kEos);
  EXPECT_EQ(g.finish(), FinishReason::kStop);
}

}  // namespace
}  // namespace pdserve
