// pdctl's cluster client commands: generate through a router, and status.
#ifndef PDSERVE_TOOLS_PDCTL_CLUSTER_COMMANDS_H_
#define PDSERVE_TOOLS_PDCTL_CLUSTER_COMMANDS_H_

#include <string>

#include "absl/status/status.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve::pdctl {

// Streams the generation's text to stdout as it arrives (ids too when
// `print_ids`), then the finish reason, usage, seed and timings on stderr.
absl::Status RemoteGenerate(const std::string& router, const v1::GenerateRequest& request, bool print_ids,
                            double timeout_seconds);

// Pools, workers and their load, from the router's ClusterStatus.
absl::Status RemoteStatus(const std::string& router, bool json);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_CLUSTER_COMMANDS_H_
