// What the router measures about the cluster, and the capacity that follows
// from it (DESIGN.md fact 13: three stages, one unit, requests/s).
//
// MeasuredInputs records what the router observes on its request path:
//
//   prefill, per worker:  (prompt tokens, uncached tokens, prefill seconds)
//                         -> tokens/s, overall and per prompt-length bucket
//   decode, per worker:   (batch, mean history, step seconds)
//                         -> step time per (batch, history) bucket
//   handoff, per link:    (bytes, seconds) -> bytes/s, and KV bytes/request
//   finished requests:    output tokens -> mean output length
//   arrivals:             timestamps -> requests/s over a sliding window
//
// Every input is read back as a MeasuredValue: its value, how many samples
// it rests on and how long ago the last one came; "no data" (no value) when
// never sampled.
//
// Estimators. Means are exponentially weighted with weight
// max(1/n, alpha) on the n-th sample: the first 1/alpha samples give their
// plain mean (the first sample is the value, never a blend with an
// arbitrary prior), later ones forget old behaviour at a fixed rate, so a
// worker that slows down under a new workload shows it within ~2/alpha
// samples. Sample-weighted rather than time-weighted because the inputs
// arrive at the load's own pace, and a quiet period should keep the last
// estimate (its age says how stale it is) rather than decay it to nothing.
// Rates (tokens/s, bytes/s) are ratios of two such means (tokens over
// seconds), not means of per-sample rates: a ratio of means weights each
// sample by the time it took, which is what throughput is, and one short
// sample with a noisy timer cannot swing it. The arrival rate is the count
// of arrivals in a sliding window (default 10 s) over the window length:
// it reacts within one window to a load change and needs no decay constant;
// before one window has passed since the first arrival it is counted over
// the time since then.
//
// Thread safety: MeasuredInputs is thread-safe; every method takes one
// mutex for O(1) amortised work (Snapshot is O(workers + buckets + links)).
// Everything else here is a plain value or a pure function.
#ifndef PDSERVE_ROUTER_MEASURED_H_
#define PDSERVE_ROUTER_MEASURED_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/capacity/stage_model.h"

namespace pdserve::router {

// The time source; tests inject a fake one.
using Clock = std::function<absl::Time()>;
Clock RealClock();

// One measured input as read back.
struct MeasuredValue {
  std::optional<double> value;        // no value: no data
  int64_t samples = 0;                // samples it rests on
  std::optional<absl::Duration> age;  // since the last sample; none when never sampled
  bool has_data() const { return value.has_value(); }
};

// `v` with `precision` decimals and thousands separators: "9,000", "4,000.5".
std::string FormatNumber(double v, int precision);
// "4,000 (37 samples, 0.2 s ago)" or "no data"; `precision` decimals.
std::string FormatMeasuredValue(const MeasuredValue& v, int precision);

struct MeasuredOptions {
  Clock clock = RealClock();
  double alpha = 0.1;  // EWMA weight floor, (0, 1]
  absl::Duration arrival_window = absl::Seconds(10);
};

// Buckets cover [2^k, 2^(k+1) - 1] for k >= 1, and [0, 1].
struct BucketRange {
  int64_t min = 0;
  int64_t max = 0;
};
BucketRange PowerOfTwoBucket(int64_t value);

struct PrefillBucketReading {
  BucketRange uncached_tokens;  // the tokens each prefill computed
  MeasuredValue tokens_per_s;  // uncached tokens / prefill seconds
};
struct PrefillWorkerReading {
  std::string worker;                         // address
  MeasuredValue tokens_per_s;                 // all prompt lengths together
  std::vector<PrefillBucketReading> buckets;  // ascending, sampled buckets only
};

struct DecodeBucketReading {
  BucketRange batch;
  BucketRange history_tokens;
  MeasuredValue step_s;
  double mean_batch = 0;  // of the samples in the bucket
};
struct DecodeWorkerReading {
  std::string worker;
  std::vector<DecodeBucketReading> buckets;  // ascending (history, batch), sampled only
};

struct LinkReading {
  std::string prefill_worker;
  std::string decode_worker;
  MeasuredValue bytes_per_s;
};

// Everything MeasuredInputs knows, at one instant. Workers and links are
// sorted by address.
struct MeasuredSnapshot {
  absl::Time taken;
  std::vector<PrefillWorkerReading> prefill;
  std::vector<DecodeWorkerReading> decode;
  std::vector<LinkReading> links;
  MeasuredValue prompt_tokens;           // mean per prefilled request
  MeasuredValue uncached_prompt_tokens;  // mean per prefilled request
  // Of the cached prompt tokens, mean per prefill on a prefill worker:
  // found in its pool, read back from its second tier.
  MeasuredValue pool_cached_tokens;
  MeasuredValue tier2_cached_tokens;
  MeasuredValue decode_history_tokens;   // mean over decode step samples
  MeasuredValue handoff_bytes;           // mean KV bytes per handoff
  MeasuredValue output_tokens;           // mean per finished request
  MeasuredValue arrival_rate;            // requests/s; samples: arrivals in the window
};

// One line per input, for `pdctl status` and logs.
std::string FormatSnapshot(const MeasuredSnapshot& s);

class MeasuredInputs {
 public:
  // REQUIRES: 0 < options.alpha <= 1, options.arrival_window > 0.
  explicit MeasuredInputs(MeasuredOptions options = {});

