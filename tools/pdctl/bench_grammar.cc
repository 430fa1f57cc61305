#include "tools/pdctl/bench_grammar.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "engine/generation.h"
#include "grammar/constraint.h"
#include "text/tokenizer.h"
#include "tools/pdctl/bench_stats.h"

namespace pdserve::pdctl {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kSchema[] = R"({"type":"object","properties":{
  "name":{"type":"string","maxLength":24},
  "role":{"enum":["king","priest","prophet","scribe"]},
  "born":{"type":"integer"},
  "place":{"type":"object","properties":{"city":{"type":"string","maxLength":16},"lat":{"type":"number"}},
           "required":["city","lat"],"additionalProperties":false},
  "sons":{"type":"array","items":{"type":"string","maxLength":12},"maxItems":4}},
  "required":["name","role","born","place","sons"],"additionalProperties":false})";

void Progress(const std::string& what) { std::fprintf(stderr, "bench-engine: %s\n", what.c_str()); }

double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

absl::StatusOr<nlohmann::ordered_json> BenchMasks(const BenchMaskOptions& o) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const std::string& dir : o.tokenizer_dirs) {
    Progress(absl::StrCat("response format masks: vocabulary of ", dir));
    absl::StatusOr<std::unique_ptr<tok::Tokenizer>> t = tok::Tokenizer::Load(dir);
    if (!t.ok()) return t.status();
    const int32_t vocab = (*t)->vocab_size();
    grammar::GrammarCache cache({}, grammar::Vocabulary::FromTokenizer(**t));
    absl::StatusOr<std::shared_ptr<const grammar::Constraint>> c = cache.FromSchema(kSchema);
    if (!c.ok()) return c.status();
    std::vector<int32_t> eos;
    if ((*t)->eos_id().has_value()) eos.push_back(*(*t)->eos_id());
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> logits(vocab);
    std::vector<double> warm, all;
    double cold_seconds = 0;
    int64_t cold = 0, tokens = 0, complete = 0;
    for (int g = 0; g < o.generations; ++g) {
      GenerationRequest r;
      r.prompt = {1};
      r.params.temperature = 1.0f;
      r.params.seed = 100 + g;
      r.params.max_tokens = o.max_tokens;
      r.eos_ids = eos;
      GenerationRequest free = r;
      r.constraint = *c;
      Generation constrained(r, nullptr), unconstrained(free, nullptr);
      while (!constrained.finished()) {
        for (float& v : logits) v = normal(rng);
        const int64_t misses_before = (*c)->masker->stats().misses;
        auto t0 = Clock::now();
        absl::StatusOr<TokenEvent> e = constrained.Accept(logits);
        const double with = Since(t0);
        if (!e.ok()) return e.status();
        t0 = Clock::now();
        if (!unconstrained.finished()) (void)unconstrained.Accept(logits);
        const double without = Since(t0);
        const double cost = std::max(0.0, with - without);
        all.push_back(cost);
        ++tokens;
        if ((*c)->masker->stats().misses > misses_before) {
          ++cold;
          cold_seconds += cost;
        } else {
          warm.push_back(cost);
        }
      }
      if (constrained.finish() == FinishReason::kStop) ++complete;
    }
    double mean = 0;
    for (double x : all) mean += x;
    mean /= std::max<size_t>(1, all.size());
    const grammar::MaskerStats st = (*c)->masker->stats();
    nlohmann::ordered_json row = {{"tokenizer", dir},
                                  {"vocab", vocab},
                                  {"tokens", tokens},
                                  {"complete_outputs", complete},
                                  {"generations", o.generations},
                                  {"states", st.states},
                                  {"warm_token_seconds", warm.empty() ? 0.0 : Median(warm)},
                                  {"cold_mask_seconds", cold == 0 ? 0.0 : cold_seconds / static_cast<double>(cold)},
                                  {"cold_masks", cold},
                                  {"mean_token_seconds", mean},
                                  {"step_seconds", o.step_seconds}};
    if (o.step_seconds > 0) {
      row["warm_fraction_of_step"] = row["warm_token_seconds"].get<double>() / o.step_seconds;
      row["mean_fraction_of_step"] = mean / o.step_seconds;
    }
    rows.push_back(row);
  }
  return rows;
}

}  // namespace pdserve::pdctl
