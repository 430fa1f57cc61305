// What one request of the chaos run came to, judged against the same
// request's output on an undisturbed cluster: completed, lost, streamed
// tokens twice, or streamed different tokens.
//
// Thread safety: pure functions.
#ifndef PDSERVE_TESTS_CHAOS_VERDICT_H_
#define PDSERVE_TESTS_CHAOS_VERDICT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve::chaos {

// Everything a client saw of one Generate stream.
struct Observed {
  grpc::Status status;
  std::vector<int32_t> tokens;  // Every streamed token id, in order.
  std::string text;             // The streamed text, concatenated.
  bool has_final = false;
  v1::GenerateFinal final;
};

// The undisturbed output of a request.
struct Reference {
  std::vector<int32_t> tokens;
  std::string text;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
};

struct Verdict {
  // The request did not end well: an error status, no final message, or a
  // final message saying ERROR or CANCELLED.
  bool lost = false;
  // Tokens streamed beyond a correct prefix that repeat earlier positions,
  // plus any surplus past the reference's end.
  int64_t duplicated_tokens = 0;
  // Once repeated windows are taken out, the tokens (or, for a lost request,
  // the partial stream) are not the reference's; or, without repeats, the
  // text or the finish reason differs.
  bool mismatched = false;
  std::string detail;  // Why, for a verdict other than completed.

  bool completed() const { return !lost && duplicated_tokens == 0 && !mismatched; }
};

Verdict Judge(const Observed& got, const Reference& want);

// The repeated windows in `got` measured against `want`: repeatedly, where
// `got` leaves `want` at position p but carries on as `want` from an earlier
// position j (the stream went back and sent positions j..p-1 again), p - j
// tokens are counted and that window is taken out. Any surplus left past the
// end of `want` counts too. `*rest` (optional) gets `got` without the
// windows and the surplus.
// Complexity: O(len(got) * len(want)) per window found.
int64_t DuplicatedTokens(absl::Span<const int32_t> got, absl::Span<const int32_t> want,
                         std::vector<int32_t>* rest = nullptr);

}  // namespace pdserve::chaos

#endif  // PDSERVE_TESTS_CHAOS_VERDICT_H_
