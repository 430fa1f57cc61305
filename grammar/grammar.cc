#include "grammar/grammar.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace pdserve::grammar {

// ---- Builder ----

uint32_t Builder::NewNode() {
  g_.nodes.emplace_back();
  return static_cast<uint32_t>(g_.nodes.size() - 1);
}

uint32_t Builder::NewRule() {
  g_.rule_start.push_back(0);
  defined_.push_back(false);
  return static_cast<uint32_t>(g_.rule_start.size() - 1);
}

void Builder::Define(uint32_t rule, Frag body) {
  // The end node is the rule's own, so that a return pops exactly here.
  const uint32_t end = NewNode();
  g_.nodes[end].end = true;
  AddEmpty(body.out, end);
  g_.rule_start[rule] = body.in;
  defined_[rule] = true;
}

void Builder::AddEmpty(uint32_t from, uint32_t to) { g_.nodes[from].empty.push_back(to); }

void Builder::AddRange(uint32_t from, uint8_t lo, uint8_t hi, uint32_t to) {
  g_.nodes[from].bytes.push_back({lo, hi, to});
}

Frag Builder::Empty() {
  const uint32_t n = NewNode();
  return {n, n};
}

Frag Builder::Range(uint8_t lo, uint8_t hi) {
  Frag f{NewNode(), NewNode()};
  AddRange(f.in, lo, hi, f.out);
  return f;
}

Frag Builder::Literal(absl::string_view bytes) {
  Frag f = Empty();
  for (char c : bytes) {
    const uint32_t next = NewNode();
    AddRange(f.out, static_cast<uint8_t>(c), static_cast<uint8_t>(c), next);
    f.out = next;
  }
  return f;
}

Frag Builder::Seq(const std::vector<Frag>& parts) {
  if (parts.empty()) return Empty();
  for (size_t i = 1; i < parts.size(); ++i) AddEmpty(parts[i - 1].out, parts[i].in);
  return {parts.front().in, parts.back().out};
}

Frag Builder::Alt(const std::vector<Frag>& options) {
  Frag f{NewNode(), NewNode()};
  for (const Frag& o : options) {
    AddEmpty(f.in, o.in);
    AddEmpty(o.out, f.out);
  }
  return f;
}

Frag Builder::Opt(Frag x) {
  Frag f{NewNode(), NewNode()};
  AddEmpty(f.in, x.in);
  AddEmpty(x.out, f.out);
  AddEmpty(f.in, f.out);
  return f;
}

Frag Builder::Star(Frag x) {
  // in -> x -> in: the loop closes through `in`, so `out` is left once.
  Frag f{NewNode(), NewNode()};
  AddEmpty(f.in, x.in);
  AddEmpty(x.out, f.in);
  AddEmpty(f.in, f.out);
  return f;
}

Frag Builder::Call(uint32_t rule) {
  Frag f{NewNode(), NewNode()};
  g_.nodes[f.in].calls.push_back({rule, f.out});
  return f;
}

absl::StatusOr<std::shared_ptr<const Grammar>> Builder::Build(uint32_t root, int32_t max_depth) {
  if (over_budget()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("grammar: more than ", max_nodes_, " nodes (raise --grammar_max_nodes, or simplify the schema)"));
  }
  for (size_t r = 0; r < defined_.size(); ++r) {
    if (!defined_[r]) return absl::InternalError(absl::StrCat("grammar: rule ", r, " is never defined"));
  }
  const size_t rules = g_.rule_start.size();
  // Nullable rules (they may end without reading a byte), to a fixed point.
  std::vector<bool> nullable(rules, false);
  auto walk = [&](uint32_t rule, std::vector<uint32_t>* callees) {
    // Nodes reachable from the rule's start without reading a byte; true
    // when its end is among them. Callees met on the way go to `callees`.
    std::vector<bool> seen(g_.nodes.size(), false);
    std::vector<uint32_t> todo{g_.rule_start[rule]};
    bool ends = false;
    while (!todo.empty()) {
      const uint32_t n = todo.back();
      todo.pop_back();
      if (seen[n]) continue;
      seen[n] = true;
      const Node& node = g_.nodes[n];
      if (node.end) ends = true;
      for (uint32_t e : node.empty) todo.push_back(e);
      for (const auto& [callee, ret] : node.calls) {
        if (callees != nullptr) callees->push_back(callee);
        if (nullable[callee]) todo.push_back(ret);
      }
    }
    return ends;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (uint32_t r = 0; r < rules; ++r) {
      if (!nullable[r] && walk(r, nullptr)) nullable[r] = changed = true;
    }
  }
  // Left recursion: a cycle in "calls before reading a byte".
  std::vector<std::vector<uint32_t>> first_calls(rules);
  for (uint32_t r = 0; r < rules; ++r) walk(r, &first_calls[r]);
  std::vector<int> color(rules, 0);  // 0 new, 1 on the path, 2 done.
  for (uint32_t start = 0; start < rules; ++start) {
    if (color[start] != 0) continue;
    std::vector<std::pair<uint32_t, size_t>> path{{start, 0}};
    color[start] = 1;
    while (!path.empty()) {
      auto& [r, i] = path.back();
      if (i == first_calls[r].size()) {
        color[r] = 2;
        path.pop_back();
        continue;
      }
      const uint32_t next = first_calls[r][i++];
      if (color[next] == 1) {
        return absl::InvalidArgumentError(
            "grammar: a rule refers to itself before any text (a $ref cycle that generates nothing)");
      }
      if (color[next] == 0) {
        color[next] = 1;
        path.push_back({next, 0});
      }
    }
  }
  g_.root = root;
  g_.max_depth = max_depth;
  return std::make_shared<const Grammar>(std::move(g_));
}

