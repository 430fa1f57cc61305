#include "router/measured.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace pdserve::router {
namespace {

// floor(log2(value)), 0 for values below 2.
int Log2Bucket(int64_t value) {
  if (value < 2) return 0;
  return static_cast<int>(std::bit_width(static_cast<uint64_t>(value))) - 1;
}

BucketRange RangeOf(int bucket) {
  if (bucket == 0) return {0, 1};
  return {int64_t{1} << bucket, (int64_t{1} << (bucket + 1)) - 1};
}

// Rounds up, but not past an exact quotient that floating point put a hair
// above an integer (as capacity/stage_model.cc does).
int64_t CeilCount(double x) { return static_cast<int64_t>(std::ceil(x * (1 - 1e-9))); }

MeasuredValue Reading(std::optional<double> value, int64_t samples, absl::Time last, absl::Time now) {
  MeasuredValue v;
  v.samples = samples;
  if (samples > 0) {
    v.value = value;
    v.age = std::max(now - last, absl::ZeroDuration());
  }
  return v;
}

std::string RangeText(const BucketRange& r) { return absl::StrCat(r.min, "-", r.max); }

// The mean of the known values and the sum of their samples.
struct Pooled {
  double mean = 0;
  int64_t count = 0;    // readings with data
  int64_t samples = 0;  // their samples together
};
Pooled PoolReadings(const std::vector<const MeasuredValue*>& readings) {
  Pooled p;
  double sum = 0;
  for (const MeasuredValue* r : readings) {
    if (!r->has_data()) continue;
    sum += *r->value;
    ++p.count;
    p.samples += r->samples;
  }
  if (p.count > 0) p.mean = sum / static_cast<double>(p.count);
  return p;
}

StageCapacity NoData(const std::vector<std::string>& missing) {
  StageCapacity c;
  c.basis = absl::StrCat("no data: ", absl::StrJoin(missing, ", "));
  return c;
}

// One decode worker's step time at `batch`, among its buckets at the
// history bucket `history_bucket`; none when it cannot be told.
struct StepEstimate {
  double step_s = 0;
  int64_t samples = 0;
  bool fitted = false;
};
std::optional<StepEstimate> DecodeStepAt(const DecodeWorkerReading& w, int history_bucket, int64_t batch) {
  const BucketRange history = RangeOf(history_bucket);
  const BucketRange batch_range = PowerOfTwoBucket(batch);
  std::vector<const DecodeBucketReading*> points;
  const DecodeBucketReading* exact = nullptr;
  for (const DecodeBucketReading& b : w.buckets) {
    if (b.history_tokens.min != history.min || !b.step_s.has_data()) continue;
    points.push_back(&b);
    if (b.batch.min == batch_range.min) exact = &b;
  }
  StepEstimate e;
  for (const DecodeBucketReading* p : points) e.samples += p->step_s.samples;
  if (points.size() < 2) {
    if (exact == nullptr) return std::nullopt;
    e.step_s = *exact->step_s.value;
    return e;
  }
  // Least squares t = a + b * batch over the buckets' (mean batch, step).
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double n = static_cast<double>(points.size());
  for (const DecodeBucketReading* p : points) {
    const double x = p->mean_batch, y = *p->step_s.value;
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double var = sxx - sx * sx / n;
  // Noise can make the slope negative; a step never gets cheaper with more
  // rows, so fall back to the flat mean.
  const double slope = var > 0 ? std::max(0.0, (sxy - sx * sy / n) / var) : 0.0;
  const double intercept = (sy - slope * sx) / n;
  e.step_s = intercept + slope * static_cast<double>(batch);
  e.fitted = exact == nullptr;
  if (e.step_s <= 0) return std::nullopt;
  return e;
}

}  // namespace

Clock RealClock() {
  return [] { return absl::Now(); };
}

std::string FormatNumber(double v, int precision) {
  std::string digits = absl::StrFormat("%.*f", precision, std::abs(v));
  const size_t point = digits.find('.');
  const size_t int_end = point == std::string::npos ? digits.size() : point;
  std::string out;
  for (size_t i = 0; i < int_end; ++i) {
    if (i > 0 && (int_end - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  out.append(digits, int_end, std::string::npos);
  // No "-0" for a value that rounds to zero.
  if (v < 0 && out.find_first_not_of("0.,") != std::string::npos) out.insert(out.begin(), '-');
  return out;
}

std::string FormatMeasuredValue(const MeasuredValue& v, int precision) {
  if (!v.has_data()) return "no data";
  return absl::StrFormat("%s (%d samples, %.1f s ago)", FormatNumber(*v.value, precision), v.samples,
                         absl::ToDoubleSeconds(v.age.value_or(absl::ZeroDuration())));
}

BucketRange PowerOfTwoBucket(int64_t value) { return RangeOf(Log2Bucket(value)); }

void MeasuredInputs::Ewma::Add(double x, double alpha) {
  ++n;
  const double w = std::max(1.0 / static_cast<double>(n), alpha);
  mean += w * (x - mean);
}

void MeasuredInputs::RateEwma::Add(double num_sample, double den_sample, double alpha, absl::Time now) {
  num.Add(num_sample, alpha);
  den.Add(den_sample, alpha);
  last = now;
}

MeasuredValue MeasuredInputs::RateEwma::Read(absl::Time now) const {
  return Reading(den.mean > 0 ? std::optional<double>(num.mean / den.mean) : std::nullopt, num.n, last, now);
}

void MeasuredInputs::MeanEwma::Add(double x, double alpha, absl::Time now) {
  value.Add(x, alpha);
  last = now;
}

MeasuredValue MeasuredInputs::MeanEwma::Read(absl::Time now) const { return Reading(value.mean, value.n, last, now); }

MeasuredInputs::MeasuredInputs(MeasuredOptions options) : options_(std::move(options)) {}

void MeasuredInputs::RecordPrefill(const std::string& worker, int64_t prompt_tokens, int64_t uncached_tokens,
                                   double seconds) {
  if (!(seconds > 0) || uncached_tokens <= 0) return;
  const absl::Time now = options_.clock();
  const double a = options_.alpha;
  absl::MutexLock lock(&mu_);
  PrefillWorker& w = prefill_[worker];
  w.all.Add(static_cast<double>(uncached_tokens), seconds, a, now);
  w.by_bucket[Log2Bucket(uncached_tokens)].Add(static_cast<double>(uncached_tokens), seconds, a, now);
  prompt_tokens_.Add(static_cast<double>(prompt_tokens), a, now);
  uncached_tokens_.Add(static_cast<double>(uncached_tokens), a, now);
}

void MeasuredInputs::RecordDecodeStep(const std::string& worker, int64_t batch, double mean_history_tokens,
                                      double seconds) {
  if (batch < 1 || !(seconds > 0) || !(mean_history_tokens >= 0)) return;
  const absl::Time now = options_.clock();
  const double a = options_.alpha;
  const int history_bucket = Log2Bucket(static_cast<int64_t>(std::llround(mean_history_tokens)));
  absl::MutexLock lock(&mu_);
  DecodeBucket& b = decode_[worker].by_bucket[{history_bucket, Log2Bucket(batch)}];
  b.step_s.Add(seconds, a, now);
  b.batch.Add(static_cast<double>(batch), a);
  history_tokens_.Add(mean_history_tokens, a, now);
}

void MeasuredInputs::RecordHandoff(const std::string& prefill_worker, const std::string& decode_worker, double bytes,
                                   double seconds) {
  if (!(bytes > 0) || !(seconds > 0)) return;
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  links_[{prefill_worker, decode_worker}].Add(bytes, seconds, options_.alpha, now);
  handoff_bytes_.Add(bytes, options_.alpha, now);
}

void MeasuredInputs::RecordPrefixTiers(int64_t pool_tokens, int64_t tier2_tokens) {
  if (pool_tokens < 0 || tier2_tokens < 0) return;
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  pool_cached_tokens_.Add(static_cast<double>(pool_tokens), options_.alpha, now);
  tier2_cached_tokens_.Add(static_cast<double>(tier2_tokens), options_.alpha, now);
}

void MeasuredInputs::RecordLink(const std::string& from, const std::string& to, double bytes, double seconds) {
  if (!(bytes > 0) || !(seconds > 0)) return;
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  links_[{from, to}].Add(bytes, seconds, options_.alpha, now);
}

MeasuredValue MeasuredInputs::LinkBytesPerS(const std::string& from, const std::string& to) const {
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  if (auto it = links_.find({from, to}); it != links_.end()) {
    if (MeasuredValue v = it->second.Read(now); v.has_data()) return v;
  }
  MeasuredValue mean;
  double sum = 0;
  int64_t n = 0;
  for (const auto& [key, rate] : links_) {
    const MeasuredValue v = rate.Read(now);
    if (!v.has_data()) continue;
    sum += *v.value;
    mean.samples += v.samples;
    if (v.age.has_value() && (!mean.age.has_value() || *v.age < *mean.age)) mean.age = v.age;
    ++n;
  }
  if (n > 0) mean.value = sum / static_cast<double>(n);
  return mean;
}

void MeasuredInputs::RecordFinished(int64_t output_tokens) {
  if (output_tokens < 0) return;
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  output_tokens_.Add(static_cast<double>(output_tokens), options_.alpha, now);
}

void MeasuredInputs::RecordArrival() {
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  if (first_arrival_ == absl::InfinitePast()) first_arrival_ = now;
  // A clock that steps back must not break the ordering the pruning needs.
  arrivals_.push_back(arrivals_.empty() ? now : std::max(now, arrivals_.back()));
  PruneArrivals(now);
}

void MeasuredInputs::PruneArrivals(absl::Time now) const {
  const absl::Time cutoff = now - options_.arrival_window;
  // Keep the newest arrival so the age can still be told.
  while (arrivals_.size() > 1 && arrivals_.front() <= cutoff) arrivals_.pop_front();
}

MeasuredValue MeasuredInputs::ArrivalRate(absl::Time now) const {
  PruneArrivals(now);
  MeasuredValue v;
  if (arrivals_.empty()) return v;
  const absl::Time cutoff = now - options_.arrival_window;
  const int64_t in_window = static_cast<int64_t>(arrivals_.size()) - (arrivals_.front() <= cutoff ? 1 : 0);
  v.samples = in_window;
  v.age = std::max(now - arrivals_.back(), absl::ZeroDuration());
  const absl::Duration since_first = now - first_arrival_;
  const double window_s = absl::ToDoubleSeconds(options_.arrival_window);
  if (since_first > absl::ZeroDuration() && since_first < options_.arrival_window) {
    // The first arrival opened the interval; the others fell inside it.
    v.value = static_cast<double>(in_window - 1) / absl::ToDoubleSeconds(since_first);
  } else {
    // A full window, or every arrival so far at one instant (counted over
    // the window rather than divided by zero).
    v.value = static_cast<double>(in_window) / window_s;
  }
  return v;
}

void MeasuredInputs::ForgetWorker(const std::string& worker) {
  absl::MutexLock lock(&mu_);
  prefill_.erase(worker);
  decode_.erase(worker);
  for (auto it = links_.begin(); it != links_.end();) {
    if (it->first.first == worker || it->first.second == worker) {
      it = links_.erase(it);
    } else {
      ++it;
    }
  }
}

MeasuredSnapshot MeasuredInputs::Snapshot() const {
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  MeasuredSnapshot s;
  s.taken = now;
  for (const auto& [address, w] : prefill_) {
    PrefillWorkerReading r{address, w.all.Read(now), {}};
    for (const auto& [bucket, rate] : w.by_bucket) r.buckets.push_back({RangeOf(bucket), rate.Read(now)});
    s.prefill.push_back(std::move(r));
  }
  for (const auto& [address, w] : decode_) {
    DecodeWorkerReading r{address, {}};
    for (const auto& [key, b] : w.by_bucket) {
      r.buckets.push_back({RangeOf(key.second), RangeOf(key.first), b.step_s.Read(now), b.batch.mean});
    }
    s.decode.push_back(std::move(r));
  }
  for (const auto& [key, rate] : links_) s.links.push_back({key.first, key.second, rate.Read(now)});
  s.prompt_tokens = prompt_tokens_.Read(now);
  s.uncached_prompt_tokens = uncached_tokens_.Read(now);
  s.pool_cached_tokens = pool_cached_tokens_.Read(now);
  s.tier2_cached_tokens = tier2_cached_tokens_.Read(now);
  s.decode_history_tokens = history_tokens_.Read(now);
  s.handoff_bytes = handoff_bytes_.Read(now);
  s.output_tokens = output_tokens_.Read(now);
  s.arrival_rate = ArrivalRate(now);
  return s;
}

MeasuredValue MeasuredInputs::PrefillTokensPerS(const std::string& worker, int64_t uncached_tokens,
                                                int64_t min_bucket_samples) const {
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  auto w = prefill_.find(worker);
  if (w == prefill_.end()) return {};
  auto b = w->second.by_bucket.find(Log2Bucket(uncached_tokens));
  if (b != w->second.by_bucket.end() && b->second.num.n >= min_bucket_samples) return b->second.Read(now);
  return w->second.all.Read(now);
}

MeasuredValue MeasuredInputs::PrefillQueueTokensPerS(const std::string& worker) const {
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  auto w = prefill_.find(worker);
  if (w == prefill_.end()) return {};
  return w->second.all.Read(now);
}

std::string FormatSnapshot(const MeasuredSnapshot& s) {
  std::string out;
  for (const PrefillWorkerReading& w : s.prefill) {
    absl::StrAppend(&out, "prefill ", w.worker, " tokens/s: ", FormatMeasuredValue(w.tokens_per_s, 0), "\n");
    for (const PrefillBucketReading& b : w.buckets) {
      absl::StrAppend(&out, "  uncached ", RangeText(b.uncached_tokens),
                      " tokens: ", FormatMeasuredValue(b.tokens_per_s, 0), "\n");
    }
  }
  for (const DecodeWorkerReading& w : s.decode) {
    absl::StrAppend(&out, "decode ", w.worker, " step time:\n");
    for (const DecodeBucketReading& b : w.buckets) {
      absl::StrAppend(&out, "  batch ", RangeText(b.batch), ", history ", RangeText(b.history_tokens),
                      " tokens: ", FormatMeasuredValue(b.step_s, 4), " s\n");
    }
  }
  for (const LinkReading& l : s.links) {
    absl::StrAppend(&out, "handoff ", l.prefill_worker, " -> ", l.decode_worker,
                    " bytes/s: ", FormatMeasuredValue(l.bytes_per_s, 0), "\n");
  }
  absl::StrAppend(&out, "prompt tokens: ", FormatMeasuredValue(s.prompt_tokens, 1), "\n");
  absl::StrAppend(&out, "uncached prompt tokens: ", FormatMeasuredValue(s.uncached_prompt_tokens, 1), "\n");
  if (s.tier2_cached_tokens.has_data() && s.prompt_tokens.has_data() && *s.prompt_tokens.value > 0) {
    // The prefix cache by tier, as shares of the prompt.
    absl::StrAppend(&out, "prefix cache by tier: ",
                    absl::StrFormat("%.1f%% of prompt tokens from the pools, %.1f%% read back from second tiers",
                                    100 * *s.pool_cached_tokens.value / *s.prompt_tokens.value,
                                    100 * *s.tier2_cached_tokens.value / *s.prompt_tokens.value),
                    " (", s.tier2_cached_tokens.samples, " samples)\n");
  }
  absl::StrAppend(&out, "decode history tokens: ", FormatMeasuredValue(s.decode_history_tokens, 1), "\n");
  absl::StrAppend(&out, "handoff bytes: ", FormatMeasuredValue(s.handoff_bytes, 0), "\n");
  absl::StrAppend(&out, "output tokens: ", FormatMeasuredValue(s.output_tokens, 1), "\n");
  absl::StrAppend(&out, "arrival rate req/s: ", FormatMeasuredValue(s.arrival_rate, 2), "\n");
  return out;
}

const StageCapacity& CapacityOf(const MeasuredCapacity& c, capacity::Stage stage) {
  switch (stage) {
    case capacity::Stage::kPrefill:
      return c.prefill;
    case capacity::Stage::kHandoff:
      return c.handoff;
    case capacity::Stage::kDecode:
      return c.decode;
  }
  return c.prefill;
}

namespace {

StageCapacity PrefillCapacity(const MeasuredSnapshot& s, const PoolFacts& facts) {
  std::vector<const MeasuredValue*> readings;
  for (const PrefillWorkerReading& w : s.prefill) readings.push_back(&w.tokens_per_s);
  const Pooled tps = PoolReadings(readings);
  std::vector<std::string> missing;
  if (tps.count == 0) missing.push_back("prefill tokens/s");
  if (!s.uncached_prompt_tokens.has_data()) missing.push_back("uncached prompt tokens");
  if (!missing.empty()) return NoData(missing);
  const double per_worker = tps.mean / *s.uncached_prompt_tokens.value;
  StageCapacity c;
  c.requests_per_s_per_unit = per_worker;
  c.requests_per_s = static_cast<double>(facts.prefill_workers) * per_worker;
  c.samples = std::min(tps.samples, s.uncached_prompt_tokens.samples);
  c.basis = absl::StrFormat("%d workers x %s tokens/s (%d measured) / %s uncached tokens", facts.prefill_workers,
                            FormatNumber(tps.mean, 0), tps.count, FormatNumber(*s.uncached_prompt_tokens.value, 0));
  return c;
}

StageCapacity HandoffCapacity(const MeasuredSnapshot& s, const PoolFacts& facts) {
  std::vector<const MeasuredValue*> readings;
  for (const LinkReading& l : s.links) readings.push_back(&l.bytes_per_s);
  const Pooled bw = PoolReadings(readings);
  std::vector<std::string> missing;
  if (bw.count == 0) missing.push_back("handoff bytes/s");
  if (!facts.kv_bytes_per_request.has_value() && !s.handoff_bytes.has_data()) missing.push_back("KV bytes per request");
  if (!missing.empty()) return NoData(missing);
  const double kv_bytes = facts.kv_bytes_per_request.value_or(s.handoff_bytes.value.value_or(0));
  const int64_t links = std::min(facts.prefill_workers, facts.decode_workers);
  StageCapacity c;
  c.requests_per_s_per_unit = bw.mean / kv_bytes;
  c.requests_per_s = static_cast<double>(links) * *c.requests_per_s_per_unit;
  c.samples = facts.kv_bytes_per_request.has_value() ? bw.samples : std::min(bw.samples, s.handoff_bytes.samples);
  c.basis = absl::StrFormat("%d concurrent links x %s bytes/s (%d measured) / %s KV bytes per request%s", links,
                            FormatNumber(bw.mean, 0), bw.count, FormatNumber(kv_bytes, 0),
                            facts.kv_bytes_per_request.has_value() ? " (given)" : "");
  return c;
}

StageCapacity DecodeCapacity(const MeasuredSnapshot& s, const PoolFacts& facts) {
  std::vector<std::string> missing;
  if (!s.decode_history_tokens.has_data()) missing.push_back("decode history tokens");
  if (!s.output_tokens.has_data()) missing.push_back("output length");
  if (s.output_tokens.has_data() && !(*s.output_tokens.value > 0)) missing.push_back("a nonzero output length");
  if (!missing.empty()) return NoData(missing);
  const int history_bucket = Log2Bucket(static_cast<int64_t>(std::llround(*s.decode_history_tokens.value)));
  double step_sum = 0;
  int64_t measured = 0, step_samples = 0;
  bool fitted = false;
  for (const DecodeWorkerReading& w : s.decode) {
    const std::optional<StepEstimate> e = DecodeStepAt(w, history_bucket, facts.decode_batch);
    if (!e.has_value()) continue;
    step_sum += e->step_s;
    step_samples += e->samples;
    fitted = fitted || e->fitted;
    ++measured;
  }
  if (measured == 0) {
    return NoData({absl::StrFormat("decode step time at batch %d, history %s tokens", facts.decode_batch,
                                   RangeText(RangeOf(history_bucket)))});
  }
  const double step_s = step_sum / static_cast<double>(measured);
  const double out = *s.output_tokens.value;
  StageCapacity c;
  c.requests_per_s_per_unit = static_cast<double>(facts.decode_batch) / (step_s * out);
  c.requests_per_s = static_cast<double>(facts.decode_workers) * *c.requests_per_s_per_unit;
  c.samples = std::min({step_samples, s.output_tokens.samples, s.decode_history_tokens.samples});
  c.basis =
      absl::StrFormat("%d workers x batch %d / (%.4f s step%s, %d measured x %s output tokens)", facts.decode_workers,
                      facts.decode_batch, step_s, fitted ? " fitted" : "", measured, FormatNumber(out, 1));
  return c;
}

std::optional<int64_t> Needed(const std::optional<double>& per_unit, const MeasuredValue& arrival) {
  if (!per_unit.has_value() || !(*per_unit > 0) || !arrival.has_data()) return std::nullopt;
  return CeilCount(*arrival.value / *per_unit);
}

}  // namespace

MeasuredCapacity ComputeMeasuredCapacity(const MeasuredSnapshot& s, const PoolFacts& facts) {
  MeasuredCapacity c;
  c.prefill = PrefillCapacity(s, facts);
  c.handoff = HandoffCapacity(s, facts);
  c.decode = DecodeCapacity(s, facts);
  constexpr double kUnknown = std::numeric_limits<double>::infinity();
  const capacity::StageRates rates =
      capacity::CombineStages(c.prefill.requests_per_s.value_or(kUnknown), c.handoff.requests_per_s.value_or(kUnknown),
                              c.decode.requests_per_s.value_or(kUnknown));
  if (std::isfinite(rates.system)) {
    c.bottleneck = rates.bottleneck;
    c.system_requests_per_s = rates.system;
  }
  c.complete = c.prefill.requests_per_s && c.handoff.requests_per_s && c.decode.requests_per_s;
  c.arrival_rate = s.arrival_rate;
  c.prefill_workers_needed = Needed(c.prefill.requests_per_s_per_unit, s.arrival_rate);
  c.decode_workers_needed = Needed(c.decode.requests_per_s_per_unit, s.arrival_rate);
  c.handoff_links_needed = Needed(c.handoff.requests_per_s_per_unit, s.arrival_rate);
  return c;
}

std::string FormatMeasuredCapacity(const MeasuredCapacity& c) {
  std::string out;
  for (capacity::Stage stage : {capacity::Stage::kPrefill, capacity::Stage::kHandoff, capacity::Stage::kDecode}) {
    const StageCapacity& sc = CapacityOf(c, stage);
    absl::StrAppend(&out, capacity::StageName(stage), ": ");
    if (sc.requests_per_s.has_value()) {
      absl::StrAppend(&out, FormatNumber(*sc.requests_per_s, 2), " req/s (", sc.samples, " samples; ", sc.basis, ")\n");
    } else {
      absl::StrAppend(&out, sc.basis, "\n");
    }
  }
  if (c.bottleneck.has_value()) {
    absl::StrAppend(&out, "bottleneck: ", capacity::StageName(*c.bottleneck), " at ",
                    FormatNumber(*c.system_requests_per_s, 2), " req/s",
                    c.complete ? "" : " (an upper bound: some stages have no data)", "\n");
  } else {
    absl::StrAppend(&out, "bottleneck: no data\n");
  }
  absl::StrAppend(&out, "arrival rate: ", FormatMeasuredValue(c.arrival_rate, 2), " req/s\n");
  auto needed = [](const std::optional<int64_t>& n) { return n.has_value() ? absl::StrCat(*n) : "no data"; };
  absl::StrAppend(&out, "to serve the arrival rate: ", needed(c.prefill_workers_needed), " prefill workers, ",
                  needed(c.decode_workers_needed), " decode workers, ", needed(c.handoff_links_needed),
                  " concurrent handoff links\n");
  return out;
}

std::optional<int64_t> RecommendedWorkers(const MeasuredCapacity& c, capacity::Stage pool, int64_t min_samples) {
  const std::optional<int64_t>& n =
      pool == capacity::Stage::kPrefill ? c.prefill_workers_needed : c.decode_workers_needed;
  if (!n.has_value() || CapacityOf(c, pool).samples < min_samples || c.arrival_rate.samples < min_samples) {
    return std::nullopt;
  }
  return n;
}

}  // namespace pdserve::router
