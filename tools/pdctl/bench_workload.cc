#include "tools/pdctl/bench_workload.h"

#include <algorithm>
#include <map>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::pdctl {
namespace {

absl::Status CheckRange(const char* what, int lo, int hi) {
  if (lo < 1 || hi < lo) return absl::InvalidArgumentError(absl::StrCat(what, ": need 1 <= min <= max"));
  return absl::OkStatus();
}

class Drawer {
 public:
  Drawer(uint64_t seed, int32_t vocab) : rng_(seed), vocab_(static_cast<uint64_t>(vocab)) {}
  int32_t Token() { return static_cast<int32_t>(rng_() % vocab_); }
  void AppendTokens(int n, std::vector<int32_t>& out) {
    for (int i = 0; i < n; ++i) out.push_back(Token());
  }
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  double UnitGap() { return std::exponential_distribution<double>(1.0)(rng_); }

 private:
  std::mt19937_64 rng_;
  uint64_t vocab_;
};

// Prefixes of `lengths[g]` tokens, one per group; prefix g starts with token
// (first + g) % vocab, so no two groups share even their first token.
// REQUIRES: lengths.size() <= vocab.
// Draws nothing when there are no groups (the plain workload's stream stays
// as it was).
std::vector<std::vector<int32_t>> GroupPrefixes(const std::vector<int32_t>& lengths, int32_t vocab, Drawer& draw) {
  if (lengths.empty()) return {};
  const int32_t first = draw.Token();
  std::vector<std::vector<int32_t>> prefixes(lengths.size());
  for (size_t g = 0; g < lengths.size(); ++g) {
    if (lengths[g] == 0) continue;
    prefixes[g].push_back(static_cast<int32_t>((static_cast<int64_t>(first) + static_cast<int64_t>(g)) % vocab));
    draw.AppendTokens(lengths[g] - 1, prefixes[g]);
  }
  return prefixes;
}

// A request's own tokens after its group's prefix: the first is its index in
// the group, so that the shared part ends exactly where the prefix does.
void AppendSuffix(int64_t index_in_group, int n, int32_t vocab, Drawer& draw, std::vector<int32_t>& prompt) {
  if (n <= 0) return;
  prompt.push_back(static_cast<int32_t>(index_in_group % vocab));
  draw.AppendTokens(n - 1, prompt);
}

absl::StatusOr<std::vector<WorkloadRequest>> FromTrace(const WorkloadOptions& o, Drawer& draw) {
  // Groups numbered in order of first appearance; each prefix as long as the
  // longest any of its requests uses.
  std::map<int64_t, size_t> group_index;
  std::vector<int32_t> lengths;
  for (const TraceEntry& e : o.trace) {
    if (e.prefix_group < 0) continue;
    const auto [it, added] = group_index.emplace(e.prefix_group, lengths.size());
    if (added) lengths.push_back(0);
    lengths[it->second] = std::max(lengths[it->second], e.prefix_tokens);
  }
  if (lengths.size() > static_cast<size_t>(o.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat("the trace has ", lengths.size(),
                                                   " prefix groups, more than the vocabulary's ", o.vocab_size,
                                                   " ids: group prefixes could not all differ"));
  }
  const std::vector<std::vector<int32_t>> prefixes = GroupPrefixes(lengths, o.vocab_size, draw);
  std::vector<int64_t> seen(lengths.size(), 0);
  std::vector<WorkloadRequest> work(o.trace.size());
  for (size_t i = 0; i < o.trace.size(); ++i) {
    const TraceEntry& e = o.trace[i];
    WorkloadRequest& w = work[i];
    w.max_tokens = e.output_tokens;
    if (e.prefix_group >= 0) {
      const size_t g = group_index.at(e.prefix_group);
      w.prefix_group = static_cast<int64_t>(g);
      w.prefix_tokens = e.prefix_tokens;
      w.prompt.assign(prefixes[g].begin(), prefixes[g].begin() + e.prefix_tokens);
      AppendSuffix(seen[g]++, e.prompt_tokens - e.prefix_tokens, o.vocab_size, draw, w.prompt);
    } else {
      draw.AppendTokens(e.prompt_tokens, w.prompt);
    }
    if (o.draw_gaps) w.unit_gap = draw.UnitGap();
  }
  return work;
}

absl::StatusOr<std::vector<WorkloadRequest>> MultiTurn(const WorkloadOptions& o, Drawer& draw) {
  const int turns = o.multi_turn_turns;
  const int systems = o.shared_prefix_groups > 0 ? o.shared_prefix_groups : 64;
  if (o.multi_turn_system_tokens < 1) return absl::InvalidArgumentError("--multi-turn: need at least 1 system token");
  if (systems > o.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("--multi-turn: ", systems, " system prompts, more than the ",
                                                   "vocabulary's ", o.vocab_size, " ids"));
  }
  const std::vector<std::vector<int32_t>> system_prompts =
      GroupPrefixes(std::vector<int32_t>(systems, o.multi_turn_system_tokens), o.vocab_size, draw);
  const int conversations = (o.requests + turns - 1) / turns;
  // Each conversation's history so far, and its system prompt.
  std::vector<std::vector<int32_t>> history(conversations);
  std::vector<int> system_of(conversations);
  std::vector<int64_t> in_group(systems, 0);
  for (int c = 0; c < conversations; ++c) {
    system_of[c] = draw.Uniform(0, systems - 1);
    history[c] = system_prompts[system_of[c]];
  }
  std::vector<int> order(conversations);
  for (int c = 0; c < conversations; ++c) order[c] = c;
  std::vector<WorkloadRequest> work;
  work.reserve(static_cast<size_t>(conversations) * turns);
  std::vector<int32_t> last_reply(conversations, 0);
  for (int t = 0; t < turns; ++t) {
    for (int i = conversations - 1; i > 0; --i) std::swap(order[i], order[draw.Uniform(0, i)]);
    for (int c : order) {
      std::vector<int32_t>& h = history[c];
      if (t > 0) draw.AppendTokens(last_reply[c], h);  // The reply to the turn before.
      // The user turn; at turn 0 its first token tells the conversation
      // apart from others on the same system prompt.
      const int n = draw.Uniform(o.prompt_min, o.prompt_max);
      if (t == 0) {
        AppendSuffix(in_group[system_of[c]]++, n, o.vocab_size, draw, h);
      } else {
        draw.AppendTokens(n, h);
      }
      WorkloadRequest w;
      w.prompt = h;
      w.prefix_group = system_of[c];
      w.prefix_tokens = o.multi_turn_system_tokens;
      w.conversation = c;
      w.turn = t;
      w.max_tokens = draw.Uniform(o.output_min, o.output_max);
      last_reply[c] = w.max_tokens;
      if (o.draw_gaps) w.unit_gap = draw.UnitGap();
      work.push_back(std::move(w));
    }
  }
  return work;
}

}  // namespace

