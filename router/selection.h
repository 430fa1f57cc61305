// How the router chooses a worker of a pool for a request: one interface,
// so policies can be swapped by flag and new ones added without touching
// the request path. The router filters first (serving, not excluded for
// this request, with KV room where that applies) and hands the selector
// what is left, in pool order, with every term a policy may weigh.
//
// Thread safety: Select may be called from many request threads at once.
#ifndef PDSERVE_ROUTER_SELECTION_H_
#define PDSERVE_ROUTER_SELECTION_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace pdserve::router {

struct SelectionCandidate {
  absl::string_view address;
  // Prefill: prompt tokens queued on the worker (uncached ones, as sent);
  // decode: requests in flight.
  int64_t load = 0;
  // This request's context positions the worker holds in its prefix cache
  // (from the router's index), and those it would have to compute.
  int64_t cached_tokens = 0;
  int64_t uncached_tokens = 0;
  // Prefill: the worker's measured tokens/s for prefills the size of this
  // one's uncached part, and over prefills of every size (how fast its queue
  // drains); 0: not measured yet.
  double tokens_per_s = 0;
  double queue_tokens_per_s = 0;
  // Decode: room for one more sequence in its batch under the ITL target.
  bool headroom = true;
};

enum class Pool { kPrefill, kDecode };

// Prefill's estimated time to first token on a candidate: queued tokens /
// queue_tokens_per_s + this request's uncached tokens / tokens_per_s, with
// `fallback_tokens_per_s` for a speed not measured yet.
double EstimatedPrefillSeconds(const SelectionCandidate& c, double fallback_tokens_per_s);
// The mean measured speed among `candidates` (1 when none is measured, so
// costs compare as token counts).
double FallbackTokensPerS(absl::Span<const SelectionCandidate> candidates);

class Selector {
 public:
  virtual ~Selector() = default;
  virtual absl::string_view name() const = 0;
  // An index into `candidates`. REQUIRES: !candidates.empty().
  virtual size_t Select(absl::Span<const SelectionCandidate> candidates) = 0;
};

// The smallest load; ties go to the first in pool order.
class LeastLoadedSelector final : public Selector {
 public:
  absl::string_view name() const override { return "least_loaded"; }
  size_t Select(absl::Span<const SelectionCandidate> candidates) override;
};

// Each request to the next candidate in turn, whatever the loads.
class RoundRobinSelector final : public Selector {
 public:
  absl::string_view name() const override { return "round_robin"; }
  size_t Select(absl::Span<const SelectionCandidate> candidates) override;

 private:
  std::atomic<uint64_t> next_{0};
};

// Prefix-aware.
//   Prefill: the lowest EstimatedPrefillSeconds (queued work plus the part
//     of this prompt the worker has not cached, at its measured speed);
//     ties go to the most cached, then pool order.
//   Decode: among workers with batch headroom (all, if none has any), those
//     within kDecodeAffinitySlack sequences of the least loaded; of them the
//     one holding the most of the context (those positions are not handed
//     off again), then the fewest in flight. The slack bounds how unevenly a
//     popular prefix may load the pool: a sequence more in a batch slows
//     every step of that worker, a cached prefix saves one transfer.
class PrefixAwareSelector final : public Selector {
 public:
  static constexpr int64_t kDecodeAffinitySlack = 2;

  explicit PrefixAwareSelector(Pool pool) : pool_(pool) {}
  absl::string_view name() const override { return "prefix_aware"; }
  size_t Select(absl::Span<const SelectionCandidate> candidates) override;

 private:
  Pool pool_;
};

// "prefix_aware", "least_loaded" or "round_robin"; INVALID_ARGUMENT naming
// the choices otherwise.
absl::StatusOr<std::unique_ptr<Selector>> MakeSelector(absl::string_view policy, Pool pool = Pool::kPrefill);

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_SELECTION_H_
