#include "router/capacity/capacity_model.h"

namespace pdserve::capacity {

absl::StatusOr<CapacityPlan> PlanCapacity(const PlanInputs& in) {
  if (absl::Status s = Validate(in); !s.ok()) return s;
  absl::StatusOr<DecodePlan> decode = PlanDecode(in);
  if (!decode.ok()) return decode.status();
  absl::StatusOr<SystemPlan> system = PlanSystem(in, *decode);
  if (!system.ok()) return system.status();
  return CapacityPlan{*std::move(decode), *std::move(system)};
}

}  // namespace pdserve::capacity