  MeasuredInputs(const MeasuredInputs&) = delete;
  MeasuredInputs& operator=(const MeasuredInputs&) = delete;

  // A prefill of `prompt_tokens`, `uncached_tokens` of them computed (the
  // rest hit the prefix cache), that took `seconds` on `worker`. Samples
  // with seconds <= 0 or uncached_tokens <= 0 (a full cache hit measures no
  // throughput) are ignored.
  void RecordPrefill(const std::string& worker, int64_t prompt_tokens, int64_t uncached_tokens, double seconds);
  // One decode step of `batch` rows with `mean_history_tokens` KV positions
  // each. Ignored unless batch >= 1 and seconds > 0.
  void RecordDecodeStep(const std::string& worker, int64_t batch, double mean_history_tokens, double seconds);
  // One KV handoff of `bytes` from `prefill_worker` to `decode_worker`.
  // Ignored unless bytes > 0 and seconds > 0.
  void RecordHandoff(const std::string& prefill_worker, const std::string& decode_worker, double bytes, double seconds);
  // A prefill worker's first token said `pool_tokens` of the context came
  // from its pool's prefix cache and `tier2_tokens` from its second tier.
  void RecordPrefixTiers(int64_t pool_tokens, int64_t tier2_tokens);
  // KV sent from worker `from` to worker `to` other than by a handoff (a
  // prefix pulled between prefill workers, a sequence moved between decode
  // workers): a link like a handoff's (the pull's and the move's cost
  // models read it), not a handoff (the mean handoff size stays the
  // handoffs'). Ignored unless bytes > 0 and seconds > 0.
  void RecordLink(const std::string& from, const std::string& to, double bytes, double seconds);
  // A request finished having generated `output_tokens` (>= 0).
  void RecordFinished(int64_t output_tokens);
  // A request arrived now (rejected ones too: the rate is the offered load).
  void RecordArrival();

  // Drops a worker's readings and its links (it left the pool).
  void ForgetWorker(const std::string& worker);

  MeasuredSnapshot Snapshot() const;

  // The tokens/s of `worker` for prefills that compute `uncached_tokens`:
  // its bucket when that has at least `min_bucket_samples` samples, else
  // the worker's overall figure; no data when the worker has none. Buckets
  // are by the tokens computed, not the prompt length: a 2,000-token prompt
  // with 1,968 tokens cached costs about what a 32-token one does (plus its
  // attention over the cached part), and a worker's fixed cost per prefill
  // weighs on short computations far more than on long ones.
  MeasuredValue PrefillTokensPerS(const std::string& worker, int64_t uncached_tokens,
                                  int64_t min_bucket_samples = 1) const;
  // The KV bytes/s from `from` to `to`: that link's, when it has data,
  // else the mean over every measured link (the same transport carries
  // them all); no data when none is measured.
  MeasuredValue LinkBytesPerS(const std::string& from, const std::string& to) const;
  // The worker's tokens/s over prefills of every size: how fast a queue of
  // mixed prefills drains. No data when it has none.
  MeasuredValue PrefillQueueTokensPerS(const std::string& worker) const;

 private:
  // Weighted mean with weight max(1/n, alpha) on the n-th sample.
  struct Ewma {
    double mean = 0;
    int64_t n = 0;
    void Add(double x, double alpha);
  };
  // A ratio of two Ewma's fed in lockstep (tokens over seconds).
  struct RateEwma {
    Ewma num;
    Ewma den;
    absl::Time last = absl::InfinitePast();
    void Add(double num_sample, double den_sample, double alpha, absl::Time now);
    MeasuredValue Read(absl::Time now) const;
  };
  struct MeanEwma {
    Ewma value;
    absl::Time last = absl::InfinitePast();
    void Add(double x, double alpha, absl::Time now);
    MeasuredValue Read(absl::Time now) const;
  };
  struct PrefillWorker {
    RateEwma all;
    std::map<int, RateEwma> by_bucket;  // key: log2 bucket of the uncached tokens
  };
  struct DecodeBucket {
    MeanEwma step_s;
    Ewma batch;
  };
  struct DecodeWorker {
    std::map<std::pair<int, int>, DecodeBucket> by_bucket;  // key: (history log2, batch log2)
  };

