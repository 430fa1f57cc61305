// A response format as the engine applies it: the spec that travels on the
// wire (kind, canonical schema, hash), compiled once per process into a
// grammar and a token masker, and kept in a bounded cache by hash.
//
// Where the work runs: the router validates and compiles a client's format
// (refusing a bad one before any worker sees it) and sends workers the
// spec: the canonical schema text and its hash, not the compiled form. A
// worker compiles a spec on its first sight of the hash and keeps it; the
// compile is deterministic, so every process reaches the same grammar,
// which the handoff checks (a matcher's digest). The spec is a few hundred
// bytes where the compiled grammar is tens of kilobytes, and the masks,
// which are what costs, depend on the worker's vocabulary and belong in
// the worker anyway.
//
// Thread safety: thread-safe; Constraint is immutable (its masker is
// thread-safe).
#ifndef PDSERVE_GRAMMAR_CONSTRAINT_H_
#define PDSERVE_GRAMMAR_CONSTRAINT_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "base/metrics.h"
#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/token_mask.h"

namespace pdserve::grammar {

enum class ConstraintKind : int32_t { kNone = 0, kJsonObject = 1, kJsonSchema = 2, kToolCalls = 3 };

struct ConstraintSpec {
  ConstraintKind kind = ConstraintKind::kNone;
  // Canonical JSON: the schema (kJsonSchema), the tools spec (kToolCalls,
  // json_schema.h's CompileToolCalls); empty otherwise.
  std::string schema;
  uint64_t hash = 0;   // SpecHash(kind, schema).
};

// xxHash of the kind and the canonical schema: the same in every process.
uint64_t SpecHash(ConstraintKind kind, absl::string_view canonical_schema);

struct Constraint {
  ConstraintSpec spec;
  std::shared_ptr<const Grammar> grammar;
  std::shared_ptr<TokenMasker> masker;  // Over the process's vocabulary.
};

struct GrammarOptions {
  SchemaOptions schema;
  int64_t max_mask_states = 2048;     // Per grammar (each vocab/8 bytes).
  int64_t max_mask_bytes = 256 << 20;  // Every grammar's masks together (0: no bound).
  int32_t max_grammars = 64;       // Compiled grammars kept, oldest dropped first.
};

struct GrammarCacheStats {
  int64_t compiled = 0;
  int64_t hits = 0;
  int64_t refused = 0;
  double compile_seconds = 0;
};

class GrammarCache {
 public:
  GrammarCache(GrammarOptions options, std::shared_ptr<const Vocabulary> vocab);
  // The vocabulary is made on the first compile (a large tokenizer's takes
  // a fraction of a second), so a process that never sees a response
  // format never pays for it.
  GrammarCache(GrammarOptions options, std::function<std::shared_ptr<const Vocabulary>()> make_vocab);

  // A client's JSON Schema, validated and compiled, or found by its hash.
  // Errors: json_schema.h's, for the caller to put the field's name in front of.
  absl::StatusOr<std::shared_ptr<const Constraint>> FromSchema(absl::string_view schema);
  absl::StatusOr<std::shared_ptr<const Constraint>> JsonObject();
  // Tool calls (CompileToolCalls's spec and errors).
  absl::StatusOr<std::shared_ptr<const Constraint>> ToolCalls(absl::string_view spec);
  // A spec the router resolved. INVALID_ARGUMENT when its hash is not its
  // content's, or it does not compile.
  absl::StatusOr<std::shared_ptr<const Constraint>> FromSpec(const ConstraintSpec& spec);

  GrammarCacheStats stats() const;
  // Every mask lookup of this cache's formats, kept or dropped.
  const MaskCounters& masks() const { return *masks_; }

  // Registers the pdserve_grammar_* series (compiles, cache hits, masks)
  // on `metrics`. REQUIRES: this cache outlives `metrics`' scrapes.
  void RegisterMetrics(MetricsRegistry& metrics) const;

 private:
  absl::StatusOr<std::shared_ptr<const Constraint>> Find(ConstraintKind kind, absl::string_view canonical,
                                                         absl::string_view raw);

  std::shared_ptr<const Vocabulary> Vocab();

  const GrammarOptions options_;
  std::function<std::shared_ptr<const Vocabulary>()> make_vocab_;
  std::shared_ptr<MaskCounters> masks_ = std::make_shared<MaskCounters>();
  mutable absl::Mutex mu_;
  std::shared_ptr<const Vocabulary> vocab_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<const Constraint>> by_hash_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> order_ ABSL_GUARDED_BY(mu_);
  GrammarCacheStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::grammar

#endif  // PDSERVE_GRAMMAR_CONSTRAINT_H_
