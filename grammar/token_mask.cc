#include "grammar/token_mask.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve::grammar {

Vocabulary::Vocabulary(std::vector<std::optional<std::string>> bytes) : bytes_(std::move(bytes)) {
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
  // Flattened in depth-first order, children by byte: the mask's walk then
  // reads the arrays front to back instead of jumping across them.
  std::vector<uint32_t> order;  // Old index, in preorder.
  order.reserve(nodes.size());
  std::vector<uint32_t> todo{0};
  while (!todo.empty()) {
    const uint32_t n = todo.back();
    todo.pop_back();
    order.push_back(n);
    for (auto it = nodes[n].children.rbegin(); it != nodes[n].children.rend(); ++it) todo.push_back(it->second);
  }
  std::vector<uint32_t> renamed(nodes.size());
  for (size_t i = 0; i < order.size(); ++i) renamed[order[i]] = static_cast<uint32_t>(i);
  trie_.resize(nodes.size());
  for (size_t i = 0; i < order.size(); ++i) {
    const Build& b = nodes[order[i]];
    trie_[i].first_child = static_cast<uint32_t>(edges_.size());
    trie_[i].child_count = static_cast<uint32_t>(b.children.size());
    for (const auto& [byte, child] : b.children) edges_.push_back({byte, renamed[child]});
    trie_[i].first_token = static_cast<uint32_t>(trie_tokens_.size());
    trie_[i].token_count = static_cast<uint32_t>(b.tokens.size());
    trie_tokens_.insert(trie_tokens_.end(), b.tokens.begin(), b.tokens.end());
  }
}

std::shared_ptr<const Vocabulary> Vocabulary::FromTokenizer(const tok::Tokenizer& t) {
  return std::make_shared<const Vocabulary>(t.AllTokenBytes());
}

TokenMasker::TokenMasker(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const Vocabulary> vocab,
                         int64_t max_states, std::shared_ptr<MaskCounters> counters)
    : grammar_(std::move(grammar)),
      vocab_(std::move(vocab)),
      max_states_(max_states),
      counters_(std::move(counters)) {}

TokenMasker::~TokenMasker() {
  absl::MutexLock lock(&mu_);
  ClearLocked();
}

void TokenMasker::ClearLocked() {
  if (counters_ != nullptr) {
    counters_->bytes.fetch_sub(static_cast<int64_t>(cache_.size()) * mask_bytes(), std::memory_order_relaxed);
  }
  cache_.clear();
}

std::shared_ptr<const TokenMask> TokenMasker::Compute(const State& s) const {
  auto mask = std::make_shared<TokenMask>((vocab_->size() + 63) / 64, 0);
  const auto& trie = vocab_->trie();
  const auto& edges = vocab_->edges();
  const auto& tokens = vocab_->trie_tokens();
  const Grammar& g = *grammar_;
  Stepper stepper(g);
  // Depth-first over the trie. Level d is the state after the first d bytes
  // of the current path, kept light where it can be: a state of one stack
  // that differs from the full state `full[base]` only in its top node
  // (`top`). Inside strings and literals every byte is such a step (one
  // edge, to a node with byte edges only), so most of the trie is walked
  // without copying a stack.
  struct Level {
    uint32_t trie_node;
    uint32_t next_edge;
    uint32_t base;  // Index into `full`.
    uint32_t top;   // kFull: the level is full[base] itself.
  };
  constexpr uint32_t kFull = ~0u;
  std::vector<State> full(1, s);
  std::vector<Level> path{{0, 0, 0, kFull}};
  State scratch;
  while (!path.empty()) {
    Level& at = path.back();
    const Vocabulary::TrieNode& n = trie[at.trie_node];
    if (at.next_edge == n.child_count) {
      if (at.top == kFull) full.pop_back();
      path.pop_back();
      continue;
    }
    const Vocabulary::TrieEdge& e = edges[n.first_child + at.next_edge++];
    const State& base = full[at.base];
    if (base.words.empty()) continue;  // Complete: nothing more can be read.
    const bool single = base.words[0] + 1 == base.words.size();
    Level child{e.node, 0, at.base, kFull};
    bool light = false;
    if (single) {
      const uint32_t top = at.top == kFull ? base.words.back() : at.top;
      const ByteEdge* hit = nullptr;
      int hits = 0;
      for (const ByteEdge& be : g.nodes[top].bytes) {
        if (e.byte >= be.lo && e.byte <= be.hi) {
          hit = &be;
          ++hits;
        }
      }
      if (hits == 0) continue;
      const Node& to = g.nodes[hit->to];
      if (hits == 1 && to.empty.empty() && to.calls.empty() && !to.end && !to.bytes.empty()) {
        child.top = hit->to;
        light = true;
      }
    }
    if (!light) {
      const State* from = &base;
      if (at.top != kFull) {
        scratch = base;
        scratch.words.back() = at.top;
        from = &scratch;
      }
      State next;
      stepper.Step(*from, e.byte, &next);
      if (next.dead()) continue;
      full.push_back(std::move(next));
      child.base = static_cast<uint32_t>(full.size() - 1);
    }
    const Vocabulary::TrieNode& c = trie[e.node];
    for (uint32_t i = 0; i < c.token_count; ++i) {
      const int32_t id = tokens[c.first_token + i];
      (*mask)[id >> 6] |= uint64_t{1} << (id & 63);
    }
    if (c.child_count > 0) {
      path.push_back(child);
    } else if (!light) {
      full.pop_back();
    }
  }
  return mask;
}

std::shared_ptr<const TokenMask> TokenMasker::MaskFor(const State& s) {
  {
    absl::MutexLock lock(&mu_);
    if (auto it = cache_.find(s.words); it != cache_.end()) {
      ++stats_.hits;
      if (counters_ != nullptr) counters_->hits.fetch_add(1, std::memory_order_relaxed);
      return it->second;
    }
  }
  // Computed outside the lock: two threads missing on one state both
  // compute it, and the masks are equal.
  const absl::Time start = absl::Now();
  std::shared_ptr<const TokenMask> m = Compute(s);
  const absl::Duration took = absl::Now() - start;
  const double seconds = absl::ToDoubleSeconds(took);
  if (counters_ != nullptr) {
    counters_->misses.fetch_add(1, std::memory_order_relaxed);
    counters_->miss_nanoseconds.fetch_add(absl::ToInt64Nanoseconds(took), std::memory_order_relaxed);
  }
  absl::MutexLock lock(&mu_);
  ++stats_.misses;
  stats_.miss_seconds += seconds;
  if (static_cast<int64_t>(cache_.size()) >= max_states_) ClearLocked();
  if (counters_ != nullptr && counters_->budget_bytes > 0) {
    const int64_t add = mask_bytes();
    if (counters_->bytes.load(std::memory_order_relaxed) + add > counters_->budget_bytes) ClearLocked();
    if (counters_->bytes.load(std::memory_order_relaxed) + add > counters_->budget_bytes) {
      return m;  // The other formats hold the budget: computed, and dropped after use.
    }
  }
  if (cache_.emplace(s.words, m).second && counters_ != nullptr) {
    counters_->bytes.fetch_add(mask_bytes(), std::memory_order_relaxed);
  }
  return m;
}

MaskerStats TokenMasker::stats() const {
  absl::MutexLock lock(&mu_);
  MaskerStats s = stats_;
  s.states = static_cast<int64_t>(cache_.size());
  return s;
}

}  // namespace pdserve::grammar
