#include "grammar/constraint.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "xxhash.h"

namespace pdserve::grammar {

uint64_t SpecHash(ConstraintKind kind, absl::string_view canonical_schema) {
  const std::string keyed = absl::StrCat(static_cast<int32_t>(kind), ":", canonical_schema);
  return XXH3_64bits(keyed.data(), keyed.size());
}

GrammarCache::GrammarCache(GrammarOptions options, std::shared_ptr<const Vocabulary> vocab)
    : options_(std::move(options)), vocab_(std::move(vocab)) {
  masks_->budget_bytes = options_.max_mask_bytes;
}

GrammarCache::GrammarCache(GrammarOptions options, std::function<std::shared_ptr<const Vocabulary>()> make_vocab)
    : options_(std::move(options)), make_vocab_(std::move(make_vocab)) {
  masks_->budget_bytes = options_.max_mask_bytes;
}

std::shared_ptr<const Vocabulary> GrammarCache::Vocab() {
  absl::MutexLock lock(&mu_);
  if (vocab_ == nullptr) vocab_ = make_vocab_();
  return vocab_;
}

absl::StatusOr<std::shared_ptr<const Constraint>> GrammarCache::Find(ConstraintKind kind, absl::string_view canonical,
                                                                     absl::string_view raw) {
  const uint64_t hash = SpecHash(kind, canonical);
  {
    absl::MutexLock lock(&mu_);
    if (auto it = by_hash_.find(hash); it != by_hash_.end() && it->second->spec.schema == canonical) {
      ++stats_.hits;
      return it->second;
    }
  }
  const absl::Time start = absl::Now();
  auto c = std::make_shared<Constraint>();
  c->spec.kind = kind;
  c->spec.hash = hash;
  if (kind == ConstraintKind::kJsonObject) {
    absl::StatusOr<std::shared_ptr<const Grammar>> g = CompileAnyJsonObject(options_.schema);
    if (!g.ok()) return g.status();
    c->grammar = *std::move(g);
  } else {
    absl::StatusOr<CompiledSchema> s = kind == ConstraintKind::kToolCalls ? CompileToolCalls(raw, options_.schema)
                                                                           : CompileJsonSchema(raw, options_.schema);
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      ++stats_.refused;
      return s.status();
    }
    c->grammar = std::move(s->grammar);
    c->spec.schema = std::move(s->canonical);
  }
  c->masker = std::make_shared<TokenMasker>(c->grammar, Vocab(), options_.max_mask_states, masks_);
  absl::MutexLock lock(&mu_);
  ++stats_.compiled;
  stats_.compile_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  if (by_hash_.emplace(hash, c).second) {
    order_.push_back(hash);
    while (static_cast<int32_t>(order_.size()) > options_.max_grammars) {
      by_hash_.erase(order_.front());
      order_.pop_front();
    }
  }
  return std::shared_ptr<const Constraint>(std::move(c));
}

absl::StatusOr<std::shared_ptr<const Constraint>> GrammarCache::FromSchema(absl::string_view schema) {
  if (static_cast<int64_t>(schema.size()) > options_.schema.max_schema_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("schema: ", schema.size(), " bytes, more than the ",
                                                   options_.schema.max_schema_bytes,
                                                   " allowed (--grammar_max_schema_bytes)"));
  }
  if (absl::Status s = CheckJsonDepth(schema, options_.schema.max_schema_depth); !s.ok()) return s;
  // The canonical text names the cache entry; compiling checks the rest
  // (depth included) on a miss, and a hit was checked when it compiled.
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(schema, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("schema: not valid JSON");
  const std::string canonical = j.dump();
  return Find(ConstraintKind::kJsonSchema, canonical, schema);
}

absl::StatusOr<std::shared_ptr<const Constraint>> GrammarCache::JsonObject() {
  return Find(ConstraintKind::kJsonObject, "", "");
}

absl::StatusOr<std::shared_ptr<const Constraint>> GrammarCache::ToolCalls(absl::string_view spec) {
  // The bounds CompileToolCalls applies, before the parser here (which
  // recurses) sees the text.
  if (static_cast<int64_t>(spec.size()) > options_.schema.max_schema_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tools: ", spec.size(), " bytes of parameter schemas, more than the ",
                                                   options_.schema.max_schema_bytes,
                                                   " allowed (--grammar_max_schema_bytes)"));
  }
  if (absl::Status s = CheckJsonDepth(spec, options_.schema.max_schema_depth + 3); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tools: ", s.message()));
  }
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(spec, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("tools: not valid JSON");
  return Find(ConstraintKind::kToolCalls, j.dump(), spec);
}

absl::StatusOr<std::shared_ptr<const Constraint>> GrammarCache::FromSpec(const ConstraintSpec& spec) {
  if (spec.kind != ConstraintKind::kJsonObject && spec.kind != ConstraintKind::kJsonSchema &&
      spec.kind != ConstraintKind::kToolCalls) {
    return absl::InvalidArgumentError(absl::StrCat("grammar: unknown kind ", static_cast<int32_t>(spec.kind)));
  }
  if (SpecHash(spec.kind, spec.schema) != spec.hash) {
    return absl::InvalidArgumentError("grammar: the spec's hash is not its schema's");
  }
  if (spec.kind == ConstraintKind::kJsonObject) return JsonObject();
  return Find(spec.kind, spec.schema, spec.schema);
}

void GrammarCache::RegisterMetrics(MetricsRegistry& metrics) const {
  auto stat = [this](int64_t GrammarCacheStats::*field) {
    return [this, field] { return static_cast<double>(stats().*field); };
  };
  metrics.AddCounterFunc("pdserve_grammar_compiles_total", "Response formats compiled, or refused as bad schemas.",
                         stat(&GrammarCacheStats::compiled), "outcome=\"compiled\"");
  metrics.AddCounterFunc("pdserve_grammar_compiles_total", "Response formats compiled, or refused as bad schemas.",
                         stat(&GrammarCacheStats::refused), "outcome=\"refused\"");
  metrics.AddCounterFunc("pdserve_grammar_cache_hits_total", "Response formats found compiled, by schema hash.",
                         stat(&GrammarCacheStats::hits));
  metrics.AddCounterFunc("pdserve_grammar_compile_seconds_total", "Seconds spent compiling response formats.",
                         [this] { return stats().compile_seconds; });
  const MaskCounters* m = masks_.get();
  metrics.AddCounterFunc("pdserve_grammar_masks_total", "Token masks looked up, from the cache or computed.",
                         [m] { return static_cast<double>(m->hits.load(std::memory_order_relaxed)); },
                         "outcome=\"cached\"");
  metrics.AddCounterFunc("pdserve_grammar_masks_total", "Token masks looked up, from the cache or computed.",
                         [m] { return static_cast<double>(m->misses.load(std::memory_order_relaxed)); },
                         "outcome=\"computed\"");
  metrics.AddGauge("pdserve_grammar_mask_bytes", "Bytes of token masks cached now, every format together.",
                   [m] { return static_cast<double>(m->bytes.load(std::memory_order_relaxed)); });
  metrics.AddCounterFunc("pdserve_grammar_mask_seconds_total", "Seconds spent computing token masks (cache misses).",
                         [m] { return 1e-9 * static_cast<double>(m->miss_nanoseconds.load(std::memory_order_relaxed)); });
}

GrammarCacheStats GrammarCache::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace pdserve::grammar
