#include "tools/pdctl/commands.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdserve::pdctl {
namespace {

int32_t Argmax(absl::Span<const float> logits) {
  int32_t best = 0;
  for (int32_t i = 1; i < static_cast<int32_t>(logits.size()); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

}  // namespace

absl::Status PrintLogits(const EngineOptions& options, const std::vector<int32_t>& ids,
                         bool all_positions) {
  absl::StatusOr<Engine> engine = MakeEngine(options);
  if (!engine.ok()) return engine.status();
  SequenceKv seq;
  ForwardSequence fs{&seq, ids, all_positions ? LogitsMode::kAll : LogitsMode::kLast};
  absl::StatusOr<ForwardResult> r = engine->model->Forward(*engine->pool, {&fs, 1});
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
  seq.Release(*engine->pool);
  return absl::OkStatus();
}

absl::Status GenerateGreedy(const EngineOptions& options, const std::vector<int32_t>& prompt,
                            int max_tokens) {
  absl::StatusOr<Engine> engine = MakeEngine(options);
  if (!engine.ok()) return engine.status();
  const std::vector<int32_t>& eos = engine->model->config().eos_token_ids;
  SequenceKv seq;
  std::vector<int32_t> out;
  std::vector<int32_t> feed = prompt;
  for (int i = 0; i < max_tokens; ++i) {
    ForwardSequence fs{&seq, feed, LogitsMode::kLast};
    absl::StatusOr<ForwardResult> r = engine->model->Forward(*engine->pool, {&fs, 1});
    if (!r.ok()) return r.status();
    const int32_t next = Argmax(r->Last(0));
    out.push_back(next);
    if (std::find(eos.begin(), eos.end(), next) != eos.end()) break;
    feed.assign(1, next);
  }
  std::printf("%s\n", absl::StrJoin(out, ",").c_str());
  seq.Release(*engine->pool);
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
