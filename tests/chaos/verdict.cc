#include "tests/chaos/verdict.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pdserve::chaos {
namespace {

size_t CommonPrefix(absl::Span<const int32_t> a, absl::Span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

bool IsPrefix(absl::Span<const int32_t> prefix, absl::Span<const int32_t> of) {
  return prefix.size() <= of.size() && CommonPrefix(prefix, of) == prefix.size();
}

std::string FirstDifference(absl::Span<const int32_t> got, absl::Span<const int32_t> want) {
  const size_t p = CommonPrefix(got, want);
  return absl::StrCat("first difference at token ", p, ": got ", p < got.size() ? absl::StrCat(got[p]) : "end",
                      ", want ", p < want.size() ? absl::StrCat(want[p]) : "end", " (got ", got.size(),
                      " tokens, want ", want.size(), ")");
}

}  // namespace

int64_t DuplicatedTokens(absl::Span<const int32_t> got, absl::Span<const int32_t> want, std::vector<int32_t>* rest) {
  std::vector<int32_t> g(got.begin(), got.end());
  int64_t duplicated = 0;
  while (true) {
    const size_t p = CommonPrefix(g, want);
    if (p == g.size()) break;
    // Latest start first: the shortest repeat that explains the stream. A
    // window counts only if the stream goes on correctly after it (or ends
    // there), so a token that merely equals an earlier one is not a repeat.
    bool found = false;
    for (size_t j = p; j-- > 0 && !found;) {
      const size_t window = std::min(p - j, g.size() - p);
      if (!std::equal(g.begin() + p, g.begin() + p + window, want.begin() + j)) continue;
      std::vector<int32_t> without = g;
      without.erase(without.begin() + p, without.begin() + p + window);
      if (without.size() == p || CommonPrefix(without, want) > p) {
        g = std::move(without);
        duplicated += window;
        found = true;
      }
    }
    if (!found) break;
  }
  if (g.size() > want.size() && IsPrefix(want, g)) {
    duplicated += g.size() - want.size();
    g.resize(want.size());
  }
  if (rest != nullptr) *rest = std::move(g);
  return duplicated;
}

Verdict Judge(const Observed& got, const Reference& want) {
  Verdict v;
  const v1::FinishReason finish = got.has_final ? got.final.finish_reason() : v1::FINISH_REASON_UNSPECIFIED;
  if (!got.status.ok()) {
    v.lost = true;
    v.detail = absl::StrCat("status ", got.status.error_code(), ": ", got.status.error_message());
  } else if (!got.has_final) {
    v.lost = true;
    v.detail = "the stream ended without a final message";
  } else if (finish != v1::FINISH_REASON_STOP && finish != v1::FINISH_REASON_LENGTH) {
    v.lost = true;
    v.detail = absl::StrCat("finish ", v1::FinishReason_Name(finish), ": ", got.final.error());
  }
  std::vector<int32_t> rest;
  v.duplicated_tokens = DuplicatedTokens(got.tokens, want.tokens, &rest);
  if (v.duplicated_tokens > 0) {
    absl::StrAppend(&v.detail, v.detail.empty() ? "" : "; ", v.duplicated_tokens, " duplicated tokens (got ",
                    got.tokens.size(), ", want ", want.tokens.size(), ")");
  }
  std::string mismatch;
  if (v.lost) {
    if (!IsPrefix(rest, want.tokens)) mismatch = "partial stream: " + FirstDifference(rest, want.tokens);
  } else if (rest != want.tokens) {
    mismatch = FirstDifference(rest, want.tokens);
  } else if (v.duplicated_tokens == 0 && got.text != want.text) {
    mismatch = absl::StrCat("same tokens, different text: got \"", got.text, "\", want \"", want.text, "\"");
  } else if (finish != want.finish) {
    mismatch = absl::StrCat("finish ", v1::FinishReason_Name(finish), ", want ", v1::FinishReason_Name(want.finish));
  }
  if (!mismatch.empty()) {
    v.mismatched = true;
    absl::StrAppend(&v.detail, v.detail.empty() ? "" : "; ", mismatch);
  }
  return v;
}

}  // namespace pdserve::chaos