  void PruneArrivals(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  MeasuredValue ArrivalRate(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const MeasuredOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, PrefillWorker> prefill_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, DecodeWorker> decode_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, RateEwma> links_ ABSL_GUARDED_BY(mu_);
  MeanEwma prompt_tokens_ ABSL_GUARDED_BY(mu_);
  MeanEwma uncached_tokens_ ABSL_GUARDED_BY(mu_);
  MeanEwma pool_cached_tokens_ ABSL_GUARDED_BY(mu_);
  MeanEwma tier2_cached_tokens_ ABSL_GUARDED_BY(mu_);
  MeanEwma history_tokens_ ABSL_GUARDED_BY(mu_);
  MeanEwma handoff_bytes_ ABSL_GUARDED_BY(mu_);
  MeanEwma output_tokens_ ABSL_GUARDED_BY(mu_);
  // Arrival times within the window, oldest first (pruned on every access).
  mutable std::deque<absl::Time> arrivals_ ABSL_GUARDED_BY(mu_);
  absl::Time first_arrival_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// What the router knows but cannot measure.
struct PoolFacts {
  int64_t prefill_workers = 0;  // usable workers in each pool now
  int64_t decode_workers = 0;
  // The batch a decode worker runs at full load (its max batch, or the
  // capacity plan's operating batch). REQUIRES: >= 1.
  int64_t decode_batch = 0;
  // KV bytes one request hands off; default: the measured mean per handoff.
  std::optional<double> kv_bytes_per_request;
};

// One stage's capacity in requests/s, or why there is none.
struct StageCapacity {
  std::optional<double> requests_per_s;           // whole pool; none: no data
  std::optional<double> requests_per_s_per_unit;  // one worker (one link for the handoff)
  // The fewest samples among the inputs it rests on (0 with no data).
  int64_t samples = 0;
  // How it was computed ("2 workers x 4,000 tokens/s / 1,000 uncached
  // tokens"), or what is missing ("no data: output length").
  std::string basis;
};

struct MeasuredCapacity {
  StageCapacity prefill;
  StageCapacity handoff;
  StageCapacity decode;
  // The smallest known stage; none when no stage is known. With a stage
  // unknown the minimum of the others is still an upper bound on the
  // system's rate, so `system_requests_per_s` is one too.
  std::optional<capacity::Stage> bottleneck;
  std::optional<double> system_requests_per_s;
  bool complete = false;  // all three stages known
  MeasuredValue arrival_rate;
  // Pool sizes that would serve the arrival rate, each stage on its own
  // (none when that stage's per-unit rate or the arrival rate is unknown).
  // Handoff links run one transfer each: min(prefill, decode) workers must
  // reach handoff_links_needed.
  std::optional<int64_t> prefill_workers_needed;
  std::optional<int64_t> decode_workers_needed;
  std::optional<int64_t> handoff_links_needed;
};

const StageCapacity& CapacityOf(const MeasuredCapacity& c, capacity::Stage stage);

// Each stage's capacity from the measurements:
//   prefill = prefill_workers x mean measured tokens/s / mean uncached tokens
//   handoff = min(prefill_workers, decode_workers) concurrent links
//             x mean measured link bytes/s / KV bytes per request
//   decode  = decode_workers x decode_batch / (t_step x mean output tokens)
// with t_step each measured decode worker's step time at decode_batch and
// the observed mean history: its bucket when sampled, else an affine fit
// t = a + b * batch over its sampled batch buckets at that history (the
// decode step is affine in the batch, DESIGN.md fact 10), else no data.
// Workers without measurements count at the mean of those with.
// REQUIRES: facts.decode_batch >= 1.
MeasuredCapacity ComputeMeasuredCapacity(const MeasuredSnapshot& s, const PoolFacts& facts);

// The pool size `pool` ("prefill" or "decode") needs for the observed
// arrival rate, for an autoscaler: none until that stage's capacity and the
// arrival rate each rest on at least `min_samples` samples (cold-start
// estimates must not drive a scale-out).
std::optional<int64_t> RecommendedWorkers(const MeasuredCapacity& c, capacity::Stage pool, int64_t min_samples);

// "prefill 12.0 req/s (...)" lines plus the bottleneck and pool sizing.
std::string FormatMeasuredCapacity(const MeasuredCapacity& c);

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_MEASURED_H_
