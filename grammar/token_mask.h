// Which tokens of a vocabulary a grammar allows next: a bit per token,
// computed from a matcher's state by walking the vocabulary's byte trie
// (a subtree is skipped as soon as its prefix is refused), and cached per
// state, since generation revisits few states many times (inside a string,
// after a comma).
//
// Costs: a cache miss is one trie walk, at most one Stepper::Step per trie
// node (a few hundred thousand at a 128k vocabulary, far fewer in states
// that allow little); a hit is a hash of the state. Masks are vocab/8 bytes
// each, and a masker holds at most `max_states` of them (past that it
// starts again empty), and at most what MaskCounters::budget_bytes leaves.
//
// Thread safety: Vocabulary is immutable; TokenMasker is thread-safe.
#ifndef PDSERVE_GRAMMAR_TOKEN_MASK_H_
#define PDSERVE_GRAMMAR_TOKEN_MASK_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "grammar/grammar.h"
#include "text/tokenizer.h"

namespace pdserve::grammar {

// The bytes each token writes, and their trie.
class Vocabulary {
 public:
  // Tokens with no bytes (special tokens, unknown ids) are never allowed
  // by a grammar; `bytes[id]` unset.
  explicit Vocabulary(std::vector<std::optional<std::string>> bytes);
  // From a tokenizer: tok::Tokenizer::AllTokenBytes.
  static std::shared_ptr<const Vocabulary> FromTokenizer(const tok::Tokenizer& t);

  int32_t size() const { return static_cast<int32_t>(bytes_.size()); }
  // nullptr for a token that writes nothing a grammar can match.
  const std::string* bytes(int32_t id) const {
    return id >= 0 && id < size() && bytes_[id].has_value() ? &*bytes_[id] : nullptr;
  }

  struct TrieNode {
    uint32_t first_child = 0;  // Into children(); `child_count` of them, by byte.
    uint32_t child_count = 0;
    uint32_t first_token = 0;  // Into tokens(); ids whose bytes end here.
    uint32_t token_count = 0;
  };
  struct TrieEdge {
    uint8_t byte = 0;
    uint32_t node = 0;
  };
  const std::vector<TrieNode>& trie() const { return trie_; }
  const std::vector<TrieEdge>& edges() const { return edges_; }
  const std::vector<int32_t>& trie_tokens() const { return trie_tokens_; }

 private:
  std::vector<std::optional<std::string>> bytes_;
  std::vector<TrieNode> trie_;  // [0] is the root.
  std::vector<TrieEdge> edges_;
  std::vector<int32_t> trie_tokens_;
};

// One bit per token id: bit (id % 64) of word id / 64.
using TokenMask = std::vector<uint64_t>;

inline bool Allowed(const TokenMask& m, int32_t id) { return (m[id >> 6] >> (id & 63)) & 1; }

// Counts shared by every masker of one process (GrammarCache's), so they
// outlive the grammars that are dropped from its cache.
struct MaskCounters {
  std::atomic<int64_t> hits{0};
  std::atomic<int64_t> misses{0};
  std::atomic<int64_t> miss_nanoseconds{0};
  std::atomic<int64_t> bytes{0};  // Held by every masker's cache now.
  // The most all caches together hold (0: no bound). A masker that would
  // pass it starts its own cache again, and when the others hold the
  // budget it keeps no mask at all until they free some.
  int64_t budget_bytes = 0;
};

struct MaskerStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t states = 0;       // Cached now.
  double miss_seconds = 0;  // Spent computing masks.
};

class TokenMasker {
 public:
  // `counters` (may be null) also counts this masker's hits and misses.
  TokenMasker(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const Vocabulary> vocab, int64_t max_states,
              std::shared_ptr<MaskCounters> counters = nullptr);
  ~TokenMasker();
  TokenMasker(const TokenMasker&) = delete;
  TokenMasker& operator=(const TokenMasker&) = delete;

  // The tokens whose bytes the grammar accepts from `s` (the end tokens,
  // EOS and the like, are the caller's: allowed when s.can_end).
  std::shared_ptr<const TokenMask> MaskFor(const State& s);

  const Vocabulary& vocab() const { return *vocab_; }
  MaskerStats stats() const;

 private:
  std::shared_ptr<const TokenMask> Compute(const State& s) const;
  void ClearLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t mask_bytes() const { return static_cast<int64_t>((vocab_->size() + 63) / 64) * 8; }

  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const Vocabulary> vocab_;
  const int64_t max_states_;
  const std::shared_ptr<MaskCounters> counters_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::vector<uint32_t>, std::shared_ptr<const TokenMask>> cache_ ABSL_GUARDED_BY(mu_);
  MaskerStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::grammar

#endif  // PDSERVE_GRAMMAR_TOKEN_MASK_H_
