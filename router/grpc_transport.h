// The router's WorkerTransport over gRPC: one channel per worker, streams
// read through rpc::RawStreamReader (every message parsed by the router
// itself, so a bad one names its field), Status probes all at once on the
// callback API.
//
// Thread safety: thread-safe.
#ifndef PDSERVE_ROUTER_GRPC_TRANSPORT_H_
#define PDSERVE_ROUTER_GRPC_TRANSPORT_H_

#include <memory>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "base/tls.h"
#include "router/transport.h"

namespace pdserve::router {

class GrpcTransport final : public WorkerTransport {
 public:
  // `tls`: the router's certificate and the cluster CA (mutual TLS, each
  // worker's certificate checked for the role it is dialled as); none:
  // plaintext.
  explicit GrpcTransport(TlsFiles tls = {}) : tls_(std::move(tls)) {}
  // Waits (a few seconds at most) for the Release calls still in flight.
  ~GrpcTransport() override;
  std::shared_ptr<WorkerConnection> Connect(const std::string& address, Role role) override;
  std::unique_ptr<PrefillStream> Prefill(const Worker& worker, const worker::v1::PrefillRequest& request,
                                         std::optional<absl::Time> deadline) override;
  std::unique_ptr<DecodeStream> Decode(const Worker& worker, const worker::v1::DecodeRequest& request,
                                       std::optional<absl::Time> deadline) override;
  void Release(const Worker& worker, const worker::v1::ReleaseRequest& request) override;
  absl::StatusOr<worker::v1::PauseSequenceResponse> PauseSequence(const Worker& worker,
                                                                   const worker::v1::PauseSequenceRequest& request,
                                                                   absl::Duration timeout) override;
  absl::StatusOr<worker::v1::MoveSequenceResponse> MoveSequence(const Worker& worker,
                                                                 const worker::v1::MoveSequenceRequest& request,
                                                                 absl::Duration timeout) override;
  absl::StatusOr<worker::v1::PushPrefixResponse> PushPrefix(const Worker& worker,
                                                             const worker::v1::PushPrefixRequest& request,
                                                             absl::Duration timeout) override;
  std::vector<absl::StatusOr<worker::v1::WorkerInfo>> Status(absl::Span<const StatusQuery> queries,
                                                             absl::Duration timeout) override;

 private:
  const TlsFiles tls_;
  // Release calls in flight; shared with their callbacks, which may run
  // after the transport is gone (the destructor waits only so long).
  struct Releases {
    absl::Mutex mu;
    int in_flight ABSL_GUARDED_BY(mu) = 0;
  };
  const std::shared_ptr<Releases> releases_ = std::make_shared<Releases>();
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_GRPC_TRANSPORT_H_
