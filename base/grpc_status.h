// The one conversion between absl::Status and grpc::Status, used by every
// service and client: the codes are the same numbers in both (both follow
// google.rpc.Code), the message is carried as is.
#ifndef PDSERVE_BASE_GRPC_STATUS_H_
#define PDSERVE_BASE_GRPC_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace pdserve {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace pdserve

#endif  // PDSERVE_BASE_GRPC_STATUS_H_
