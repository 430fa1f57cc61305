// The streaming detokenizer's contract (text/detokenizer.h):
// valid UTF-8 deltas, never retracted, equal to a reference computed from
// the ids, and nothing held back past an incomplete character. The
// tokenizer is the llama2 fixture (SentencePiece BPE with byte fallback,
// 32000 tokens); the byte-level llama3 fixture covers the other decoder.
#include "text/detokenizer.h"

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "text/tokenizer.h"
#include "text/unicode_util.h"
#include "gtest/gtest.h"

namespace pdserve::tok {
namespace {

const std::string kDir = std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/tokenizers/";
const std::string kFffd = "\xef\xbf\xbd";

const Tokenizer& Llama2() {
  static const Tokenizer* tok = Tokenizer::Load(kDir + "llama2")->release();
  return *tok;
}

int32_t ByteId(const Tokenizer& tok, uint8_t b) {
  return *tok.TokenToId(absl::StrFormat("<0x%02X>", b));
}

// The reference, computed apart from the detokenizer: each run of byte
// tokens (after skipped specials are dropped) keeps its longest valid UTF-8
// prefix and turns every later byte into U+FFFD; the rewritten ids are then
// decoded by the tokenizer's own full decode. A run never crosses from the
// context into the generated ids.
std::vector<int32_t> Rewrite(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special) {
  std::vector<int32_t> out;
  std::string run;
  auto flush = [&] {
    size_t valid = run.size();
    while (valid > 0 && !IsValidUtf8(absl::string_view(run).substr(0, valid))) --valid;
    std::string bytes = run.substr(0, valid);
    for (size_t i = valid; i < run.size(); ++i) bytes += kFffd;
    for (char c : bytes) out.push_back(ByteId(tok, static_cast<uint8_t>(c)));
    run.clear();
  };
  for (int32_t id : ids) {
    if (skip_special && tok.IsSpecial(id)) continue;
    if (std::optional<uint8_t> b = tok.FallbackByte(id); b.has_value()) {
      run.push_back(static_cast<char>(*b));
    } else {
      flush();
      out.push_back(id);
    }
  }
  flush();
  return out;
}

std::string Reference(const Tokenizer& tok, const std::vector<int32_t>& context, const std::vector<int32_t>& ids,
                      bool skip_special) {
  std::vector<int32_t> all = Rewrite(tok, context, skip_special);
  const std::vector<int32_t> gen = Rewrite(tok, ids, skip_special);
  all.insert(all.end(), gen.begin(), gen.end());
  const std::string full = *tok.Decode(all, skip_special);
  const std::string prompt = *tok.Decode(Rewrite(tok, context, skip_special), skip_special);
  EXPECT_EQ(full.compare(0, prompt.size(), prompt), 0);
  return full.substr(prompt.size());
}

struct Streamed {
  std::vector<std::string> chunks;  // One per Add.
  std::string rest;                 // Finish.
  std::string All() const {
    std::string s;
    for (const std::string& c : chunks) s += c;
    return s + rest;
  }
};

Streamed Stream(const Tokenizer& tok, const std::vector<int32_t>& context, const std::vector<int32_t>& ids,
                bool skip_special = false) {
  IncrementalDetokenizer d(tok, context, skip_special);
  Streamed s;
  for (int32_t id : ids) s.chunks.push_back(*d.Add(id));
  s.rest = *d.Finish();
  return s;
}

std::vector<int32_t> Bytes(const Tokenizer& tok, const std::string& bytes) {
  std::vector<int32_t> ids;
  for (char c : bytes) ids.push_back(ByteId(tok, static_cast<uint8_t>(c)));
  return ids;
}

std::vector<int32_t> Cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(DetokenizerTest, CharacterSplitAcrossByteTokensAppearsWhenComplete) {
  const Tokenizer& tok = Llama2();
  const std::vector<int32_t> ids = Bytes(tok, "\xc3\xa9\xe2\x82\xac");  // "é€"
  IncrementalDetokenizer d(tok, {}, false);
  EXPECT_EQ(*d.Add(ids[0]), "");
  EXPECT_EQ(*d.Add(ids[1]), "\xc3\xa9");
  EXPECT_EQ(*d.Add(ids[2]), "");
  EXPECT_EQ(*d.Add(ids[3]), "");
  EXPECT_EQ(*d.Add(ids[4]), "\xe2\x82\xac");
  EXPECT_EQ(*d.Finish(), "");
}

TEST(DetokenizerTest, CharacterCutAtTheEndIsOneReplacementPerByte) {
  const Tokenizer& tok = Llama2();
  // "é" then the first two bytes of "€": the stream ends inside a character.
  const std::vector<int32_t> ids = Bytes(tok, "\xc3\xa9\xe2\x82");
  const Streamed s = Stream(tok, {}, ids);
  EXPECT_EQ(s.chunks[1], "\xc3\xa9");
  EXPECT_EQ(s.rest, kFffd + kFffd);
  EXPECT_EQ(s.All(), Reference(tok, {}, ids, false));
  // A full decode turns the whole run into U+FFFD: the stream keeps the "é"
  // it already showed.
  EXPECT_EQ(*tok.Decode(ids), kFffd + kFffd + kFffd + kFffd);
}

TEST(DetokenizerTest, LoneContinuationByteIsReplacedAtOnce) {
  const Tokenizer& tok = Llama2();
  const std::vector<int32_t> ids = Cat(Bytes(tok, "A\x80"), {*tok.TokenToId("▁the")});
  const Streamed s = Stream(tok, {}, ids);
  EXPECT_EQ(s.chunks[0], "A");
  EXPECT_EQ(s.chunks[1], kFffd);  // Known invalid: not held back.
  EXPECT_EQ(s.chunks[2], " the");
  EXPECT_EQ(s.rest, "");
}

TEST(DetokenizerTest, TruncatedFourByteSequenceThenValidText) {
  const Tokenizer& tok = Llama2();
  // Three bytes of U+1F600, then an ASCII byte token and a word: the run is
  // invalid from the "A" on; the word after the run comes out at once.
  const std::vector<int32_t> ids = Cat(Bytes(tok, "\xf0\x9f\x98" "A"), {*tok.TokenToId("▁the")});
  const Streamed s = Stream(tok, {}, ids);
  EXPECT_EQ(s.chunks[0] + s.chunks[1] + s.chunks[2], "");
  EXPECT_EQ(s.chunks[3], kFffd + kFffd + kFffd + kFffd);
  EXPECT_EQ(s.chunks[4], " the");
  EXPECT_EQ(s.All(), *tok.Decode(ids));  // Nothing was shown before the run broke.
}

TEST(DetokenizerTest, InvalidRunFollowedByValidTextResynchronises) {
  const Tokenizer& tok = Llama2();
  // "é", then a lead byte with no continuation, then ordinary words: the
  // words are not held back to the end (the old detokenizer's failure).
  std::vector<int32_t> ids = Bytes(tok, "\xc3\xa9\xc3");
  for (const char* w : {"▁In", "▁the", "▁beginning"}) ids.push_back(*tok.TokenToId(w));
  const Streamed s = Stream(tok, {}, ids);
  EXPECT_EQ(s.chunks[1], "\xc3\xa9");
  EXPECT_EQ(s.chunks[2], "");
  EXPECT_EQ(s.chunks[3], kFffd + " In");
  EXPECT_EQ(s.chunks[4], " the");
  EXPECT_EQ(s.chunks[5], " beginning");
  EXPECT_EQ(s.rest, "");
  EXPECT_EQ(s.All(), "\xc3\xa9" + kFffd + " In the beginning");
  // Further bytes of an invalid run are one U+FFFD each, at once; the next
  // run starts afresh and is valid again.
  const std::vector<int32_t> more = Cat(Bytes(tok, "\xc3" "A" "\xa9"), Cat({*tok.TokenToId("▁the")},
                                                                           Bytes(tok, "\xc3\xa9")));
  const Streamed m = Stream(tok, {}, more);
  EXPECT_EQ(m.chunks[1], kFffd + kFffd);
  EXPECT_EQ(m.chunks[2], kFffd);
  EXPECT_EQ(m.chunks[3], " the");
  EXPECT_EQ(m.chunks[5], "\xc3\xa9");
}

TEST(DetokenizerTest, ReplacementCharacterInTheVocabularyIsOrdinaryText) {
  const Tokenizer& tok = Llama2();
  const int32_t fffd = *tok.TokenToId(kFffd);
  const std::vector<int32_t> ids = {*tok.TokenToId("▁the"), fffd, fffd, *tok.TokenToId("▁end")};
  const Streamed s = Stream(tok, {}, ids);
  EXPECT_EQ(s.chunks[1], kFffd);  // Not mistaken for an incomplete character.
  EXPECT_EQ(s.chunks[2], kFffd);
  EXPECT_EQ(s.All(), *tok.Decode(ids));

  // A byte-level tokenizer cannot tell it from an incomplete character at
  // once: it comes out with the next token or at the end.
  auto llama3 = Tokenizer::Load(kDir + "llama3");
  ASSERT_TRUE(llama3.ok());
  const std::vector<int32_t> b = *(*llama3)->Encode("x\xef\xbf\xbd y \xef\xbf\xbd");
  const Streamed bs = Stream(**llama3, {}, b);
  EXPECT_EQ(bs.All(), "x\xef\xbf\xbd y \xef\xbf\xbd");
}

TEST(DetokenizerTest, RunDoesNotContinueAcrossThePromptsEnd) {
  const Tokenizer& tok = Llama2();
  const std::vector<int32_t> context = Cat({*tok.TokenToId("▁the")}, Bytes(tok, "\xc3"));
  // "\xa9" would complete the prompt's "\xc3" as "é"; on its own it is a
  // lone continuation byte, which makes the generated run invalid.
  const std::vector<int32_t> ids = Bytes(tok, "\xa9" "A");
  const Streamed s = Stream(tok, context, ids);
  EXPECT_EQ(s.All(), kFffd + kFffd);
  EXPECT_EQ(s.All(), *tok.Decode(ids));
}

TEST(DetokenizerTest, UnknownIdIsAnError) {
  const Tokenizer& tok = Llama2();
  IncrementalDetokenizer d(tok, {}, false);
  EXPECT_FALSE(d.Add(tok.vocab_size()).ok());
  IncrementalDetokenizer bad_context(tok, {-1}, false);
  EXPECT_FALSE(bad_context.Add(5).ok());
}

// 10,000 seeded id sequences, at least half byte-fallback tokens (valid
// characters, random bytes, lone lead and continuation bytes), some with a
// prompt, some skipping special tokens. At every end point: every chunk is
// valid UTF-8; the chunks so far plus Finish equal the reference for the
// ids so far; Finish only adds U+FFFD for a trailing partial character
// (nothing else is held back); and the chunks so far are a prefix of the
// final text (nothing is retracted).
TEST(DetokenizerPropertyTest, ByteFallbackStreamsAreValidMonotonicAndExact) {
  const Tokenizer& tok = Llama2();
  std::mt19937 rng(20261201);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const std::vector<std::string> chars = {"a", " ", "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\xe2\x96\x81",
                                          "\xef\xbf\xbd", "\xed\x9f\xbf", "\xf4\x8f\xbf\xbf", "\n"};
  const int32_t fffd_token = *tok.TokenToId(kFffd);
  auto random_tokens = [&](size_t n, std::vector<int32_t>& ids, size_t& byte_tokens) {
    while (ids.size() < n) {
      const int kind = uniform(0, 9);
      if (kind < 3) {  // A whole valid character, byte by byte.
        for (char c : chars[static_cast<size_t>(uniform(0, static_cast<int>(chars.size()) - 1))]) {
          ids.push_back(ByteId(tok, static_cast<uint8_t>(c)));
          ++byte_tokens;
        }
      } else if (kind < 6) {  // Any byte: lone leads, continuations, invalid.
        ids.push_back(ByteId(tok, static_cast<uint8_t>(uniform(0, 255))));
        ++byte_tokens;
      } else if (kind < 7) {  // Special tokens (<unk>, <s>, </s>) and U+FFFD.
        ids.push_back(uniform(0, 3) == 3 ? fffd_token : uniform(0, 2));
      } else {  // Ordinary pieces (the byte tokens are ids 3..258).
        ids.push_back(uniform(259, tok.vocab_size() - 1));
      }
    }
  };
  int cases = 0, end_points = 0;
  size_t byte_tokens = 0, total_tokens = 0;
  for (int c = 0; c < 10000; ++c) {
    std::vector<int32_t> context, ids;
    size_t ignored = 0;
    if (uniform(0, 3) == 0) random_tokens(static_cast<size_t>(uniform(1, 6)), context, ignored);
    random_tokens(static_cast<size_t>(uniform(1, 24)), ids, byte_tokens);
    total_tokens += ids.size();
    const bool skip = uniform(0, 1) == 1;
    const std::string final_text = Reference(tok, context, ids, skip);
    IncrementalDetokenizer d(tok, context, skip);
    std::string streamed;
    for (size_t p = 0; p < ids.size(); ++p) {
      const std::string chunk = *d.Add(ids[p]);
      ASSERT_TRUE(IsValidUtf8(chunk)) << "case " << c << " token " << p;
      streamed += chunk;
      IncrementalDetokenizer at_end = d;
      const std::string rest = *at_end.Finish();
      ASSERT_TRUE(IsValidUtf8(rest));
      const std::vector<int32_t> upto(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(p) + 1);
      ASSERT_EQ(streamed + rest, Reference(tok, context, upto, skip)) << "case " << c << " end " << p;
      for (size_t i = 0; i < rest.size(); i += kFffd.size()) {
        ASSERT_EQ(rest.compare(i, kFffd.size(), kFffd), 0) << "held back: case " << c << " end " << p;
      }
      ASSERT_EQ(final_text.compare(0, streamed.size(), streamed), 0) << "retracted: case " << c << " end " << p;
      ++end_points;
    }
    ++cases;
  }
  EXPECT_EQ(cases, 10000);
  EXPECT_GE(2 * byte_tokens, total_tokens);
  EXPECT_GT(end_points, 10000);
}

}  // namespace
}  // namespace pdserve::tok
