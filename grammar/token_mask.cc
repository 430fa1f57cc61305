#include "grammar/token_mask.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve::grammar {

Vocabulary::Vocabulary(std::vector<std::optional<std::string>> bytes) : bytes_(std::move(bytes)) {
  // Build with ordered children, then flatten breadth-agnostic into arrays.
  struct Build {
    std::map<uint8_t, uint32_t> children;
    std::vector<int32_t> tokens;
  };
  std::vector<Build> nodes(1);
  for (int32_t id = 0; id < size(); ++id) {
    if (!bytes_[id].has_value() || bytes_[id]->empty()) {
      bytes_[id].reset();
      continue;
    }
    uint32_t n = 0;
    for (char c : *bytes_[id]) {
      const uint8_t b = static_cast<uint8_t>(c);
      auto it = nodes[n].children.find(b);
      if (it == nodes[n].children.end()) {
        nodes.emplace_back();
        it = nodes[n].children.emplace(b, static_cast<uint32_t>(nodes.size() - 1)).first;
      }
      n = it->second;
    }
    nodes[n].tokens.push_back(id);
  }
  trie_.resize(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    trie_[i].first_child = static_cast<uint32_t>(edges_.size());
    trie_[i].child_count = static_cast<uint32_t>(nodes[i].children.size());
    for (const auto& [b, child] : nodes[i].children) edges_.push_back({b, child});
    trie_[i].first_token = static_cast<uint32_t>(trie_tokens_.size());
    trie_[i].token_count = static_cast<uint32_t>(nodes[i].tokens.size());
    trie_tokens_.insert(trie_tokens_.end(), nodes[i].tokens.begin(), nodes[i].tokens.end());
  }
}

std::shared_ptr<const Vocabulary> Vocabulary::FromTokenizer(const tok::Tokenizer& t) {
  return std::make_shared<const Vocabulary>(t.AllTokenBytes());
}

TokenMasker::TokenMasker(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const Vocabulary> vocab,
                         int64_t max_states)
    : grammar_(std::move(grammar)), vocab_(std::move(vocab)), max_states_(max_states) {}

std::shared_ptr<const TokenMask> TokenMasker::Compute(const State& s) const {
  auto mask = std::make_shared<TokenMask>((vocab_->size() + 63) / 64, 0);
  const auto& trie = vocab_->trie();
  const auto& edges = vocab_->edges();
  const auto& tokens = vocab_->trie_tokens();
  Stepper stepper(*grammar_);
  // Depth-first over the trie: states[d] is the state after the first d
  // bytes of the current path; next[d] is the index of the edge of the
  // node at depth d to try next.
  std::vector<State> states(1, s);
  std::vector<uint32_t> node_at(1, 0), next(1, 0);
  while (!node_at.empty()) {
    const size_t d = node_at.size() - 1;
    const Vocabulary::TrieNode& n = trie[node_at[d]];
    if (next[d] == n.child_count) {
      node_at.pop_back();
      next.pop_back();
      continue;
    }
    const Vocabulary::TrieEdge& e = edges[n.first_child + next[d]++];
    if (states.size() < d + 2) states.emplace_back();
    if (states[d].words.empty()) continue;  // Nothing more can be read.
    stepper.Step(states[d], e.byte, &states[d + 1]);
    if (states[d + 1].dead()) continue;
    const Vocabulary::TrieNode& child = trie[e.node];
    for (uint32_t i = 0; i < child.token_count; ++i) {
      const int32_t id = tokens[child.first_token + i];
      (*mask)[id >> 6] |= uint64_t{1} << (id & 63);
    }
    if (child.child_count > 0) {
      node_at.push_back(e.node);
      next.push_back(0);
    }
  }
  return mask;
}

std::shared_ptr<const TokenMask> TokenMasker::MaskFor(const State& s) {
  {
    absl::MutexLock lock(&mu_);
    if (auto it = cache_.find(s.words); it != cache_.end()) {
      ++stats_.hits;
      return it->second;
    }
  }
  // Computed outside the lock: two threads missing on one state both
  // compute it, and the masks are equal.
  const absl::Time start = absl::Now();
  std::shared_ptr<const TokenMask> m = Compute(s);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock lock(&mu_);
  ++stats_.misses;
  stats_.miss_seconds += seconds;
  if (static_cast<int64_t>(cache_.size()) >= max_states_) cache_.clear();
  cache_.emplace(s.words, m);
  stats_.states = static_cast<int64_t>(cache_.size());
  return m;
}

MaskerStats TokenMasker::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace pdserve::grammar
