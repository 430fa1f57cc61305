// Token masks: the trie walk allows exactly the tokens whose bytes the
// matcher accepts (checked against trying every token), the cache returns
// the same mask, and real tokenizers' tokens map to the bytes they write.
#include "grammar/token_mask.h"

#include <gtest/gtest.h>

#include <random>

#include "grammar/constraint.h"
#include "grammar/json_schema.h"

namespace pdserve::grammar {
namespace {

std::shared_ptr<const Vocabulary> SmallVocab() {
  std::vector<std::optional<std::string>> v;
  for (const char* t : {"{", "}", "\"", "\":", "\": ", ", \"", "name", "age", "na", "me", " ", "1", "23", "0", "-",
                        "\"}", "}\n", "a", "b\"", "\\", "n", "true", "tr", "ue", "null", ",", "[", "]", "{\"",
                        "\xc3", "\xa9", "\xc3\xa9"}) {
    v.push_back(std::string(t));
  }
  v.push_back(std::nullopt);  // A special token: never allowed.
  return std::make_shared<const Vocabulary>(std::move(v));
}

TEST(TokenMaskTest, TheTrieWalkAllowsExactlyTheTokensTheMatcherAccepts) {
  auto vocab = SmallVocab();
  absl::StatusOr<CompiledSchema> c = CompileJsonSchema(
      R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},"ok":{"type":"boolean"}},
      "required":["name","age"]})",
      {});
  ASSERT_TRUE(c.ok());
  TokenMasker masker(c->grammar, vocab, 100);
  std::mt19937 rng(3);
  for (int run = 0; run < 50; ++run) {
    Matcher m(c->grammar);
    for (int step = 0; step < 30 && !m.state().complete(); ++step) {
      std::shared_ptr<const TokenMask> mask = masker.MaskFor(m.state());
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < vocab->size(); ++id) {
        Matcher probe = m;
        const bool ok = vocab->bytes(id) != nullptr && probe.Advance(*vocab->bytes(id));
        ASSERT_EQ(Allowed(*mask, id), ok) << "token " << id << " at step " << step;
        if (ok) allowed.push_back(id);
      }
      if (allowed.empty()) break;
      ASSERT_TRUE(m.Advance(*vocab->bytes(allowed[rng() % allowed.size()])));
    }
  }
  EXPECT_GT(masker.stats().hits, 0);
  EXPECT_GT(masker.stats().misses, 0);
}

TEST(TokenMaskTest, TheCacheIsBoundedAndStartsAgainWhenFull) {
  auto vocab = SmallVocab();
  absl::StatusOr<std::shared_ptr<const Grammar>> g = CompileAnyJsonObject({});
  ASSERT_TRUE(g.ok());
  TokenMasker masker(*g, vocab, 2);
  Matcher m(*g);
  for (const char* s : {"{", "\"", "a", "\":", "1"}) {
    masker.MaskFor(m.state());
    ASSERT_TRUE(m.Advance(s));
    EXPECT_LE(masker.stats().states, 2);
  }
}

TEST(TokenMaskTest, EveryMaskerTogetherStaysWithinTheByteBudget) {
  auto vocab = SmallVocab();  // 33 tokens: 8 bytes a mask.
  absl::StatusOr<std::shared_ptr<const Grammar>> g = CompileAnyJsonObject({});
  ASSERT_TRUE(g.ok());
  auto counters = std::make_shared<MaskCounters>();
  counters->budget_bytes = 24;  // Three masks.
  auto a = std::make_unique<TokenMasker>(*g, vocab, 100, counters);
  TokenMasker b(*g, vocab, 100, counters);
  Matcher m(*g);
  for (const char* s : {"{", "\"", "a"}) {
    a->MaskFor(m.state());
    ASSERT_TRUE(m.Advance(s));
  }
  EXPECT_EQ(counters->bytes.load(), 24);
  ASSERT_TRUE(m.Advance("\":"));  // A state neither has seen.
  b.MaskFor(m.state());  // Over the budget, which `a` holds: computed, then dropped.
  EXPECT_EQ(b.stats().states, 0);
  EXPECT_EQ(counters->bytes.load(), 24);
  a->MaskFor(m.state());  // `a` starts its cache again, with this one.
  EXPECT_EQ(a->stats().states, 1);
  EXPECT_EQ(counters->bytes.load(), 8);
  a.reset();  // A masker dropped gives its bytes back.
  EXPECT_EQ(counters->bytes.load(), 0);
}

TEST(TokenMaskTest, RealTokenizersTokensWriteTheirBytes) {
  const std::string dir = std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/tokenizers/";
  for (const char* name : {"llama2", "llama3", "qwen3"}) {
    absl::StatusOr<std::unique_ptr<tok::Tokenizer>> t = tok::Tokenizer::Load(dir + name);
    ASSERT_TRUE(t.ok()) << t.status();
    auto vocab = Vocabulary::FromTokenizer(**t);
    ASSERT_EQ(vocab->size(), (*t)->vocab_size());
    // Encoding " {\"name\": \"é\"}" after some text: the tokens' bytes,
    // joined, are the text.
    const std::string text = "Answer: {\"name\": \"caf\xc3\xa9\", \"n\": 12}";
    absl::StatusOr<std::vector<int32_t>> ids = (*t)->Encode(text);
    ASSERT_TRUE(ids.ok());
    std::string joined;
    for (size_t i = 0; i < ids->size(); ++i) {
      const std::string* b = vocab->bytes((*ids)[i]);
      ASSERT_NE(b, nullptr) << name << " token " << (*ids)[i];
      joined += *b;
    }
    // SentencePiece models add a leading space to the first word.
    EXPECT_TRUE(joined == text || joined == " " + text) << name << ": '" << joined << "'";
    if ((*t)->eos_id().has_value()) {
      EXPECT_EQ(vocab->bytes(*(*t)->eos_id()), nullptr) << name;
    }
  }
}

TEST(TokenMaskTest, TheGrammarCacheCompilesOnceAndChecksSpecs) {
  GrammarCache cache({}, SmallVocab());
  auto a = cache.FromSchema(R"({"type": "object", "properties": {"x": {"type": "integer"}}})");
  auto b = cache.FromSchema(R"({"type":"object","properties":{"x":{"type":"integer"}}})");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_EQ(cache.stats().compiled, 1);
  EXPECT_EQ(cache.stats().hits, 1);
  ConstraintSpec spec = (*a)->spec;
  auto c = cache.FromSpec(spec);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->get(), a->get());
  spec.hash ^= 1;
  EXPECT_EQ(cache.FromSpec(spec).status().code(), absl::StatusCode::kInvalidArgument);
  GrammarCache other({}, SmallVocab());
  auto d = other.FromSpec((*a)->spec);  // Another process compiles the same grammar.
  ASSERT_TRUE(d.ok());
  Matcher m1((*a)->grammar), m2((*d)->grammar);
  ASSERT_TRUE(m1.Advance("{\"x\": 1"));
  ASSERT_TRUE(m2.Advance("{\"x\": 1"));
  EXPECT_EQ(m1.Digest(), m2.Digest());
}

}  // namespace
}  // namespace pdserve::grammar
