#include "router/admission.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::router {
namespace {

constexpr double kFull = std::numeric_limits<double>::infinity();

AdmissionLoad::Rate RateOf(const StageCapacity& c) { return {c.requests_per_s, c.samples}; }

std::string SamplesText(const AdmissionLoad::Rate& r) {
  if (!r.requests_per_s.has_value()) return "no data";
  return absl::StrCat(r.samples, " samples");
}

double BucketSize(double budget, absl::Duration burst) { return std::max(1.0, budget * absl::ToDoubleSeconds(burst)); }

}  // namespace

AdmissionLoad LoadFromCapacity(const MeasuredCapacity& c) {
  AdmissionLoad load;
  load.prefill = RateOf(c.prefill);
  load.handoff = RateOf(c.handoff);
  load.decode = RateOf(c.decode);
  load.arrival = {c.arrival_rate.value, c.arrival_rate.samples};
  return load;
}

AdmissionTicket::AdmissionTicket(AdmissionTicket&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)), decision_(std::move(other.decision_)) {}

AdmissionTicket& AdmissionTicket::operator=(AdmissionTicket&& other) noexcept {
  if (this != &other) {
    Release();
    owner_ = std::exchange(other.owner_, nullptr);
    decision_ = std::move(other.decision_);
  }
  return *this;
}

AdmissionTicket::~AdmissionTicket() { Release(); }

void AdmissionTicket::Release() {
  if (owner_ != nullptr) std::exchange(owner_, nullptr)->ReleaseOne();
}

AdmissionController::AdmissionController(AdmissionOptions options) : options_(std::move(options)), tokens_(kFull) {}

void AdmissionController::ReleaseOne() {
  absl::MutexLock lock(&mu_);
  --stats_.queued;
}

AdmissionStats AdmissionController::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

std::optional<AdmissionController::RateLimit> AdmissionController::Limit(std::vector<std::string>* skipped) const {
  const int64_t need = options_.min_samples;
  const AdmissionLoad::Rate& arrival = load_.arrival;
  if (!arrival.requests_per_s.has_value() || arrival.samples < need) {
    if (skipped != nullptr) {
      skipped->push_back(
          absl::StrFormat("rate check skipped: the arrival rate has %s (need %d samples)", SamplesText(arrival), need));
    }
    return std::nullopt;
  }
  std::optional<RateLimit> limit;
  const std::pair<capacity::Stage, const AdmissionLoad::Rate*> stages[] = {{capacity::Stage::kPrefill, &load_.prefill},
                                                                           {capacity::Stage::kHandoff, &load_.handoff},
                                                                           {capacity::Stage::kDecode, &load_.decode}};
  for (const auto& [stage, rate] : stages) {
    if (!rate->requests_per_s.has_value() || rate->samples < need) continue;
    if (!limit.has_value() || *rate->requests_per_s < limit->capacity) {
      limit = RateLimit{stage, *rate->requests_per_s, *arrival.requests_per_s, 0};
    }
  }
  if (!limit.has_value()) {
    if (skipped != nullptr) {
      skipped->push_back(absl::StrFormat(
          "rate check skipped: no stage capacity has %d samples yet (prefill %s, handoff %s, decode %s)", need,
          SamplesText(load_.prefill), SamplesText(load_.handoff), SamplesText(load_.decode)));
    }
    return std::nullopt;
  }
  limit->budget = limit->capacity * (1 + options_.rate_margin);
  return limit;
}

void AdmissionController::Refill(absl::Time now) {
  const std::optional<RateLimit> limit = Limit(nullptr);
  if (!limit.has_value()) {
    tokens_ = kFull;
  } else if (tokens_ != kFull && now > last_refill_) {
    tokens_ += limit->budget * absl::ToDoubleSeconds(now - last_refill_);
  }
  if (limit.has_value()) tokens_ = std::min(tokens_, BucketSize(limit->budget, options_.rate_burst));
  last_refill_ = std::max(last_refill_, now);
}

