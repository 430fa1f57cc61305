#include "base/health_check.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace pdserve {

absl::StatusOr<HealthStatus> CheckHealth(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout, std::string_view service) {
  // HealthCheckRequest { string service = 1; }, encoded by hand: the
  // message is one optional short string.
  if (service.size() > 127) return absl::InvalidArgumentError("health service name over 127 bytes");
  std::string request_bytes;
  if (!service.empty()) {
    request_bytes.push_back(0x0a);
    request_bytes.push_back(static_cast<char>(service.size()));
    request_bytes.append(service);
  }
  grpc::GenericStub stub(std::move(channel));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("health check: ", status.error_message()));
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("health check: unreadable answer");
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse { ServingStatus status = 1; }: tag 0x08 and a
  // one-byte varint, or nothing at all for UNKNOWN (0).
  if (bytes.empty()) return HealthStatus::kUnknown;
  if (bytes.size() == 2 && bytes[0] == 0x08 && bytes[1] >= 0 && bytes[1] <= 3) {
    return static_cast<HealthStatus>(bytes[1]);
  }
  return absl::InternalError("health check: the answer is not a HealthCheckResponse");
}

}  // namespace pdserve
