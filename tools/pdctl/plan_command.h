// `pdctl plan --config FILE [--json]`: the capacity model of a deployment
// (router/capacity) printed as a readable report, or as one JSON object.
#ifndef PDSERVE_TOOLS_PDCTL_PLAN_COMMAND_H_
#define PDSERVE_TOOLS_PDCTL_PLAN_COMMAND_H_

#include <string>

#include "absl/status/status.h"

namespace pdserve::pdctl {

// Loads and plans `config_path` (.json, .yaml or .yml) and prints the report
// to stdout. INVALID_ARGUMENT naming the config field on a bad input.
absl::Status RunPlan(const std::string& config_path, bool json);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_PLAN_COMMAND_H_
