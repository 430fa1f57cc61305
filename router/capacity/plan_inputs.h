// The inputs of the capacity model: one model served by a prefill pool, a
// KV handoff link and a decode pool on one kind of chip, under one workload.
//
// Units are SI base units throughout: bytes, seconds, FLOP/s, bytes/s. Field
// comments name the config key each field is read from (plan_config.h); the
// same dotted names appear in every error message.
//
// Plain values; Validate() is the single place that decides what is a usable
// set of inputs. Everything in decode_model.h and stage_model.h REQUIRES
// inputs that passed Validate().
#ifndef PDSERVE_ROUTER_CAPACITY_PLAN_INPUTS_H_
#define PDSERVE_ROUTER_CAPACITY_PLAN_INPUTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdserve::capacity {

// How a decode group of several chips places the KV of its batch.
enum class KvLayout {
  // Each chip holds its share of the KV heads of every request. With more
  // chips than KV heads the heads are replicated: each chip holds
  // 1 / min(chips, kv_heads) of a request's KV.
  kHeadSharded,
  // Each chip holds all KV heads of its own requests; the batch is spread
  // evenly (a multiple of the chip count). New queries and attention outputs
  // move between the head-parallel projections and this layout every step.
  kRequestSharded,
};

// "head-sharded" / "request-sharded", as written in configs.
absl::string_view KvLayoutName(KvLayout layout);
absl::StatusOr<KvLayout> ParseKvLayout(absl::string_view name);

struct ModelShape {                 // model.*
  std::string name;                 // name (free text, optional)
  int64_t layers = 0;               // layers
  int64_t hidden = 0;               // hidden
  int64_t q_heads = 0;              // q_heads
  int64_t kv_heads = 0;             // kv_heads
  int64_t head_dim = 0;             // head_dim
  double params = 0;                // params: parameters of the dense projections + embeddings
  double bytes_per_weight = 0;      // bytes_per_weight (0.5 for int4 storage)
  double bytes_per_kv_element = 0;  // bytes_per_kv_element
};

struct ChipSpec {                        // chip.*
  std::string name;                      // name (free text, optional)
  double memory_bytes = 0;               // memory_bytes
  double reserved_bytes = 0;             // reserved_bytes: activations, runtime, fragmentation
  double bandwidth_bytes_per_s = 0;      // bandwidth_bytes_per_s
  double peak_flops = 0;                 // peak_flops: dense FLOP/s at the weight format
  std::optional<double> price_per_hour;  // price_per_hour (any currency)
};

struct DecodePoolSpec {                         // decode.*
  int64_t groups = 0;                           // groups: model replicas
  int64_t chips_per_group = 0;                  // chips_per_group
  KvLayout kv_layout = KvLayout::kHeadSharded;  // kv_layout
  // exchange_s_per_step: moving new Q and attention outputs between layouts.
  // Required for request-sharded, refused for head-sharded.
  std::optional<double> exchange_s_per_step;
  // allreduce_s_per_step: tensor-parallel all-reduce; not counted unless given.
  std::optional<double> allreduce_s_per_step;
};

struct PrefillPoolSpec {                      // prefill.*
  int64_t groups = 0;                         // groups
  int64_t chips_per_group = 0;                // chips_per_group
  double utilization = 0;                     // utilization: fraction of peak FLOP/s, (0, 1]
  std::optional<double> seconds_per_request;  // seconds_per_request: measured; overrides the estimate
};

struct HandoffSpec {                           // handoff.*
  double link_bytes_per_s = 0;                 // link_bytes_per_s: prefill -> decode, all links together
  std::optional<double> kv_bytes_per_request;  // kv_bytes_per_request: default prompt_tokens * KV bytes/token
};

// The prefix cache by tier (optional): what share of a prompt's tokens a
// prefill worker finds cached instead of computing. Hit rates come from a
// running cluster (pdctl bench's "prefill prefix cache by tier" line,
// pdctl status) or from the workload's shape.
struct PrefixSpec {                              // prefix.*
  double pool_hit_rate = 0;                      // pool_hit_rate: found in the prefill worker's KV pool
  double tier2_hit_rate = 0;                     // tier2_hit_rate: read back from its second tier
  std::optional<double> tier2_bytes_per_group;   // tier2_bytes_per_group: --kv_tier2_bytes
  // tier2_read_bytes_per_s: one group's restore rate (pdctl bench-tier2);
  // required with tier2_hit_rate > 0.
  std::optional<double> tier2_read_bytes_per_s;
};

struct WorkloadSpec {         // workload.*
  int64_t prompt_tokens = 0;  // prompt_tokens
  // history_tokens: KV positions each decode request holds and reads per
  // step (prompt included; prompt + output tokens for a conservative plan).
  int64_t history_tokens = 0;
  double mean_output_tokens = 0;                // mean_output_tokens
  double step_time_target_s = 0;                // step_time_target_s: the decode ITL target
  std::optional<double> target_requests_per_s;  // target_requests_per_s
};

struct PlanInputs {
  std::vector<std::string> notes;  // notes: assumptions, printed with the report
  ModelShape model;
  ChipSpec chip;
  DecodePoolSpec decode;
  PrefillPoolSpec prefill;
  HandoffSpec handoff;
  WorkloadSpec workload;
  PrefixSpec prefix;
  std::vector<int64_t> table_batches;  // report.batch_sizes: the per-batch table
};

// OK, or INVALID_ARGUMENT naming the first offending field: negative, zero or
// non-finite values, fractions out of range, and inconsistent combinations
// (query heads not a multiple of KV heads, a head-sharded group whose chip
// count neither divides nor is a multiple of the KV heads, an exchange time on
// the head-sharded layout, a history shorter than the prompt, a table batch
// that is not a multiple of the chips of a request-sharded group). Whether the
// model fits in memory is decided by the decode and prefill plans.
absl::Status Validate(const PlanInputs& in);

}  // namespace pdserve::capacity

#endif  // PDSERVE_ROUTER_CAPACITY_PLAN_INPUTS_H_