void AdmissionController::UpdateLoad(const AdmissionLoad& load) {
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  Refill(now);  // What the old budget earned belongs to the old budget.
  load_ = load;
  Refill(now);  // Caps the bucket at the new size.
}

absl::StatusOr<AdmissionTicket> AdmissionController::Decide(const AdmissionRequest& request) {
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);

  if (stats_.queued >= options_.max_queued) {
    ++stats_.rejected_queue;
    return absl::ResourceExhaustedError(absl::StrFormat("admission queue full: %s requests queued (max %s)",
                                                        FormatNumber(static_cast<double>(stats_.queued), 0),
                                                        FormatNumber(static_cast<double>(options_.max_queued), 0)));
  }

  AdmissionDecision decision;
  const std::optional<RateLimit> limit = Limit(&decision.skipped);
  Refill(now);
  if (limit.has_value() && limit->arrival > limit->budget) {
    if (tokens_ < 1) {
      ++stats_.rejected_rate;
      return absl::ResourceExhaustedError(
          absl::StrFormat("arrival rate %s req/s exceeds the %s stage's capacity %s req/s (admitting up to %s req/s)",
                          FormatNumber(limit->arrival, 1), capacity::StageName(limit->stage),
                          FormatNumber(limit->capacity, 1), FormatNumber(limit->budget, 1)));
    }
    // Spent even if the TTFT rule refuses below: the bucket meters what
    // passes this rule, so the excess over the budget is shed here and the
    // TTFT rule sheds only what the queue cannot take in time.
    tokens_ -= 1;
  }

  std::optional<absl::Duration> deadline_left;
  if (request.deadline.has_value()) deadline_left = *request.deadline - now;
  const bool deadline_sooner =
      deadline_left.has_value() && (!options_.ttft_target.has_value() || *deadline_left < *options_.ttft_target);
  decision.ttft_limit = deadline_sooner ? deadline_left : options_.ttft_target;
  if (decision.ttft_limit.has_value()) {
    const MeasuredValue& tps = request.prefill_tokens_per_s;
    if (!tps.has_data() || !(*tps.value > 0) || tps.samples < options_.min_samples) {
      decision.skipped.push_back(
          absl::StrFormat("TTFT check skipped: the prefill worker's tokens/s has %s (need %d samples)",
                          tps.has_data() ? absl::StrCat(tps.samples, " samples") : "no data", options_.min_samples));
    } else {
      const MeasuredValue& qtps =
          request.queue_tokens_per_s.has_data() && *request.queue_tokens_per_s.value > 0 ? request.queue_tokens_per_s
                                                                                           : tps;
      decision.predicted_ttft = absl::Seconds(static_cast<double>(request.queued_prefill_tokens) / *qtps.value +
                                              static_cast<double>(request.uncached_tokens) / *tps.value) +
                                request.expected_handoff;
      if (*decision.predicted_ttft > *decision.ttft_limit) {
        ++stats_.rejected_ttft;
        return absl::ResourceExhaustedError(absl::StrFormat(
            "predicted TTFT %.2f s exceeds the %s %.2f s (prefill queue %s tokens at %s tokens/s + %s uncached "
            "tokens at %s tokens/s, handoff %.2f s)",
            absl::ToDoubleSeconds(*decision.predicted_ttft), deadline_sooner ? "deadline" : "TTFT target",
            absl::ToDoubleSeconds(*decision.ttft_limit),
            FormatNumber(static_cast<double>(request.queued_prefill_tokens), 0), FormatNumber(*qtps.value, 0),
            FormatNumber(static_cast<double>(request.uncached_tokens), 0), FormatNumber(*tps.value, 0),
            absl::ToDoubleSeconds(request.expected_handoff)));
      }
    }
  }

  ++stats_.queued;
  ++stats_.admitted;
  return AdmissionTicket(this, std::move(decision));
}

}  // namespace pdserve::router
