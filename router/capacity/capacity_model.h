// The capacity model of one deployment: validated inputs in, the decode plan
// (memory, batch, step time) and the system plan (three stages, target rate,
// latency, cost) out. decode_model.h and stage_model.h hold the formulas.
//
// Pure function; thread-compatible.
#ifndef PDSERVE_ROUTER_CAPACITY_CAPACITY_MODEL_H_
#define PDSERVE_ROUTER_CAPACITY_CAPACITY_MODEL_H_

#include "absl/status/statusor.h"
#include "router/capacity/decode_model.h"
#include "router/capacity/plan_inputs.h"
#include "router/capacity/stage_model.h"

namespace pdserve::capacity {

struct CapacityPlan {
  DecodePlan decode;
  SystemPlan system;
};

// Validate(in), then PlanDecode and PlanSystem. INVALID_ARGUMENT naming the
// field on any invalid or infeasible input.
absl::StatusOr<CapacityPlan> PlanCapacity(const PlanInputs& in);

}  // namespace pdserve::capacity

#endif  // PDSERVE_ROUTER_CAPACITY_CAPACITY_MODEL_H_
