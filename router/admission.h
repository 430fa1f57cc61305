// Admission control: whether the router takes a request now, from the
// measured capacity of the three stages (measured.h) and a prediction of
// the request's time to first token.
//
// Decide() applies, in order:
//
//   1. Queue bound. At most max_queued requests hold a ticket (admitted and
//      not yet released; the router releases once prefill has started or
//      the request ended). The bound is hard: no measurement needed.
//   2. Rate. When the arrival rate exceeds the bottleneck capacity by more
//      than rate_margin, only the excess is shed: a token bucket refilled at
//      capacity x (1 + margin), holding rate_burst's worth, admits requests
//      while it has a token. Rejecting every request while the offered load
//      is high would serve nothing; shedding the excess admits the
//      capacity. The bottleneck is the smallest stage among those whose
//      capacity rests on at least min_samples samples (an upper bound on the
//      system rate even when another stage is unknown). Skipped (and said
//      so) while no stage or the arrival rate has enough samples. It comes
//      before the TTFT rule so that, under overload, the rejection names
//      the stage at fault rather than the prefill queue it backs up.
//   3. TTFT. predicted = queued prefill tokens on the chosen worker / its
//      overall tokens/s + the request's uncached tokens / its tokens/s for
//      prefills of that size + expected handoff. (The queue holds prefills
//      of every size; this request's own computation is timed by its size,
//      since a worker's fixed cost per prefill weighs most on short ones.) The handoff is counted because decode cannot continue
//      before the KV has moved (DESIGN.md fact 14). Rejected when above the
//      request's remaining deadline or the configured TTFT target,
//      whichever is sooner. Skipped (and said so) while the worker's
//      tokens/s rests on fewer than min_samples samples.
//
// Rejections are RESOURCE_EXHAUSTED naming the rule and its numbers:
//   "admission queue full: 64 requests queued (max 64)"
//   "predicted TTFT 2.40 s exceeds the deadline 1.00 s (prefill queue 9,000
//    tokens at 4,000 tokens/s + 600 uncached tokens at 4,000 tokens/s,
//    handoff 0.00 s)"
//   "arrival rate 12.0 req/s exceeds the decode stage's capacity 8.1 req/s
//    (admitting up to 8.5 req/s)"
//
// Thread safety: AdmissionController is thread-safe; Decide and the
// ticket's release take one mutex for O(1) work. A ticket may be released
// on any thread. REQUIRES: the controller outlives its tickets.
#ifndef PDSERVE_ROUTER_ADMISSION_H_
#define PDSERVE_ROUTER_ADMISSION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/capacity/stage_model.h"
#include "router/measured.h"

namespace pdserve::router {

struct AdmissionOptions {
  Clock clock = RealClock();
  int64_t max_queued = 256;                   // REQUIRES: >= 1
  std::optional<absl::Duration> ttft_target;  // none: only request deadlines bound TTFT
  double rate_margin = 0.05;                  // REQUIRES: >= 0
  absl::Duration rate_burst = absl::Seconds(1);
  int64_t min_samples = 20;  // per input before rules 2 and 3 apply; REQUIRES: >= 1
};

// Stage capacities and the arrival rate, with the samples each rests on.
struct AdmissionLoad {
  struct Rate {
    std::optional<double> requests_per_s;  // none: no data
    int64_t samples = 0;
  };
  Rate prefill;
  Rate handoff;
  Rate decode;
  Rate arrival;
};

// The load as measured.h computes it.
AdmissionLoad LoadFromCapacity(const MeasuredCapacity& c);

struct AdmissionRequest {
  int64_t queued_prefill_tokens = 0;   // ahead of it on the chosen prefill worker
  int64_t uncached_tokens = 0;         // its prompt tokens the prefix cache lacks
  MeasuredValue prefill_tokens_per_s;  // the chosen worker's for this size (MeasuredInputs::PrefillTokensPerS)
  // The chosen worker's overall tokens/s, for the queue ahead; without data,
  // prefill_tokens_per_s is used for it too.
  MeasuredValue queue_tokens_per_s;
  absl::Duration expected_handoff = absl::ZeroDuration();
  std::optional<absl::Time> deadline;  // the client's
};

struct AdmissionDecision {
  std::optional<absl::Duration> predicted_ttft;  // none when not predictable
  std::optional<absl::Duration> ttft_limit;      // the sooner of deadline and target
  // Rules that were not applied, and why ("rate check skipped: the arrival
  // rate has 5 samples (need 20)").
  std::vector<std::string> skipped;
};

class AdmissionController;

// A queue slot. Move-only; releases on destruction or Release(), once.
class AdmissionTicket {
 public:
  AdmissionTicket(AdmissionTicket&& other) noexcept;
  AdmissionTicket& operator=(AdmissionTicket&& other) noexcept;
  AdmissionTicket(const AdmissionTicket&) = delete;
  AdmissionTicket& operator=(const AdmissionTicket&) = delete;
  ~AdmissionTicket();

  void Release();
  const AdmissionDecision& decision() const { return decision_; }

 private:
  friend class AdmissionController;
  AdmissionTicket(AdmissionController* owner, AdmissionDecision decision)
      : owner_(owner), decision_(std::move(decision)) {}

  AdmissionController* owner_;  // null once released
  AdmissionDecision decision_;
};

struct AdmissionStats {
  int64_t queued = 0;  // tickets held now
  int64_t admitted = 0;
  int64_t rejected_queue = 0;
  int64_t rejected_ttft = 0;
  int64_t rejected_rate = 0;
};

class AdmissionController {
 public:
  explicit AdmissionController(AdmissionOptions options);
  AdmissionController(const AdmissionController&) = delete;
  AdmissionController& operator=(const AdmissionController&) = delete;

  // Replaces the capacities and arrival rate the rate rule uses.
  void UpdateLoad(const AdmissionLoad& load);

  // A ticket, or RESOURCE_EXHAUSTED naming the rule that refused.
  absl::StatusOr<AdmissionTicket> Decide(const AdmissionRequest& request);

  AdmissionStats Stats() const;

 private:
  friend class AdmissionTicket;
  void ReleaseOne();
  // Adds the tokens earned since the last refill at the current load's
  // budget, up to the bucket size.
  void Refill(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The budget rate and bucket size of the trusted bottleneck; none when the
  // rate rule does not apply (notes why in `skipped`).
  struct RateLimit {
    capacity::Stage stage;
    double capacity = 0;
    double arrival = 0;
    double budget = 0;  // capacity x (1 + margin)
  };
  std::optional<RateLimit> Limit(std::vector<std::string>* skipped) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AdmissionOptions options_;
  mutable absl::Mutex mu_;
  AdmissionLoad load_ ABSL_GUARDED_BY(mu_);
  double tokens_ ABSL_GUARDED_BY(mu_);  // the bucket; starts full (infinity: full at any size)
  absl::Time last_refill_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  AdmissionStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_ADMISSION_H_
