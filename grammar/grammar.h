// A grammar over bytes, as a recursive transition network: rules, each a
// graph of nodes joined by byte-range edges, empty edges and calls of other
// rules. It is what a JSON Schema compiles to (json_schema.h), and what the
// Matcher below walks byte by byte.
//
// A Matcher's state is the set of stacks the bytes so far allow (each stack:
// the return nodes of the rules it is inside, then the node it is at). A
// state is kept closed: every stack's top has at least one byte edge, and
// `can_end` says whether the root rule may end here. The set stays small
// for JSON (one stack, a few where anyOf branches share a prefix), and two
// matchers fed the same bytes hold the same state word for word, so a
// state's digest checks that two processes agree.
//
// Bounds: a stack holds at most Grammar::max_depth frames (nesting deeper
// than that is not generated), and one byte's closure visits at most
// kMaxClosureVisits stacks (past that the byte is refused), so no grammar
// makes a byte cost more than that.
//
// Thread safety: a Grammar is immutable once built and shared freely; a
// Matcher is one owner's.
#ifndef PDSERVE_GRAMMAR_GRAMMAR_H_
#define PDSERVE_GRAMMAR_GRAMMAR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdserve::grammar {

inline constexpr int32_t kMaxClosureVisits = 4096;

struct ByteEdge {
  uint8_t lo = 0;
  uint8_t hi = 0;  // Inclusive.
  uint32_t to = 0;
};

struct Node {
  std::vector<ByteEdge> bytes;
  std::vector<uint32_t> empty;                      // Empty edges.
  std::vector<std::pair<uint32_t, uint32_t>> calls;  // (rule, node to return to).
  bool end = false;                                  // Its rule ends here.
};

struct Grammar {
  std::vector<Node> nodes;
  std::vector<uint32_t> rule_start;  // By rule id.
  uint32_t root = 0;                 // Rule id.
  int32_t max_depth = 128;
};

// A piece of a rule under construction: enter at `in`, leave at `out`.
struct Frag {
  uint32_t in = 0;
  uint32_t out = 0;
};

// Builds a Grammar from fragments. Rules are declared first and defined
// later, so rules may call each other (and themselves).
class Builder {
 public:
  explicit Builder(int64_t max_nodes) : max_nodes_(max_nodes) {}

  uint32_t NewRule();
  void Define(uint32_t rule, Frag body);

  Frag Range(uint8_t lo, uint8_t hi);
  Frag Literal(absl::string_view bytes);
  Frag Seq(const std::vector<Frag>& parts);  // Empty: matches nothing, i.e. the empty string.
  Frag Alt(const std::vector<Frag>& options);
  Frag Opt(Frag f);
  Frag Star(Frag f);  // Zero or more.
  Frag Call(uint32_t rule);
  Frag Empty();
  // Raw graph access, for shapes the combinators do not cover.
  uint32_t NewNode();
  void AddEmpty(uint32_t from, uint32_t to);
  void AddRange(uint32_t from, uint8_t lo, uint8_t hi, uint32_t to);

  // RESOURCE_EXHAUSTED when more than max_nodes nodes were made;
  // INVALID_ARGUMENT when a rule is left undefined or can call itself
  // before reading a byte (left recursion, which no input could end).
  absl::StatusOr<std::shared_ptr<const Grammar>> Build(uint32_t root, int32_t max_depth);

  bool over_budget() const { return static_cast<int64_t>(g_.nodes.size()) > max_nodes_; }

 private:
  Grammar g_;
  std::vector<bool> defined_;
  int64_t max_nodes_;
};

// The stacks a grammar's input may be in, closed (see the file comment).
// `words` holds each stack as [frame count, frames...], bottom frame first.
struct State {
  std::vector<uint32_t> words;
  bool can_end = false;

  bool dead() const { return words.empty() && !can_end; }
  // Nothing more can be read: the input is complete.
  bool complete() const { return words.empty() && can_end; }
  bool operator==(const State& o) const { return can_end == o.can_end && words == o.words; }
};

// The closed state and byte steps of one grammar, with scratch buffers
// reused between calls (not thread-safe; one per thread).
class Stepper {
 public:
  explicit Stepper(const Grammar& g) : g_(g) {}
  State Initial();
  // `out` = the state after byte `b` from `in` (dead when `b` is refused).
  // REQUIRES: &in != out.
  void Step(const State& in, uint8_t b, State* out);

 private:
  void Visit();
  bool Seen() const;

  const Grammar& g_;
  std::vector<uint32_t> cur_;
  std::vector<uint32_t> seen_;  // Stacks visited by this step, as in State::words.
  State* out_ = nullptr;
  int32_t visits_ = 0;
  bool overflow_ = false;
};

// Follows one input, byte by byte.
class Matcher {
 public:
  explicit Matcher(std::shared_ptr<const Grammar> g);

  // Reads `bytes`; false (and the state unchanged) when the grammar refuses
  // any of them.
  bool Advance(absl::string_view bytes);
  const State& state() const { return state_; }
  // xxHash of the state: equal for equal states, in any process.
  uint64_t Digest() const;

 private:
  std::shared_ptr<const Grammar> g_;
  Stepper stepper_;
  State state_, next_;
};

uint64_t DigestOf(const State& s);

}  // namespace pdserve::grammar

#endif  // PDSERVE_GRAMMAR_GRAMMAR_H_
