// A client of the standard gRPC health service (grpc.health.v1.Health/Check),
// for pdctl probe (what the lifecycle test's kubelet asks) and the tests.
#ifndef PDSERVE_BASE_HEALTH_CHECK_H_
#define PDSERVE_BASE_HEALTH_CHECK_H_

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"

namespace pdserve {

// grpc.health.v1.HealthCheckResponse.ServingStatus.
enum class HealthStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

// One Check call for `service` ("" = the whole server) within `timeout`.
// An error when the call fails (unreachable, deadline) or the answer is not
// a HealthCheckResponse.
absl::StatusOr<HealthStatus> CheckHealth(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout,
                                         std::string_view service = "");

}  // namespace pdserve

#endif  // PDSERVE_BASE_HEALTH_CHECK_H_
