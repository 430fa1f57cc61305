#include "tools/pdctl/commands.h"

#include <algorithm>
#include <optional>
#include <random>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "text/detokenizer.h"
#include "text/stop_strings.h"

namespace pdserve::pdctl {
namespace {

}  // namespace

absl::Status PrintLogits(const ModelStackOptions& options, const std::vector<int32_t>& ids,
                         bool all_positions) {
  absl::StatusOr<ModelStack> engine = LoadModelStack(options);
  if (!engine.ok()) return engine.status();
  SequenceKv seq = engine->kv->NewSequence();
  ForwardSequence fs{&seq, ids, all_positions ? LogitsMode::kAll : LogitsMode::kLast};
  absl::StatusOr<ForwardResult> r = ForwardGrowing(*engine->model, *engine->kv, {&fs, 1});
  if (!r.ok()) return r.status();
  std::string line;
  char buf[32];
  for (int32_t row = 0; row < r->num_rows[0]; ++row) {
    line.clear();
    line.push_back('[');
    absl::Span<const float> logits = r->Row(r->first_row[0] + row);
    for (size_t i = 0; i < logits.size(); ++i) {
      std::snprintf(buf, sizeof(buf), i == 0 ? "%.9g" : ",%.9g", logits[i]);
      line += buf;
    }
    line += "]\n";
    std::fputs(line.c_str(), stdout);
  }
  return absl::OkStatus();
}

absl::Status Generate(const ModelStackOptions& options, const std::vector<int32_t>& prompt,
                      SamplingParams params, const TextOutput& text) {
  absl::StatusOr<ModelStack> engine = LoadModelStack(options);
  if (!engine.ok()) return engine.status();
  const ModelConfig& config = engine->model->config();
  if (absl::Status s = ValidateSamplingParams(params, config.vocab_size); !s.ok()) return s;
  const uint64_t seed = params.seed.has_value() ? *params.seed : std::random_device{}() * 0x100000001ull;
  const std::vector<int32_t>& eos = config.eos_token_ids;
  PenaltyState penalties(prompt);
  SequenceKv seq = engine->kv->NewSequence();
  std::vector<int32_t> out;
  std::vector<SampledToken> sampled;
  std::vector<int32_t> feed = prompt;
  FinishReason finish = FinishReason::kNone;
  std::optional<tok::IncrementalDetokenizer> detok;
  std::optional<tok::StopStringMatcher> stops;
  if (text.tokenizer != nullptr) {
    detok.emplace(*text.tokenizer, prompt, /*skip_special_tokens=*/true);
    stops.emplace(text.stop_strings);
  }
  while (finish == FinishReason::kNone) {
    ForwardSequence fs{&seq, feed, LogitsMode::kLast};
    absl::StatusOr<ForwardResult> r = ForwardGrowing(*engine->model, *engine->kv, {&fs, 1});
    if (!r.ok()) return r.status();
    // The token sampled now will sit at position seq.num_positions().
    SampledToken t = SampleToken(r->Last(0), params, penalties, seed, seq.num_positions());
    out.push_back(t.token);
    penalties.AddGenerated(t.token);
    finish = CheckFinish(params, eos, t.token, static_cast<int32_t>(out.size()));
    feed.assign(1, t.token);
    sampled.push_back(std::move(t));
    if (detok.has_value()) {
      absl::StatusOr<std::string> delta = detok->Add(out.back());
      if (!delta.ok()) return delta.status();
      if (finish != FinishReason::kNone) {
        absl::StatusOr<std::string> rest = detok->Finish();
        if (!rest.ok()) return rest.status();
        *delta += *rest;
      }
      tok::StopStringMatcher::Result r = stops->Feed(*delta);
      if (finish != FinishReason::kNone && !r.stopped) r.text += stops->Flush();
      std::fwrite(r.text.data(), 1, r.text.size(), stdout);
      std::fflush(stdout);
      if (r.stopped) finish = FinishReason::kStop;
    }
  }
  if (detok.has_value()) {
    std::printf("\n");
  } else {
    std::printf("%s\n", absl::StrJoin(out, ",").c_str());
  }
  if (params.logprobs > 0) {
    for (const SampledToken& t : sampled) {
      std::string top;
      for (const auto& [id, lp] : t.top_logprobs) {
        absl::StrAppend(&top, top.empty() ? "" : ",", "[", id, ",", lp, "]");
      }
      std::printf("{\"token\":%d,\"logprob\":%.6g,\"top\":[%s]}\n", t.token, t.logprob, top.c_str());
    }
  }
  std::fflush(stdout);
  std::fprintf(stderr, "seed=%llu finish=%s tokens=%zu\n", static_cast<unsigned long long>(seed),
               finish == FinishReason::kStop ? "stop" : "length", out.size());
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