absl::StatusOr<std::vector<WorkloadRequest>> MakeWorkload(const WorkloadOptions& o) {
  if (o.vocab_size < 1) return absl::InvalidArgumentError("workload: the vocabulary is empty");
  Drawer draw(o.seed, o.vocab_size);
  if (!o.trace.empty()) {
    if (o.shared_prefix_groups > 0) {
      return absl::InvalidArgumentError("a trace and --shared-prefix do not go together (the trace names its groups)");
    }
    return FromTrace(o, draw);
  }
  if (o.requests < 1) return absl::InvalidArgumentError("--requests must be at least 1");
  if (absl::Status s = CheckRange("--prompt-tokens", o.prompt_min, o.prompt_max); !s.ok()) return s;
  if (absl::Status s = CheckRange("--output-tokens", o.output_min, o.output_max); !s.ok()) return s;
  if (o.multi_turn_turns < 0) return absl::InvalidArgumentError("--multi-turn: turns must be at least 1");
  if (o.multi_turn_turns > 0) return MultiTurn(o, draw);
  const int groups = o.shared_prefix_groups;
  if (groups < 0 || (groups > 0 && o.shared_prefix_tokens < 1)) {
    return absl::InvalidArgumentError("--shared-prefix: need at least 1 group and 1 prefix token");
  }
  if (groups > o.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("--shared-prefix: ", groups, " groups, more than the vocabulary's ",
                                                   o.vocab_size, " ids: group prefixes could not all differ"));
  }
  const std::vector<std::vector<int32_t>> prefixes =
      GroupPrefixes(std::vector<int32_t>(groups, o.shared_prefix_tokens), o.vocab_size, draw);
  std::vector<WorkloadRequest> work(o.requests);
  std::vector<int64_t> in_group(static_cast<size_t>(std::max(groups, 0)), 0);
  for (int i = 0; i < o.requests; ++i) {
    WorkloadRequest& w = work[i];
    const int n = draw.Uniform(o.prompt_min, o.prompt_max);
    if (groups > 0) {
      const int g = draw.Uniform(0, groups - 1);
      w.prefix_group = g;
      w.prefix_tokens = o.shared_prefix_tokens;
      w.prompt = prefixes[g];
      AppendSuffix(in_group[g]++, n, o.vocab_size, draw, w.prompt);
    } else {
      draw.AppendTokens(n, w.prompt);
    }
    w.max_tokens = draw.Uniform(o.output_min, o.output_max);
    if (o.draw_gaps) w.unit_gap = draw.UnitGap();
  }
  return work;
}

std::vector<double> ArrivalTimes(const std::vector<WorkloadRequest>& work, double rate) {
  std::vector<double> at(work.size());
  double t = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    at[i] = t;
    t += work[i].unit_gap / rate;
  }
  return at;
}

}  // namespace pdserve::pdctl