// ---- Stepper ----

bool Stepper::Seen() const {
  size_t i = 0;
  while (i < seen_.size()) {
    const uint32_t len = seen_[i];
    if (len == cur_.size() && std::equal(cur_.begin(), cur_.end(), seen_.begin() + i + 1)) return true;
    i += 1 + len;
  }
  return false;
}

void Stepper::Visit() {
  if (overflow_ || Seen()) return;
  if (++visits_ > kMaxClosureVisits) {
    overflow_ = true;
    return;
  }
  seen_.push_back(static_cast<uint32_t>(cur_.size()));
  seen_.insert(seen_.end(), cur_.begin(), cur_.end());
  const uint32_t n = cur_.back();
  const Node& node = g_.nodes[n];
  if (!node.bytes.empty()) {
    out_->words.push_back(static_cast<uint32_t>(cur_.size()));
    out_->words.insert(out_->words.end(), cur_.begin(), cur_.end());
  }
  for (uint32_t e : node.empty) {
    cur_.back() = e;
    Visit();
  }
  cur_.back() = n;
  if (static_cast<int32_t>(cur_.size()) < g_.max_depth) {
    for (const auto& [rule, ret] : node.calls) {
      cur_.back() = ret;
      cur_.push_back(g_.rule_start[rule]);
      Visit();
      cur_.pop_back();
    }
    cur_.back() = n;
  }
  if (node.end) {
    if (cur_.size() == 1) {
      out_->can_end = true;
    } else {
      cur_.pop_back();  // The frame below is where the call returns.
      Visit();
      cur_.push_back(n);
    }
  }
}

State Stepper::Initial() {
  State s;
  out_ = &s;
  seen_.clear();
  visits_ = 0;
  overflow_ = false;
  cur_.assign(1, g_.rule_start[g_.root]);
  Visit();
  if (overflow_) s = State{};
  return s;
}

void Stepper::Step(const State& in, uint8_t b, State* out) {
  out->words.clear();
  out->can_end = false;
  // The common case inside strings and literals: one stack, one edge for
  // the byte, to a node with byte edges only. Its closure is itself.
  if (!in.words.empty() && in.words[0] + 1 == in.words.size()) {
    const uint32_t len = in.words[0];
    const Node& top = g_.nodes[in.words[len]];
    const ByteEdge* hit = nullptr;
    int hits = 0;
    for (const ByteEdge& e : top.bytes) {
      if (b >= e.lo && b <= e.hi) {
        hit = &e;
        ++hits;
      }
    }
    if (hits == 0) return;
    const Node& to = g_.nodes[hit->to];
    if (hits == 1 && to.empty.empty() && to.calls.empty() && !to.end && !to.bytes.empty()) {
      out->words.assign(in.words.begin(), in.words.end());
      out->words.back() = hit->to;
      return;
    }
  }
  out_ = out;
  seen_.clear();
  visits_ = 0;
  overflow_ = false;
  size_t i = 0;
  while (i < in.words.size()) {
    const uint32_t len = in.words[i];
    const uint32_t* frames = in.words.data() + i + 1;
    const Node& top = g_.nodes[frames[len - 1]];
    for (const ByteEdge& e : top.bytes) {
      if (b < e.lo || b > e.hi) continue;
      cur_.assign(frames, frames + len);
      cur_.back() = e.to;
      Visit();
    }
    i += 1 + len;
  }
  if (overflow_) {
    out->words.clear();
    out->can_end = false;
  }
}

// ---- Matcher ----

Matcher::Matcher(std::shared_ptr<const Grammar> g) : g_(std::move(g)), stepper_(*g_) { state_ = stepper_.Initial(); }

bool Matcher::Advance(absl::string_view bytes) {
  State s = state_;
  for (char c : bytes) {
    stepper_.Step(s, static_cast<uint8_t>(c), &next_);
    if (next_.dead()) return false;
    std::swap(s, next_);
  }
  state_ = std::move(s);
  return true;
}

uint64_t DigestOf(const State& s) {
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  const uint8_t end = s.can_end ? 1 : 0;
  XXH3_64bits_update(h, &end, 1);
  // Little-endian words, whatever the host.
  for (uint32_t w : s.words) {
    const uint8_t le[4] = {static_cast<uint8_t>(w), static_cast<uint8_t>(w >> 8), static_cast<uint8_t>(w >> 16),
                           static_cast<uint8_t>(w >> 24)};
    XXH3_64bits_update(h, le, 4);
  }
  const uint64_t d = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return d;
}

uint64_t Matcher::Digest() const { return DigestOf(state_); }

}  // namespace pdserve::grammar
