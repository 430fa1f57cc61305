// The calls the router makes to workers, behind one interface, so that
// the worker pool, placement and the relay can be driven in-process by
// fake workers in tests and by gRPC (grpc_transport.h) in the router.
//
// Thread safety: a WorkerTransport is thread-safe; a stream is read by one
// thread, and Cancel may be called from any thread at any time.
#ifndef PDSERVE_ROUTER_TRANSPORT_H_
#define PDSERVE_ROUTER_TRANSPORT_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "pdserve/v1/worker.pb.h"

namespace pdserve::router {

enum class Role { kPrefill, kDecode };
inline const char* RoleName(Role r) { return r == Role::kPrefill ? "prefill" : "decode"; }

class Worker;

// What a transport keeps per worker (a channel and its stubs); opaque to
// everything but the transport that made it.
class WorkerConnection {
 public:
  virtual ~WorkerConnection() = default;
};

// One server-streaming call's events, each parsed by the receiver itself
// (proto/received.h), so a message that does not parse is reported as such
// rather than as the end of the stream.
template <typename Event>
class EventStream {
 public:
  enum class ReadResult { kMessage, kEnd, kUnparseable };
  virtual ~EventStream() = default;
  // Sends the request. Split from construction so that the caller can make
  // the stream reachable by Cancel first: starting may block (a worker that
  // does not read), and a cancel must be able to end that wait.
  virtual void Start() {}
  // The next event. kUnparseable: the call is cancelled and parse_error()
  // says which field; Finish() then returns at once.
  virtual ReadResult Read(Event* event) = 0;
  // The call's status. REQUIRES: Read returned kEnd or kUnparseable.
  virtual absl::Status Finish() = 0;
  virtual absl::Status parse_error() const = 0;
  // Ends the call early (Read then returns kEnd, Finish CANCELLED).
  virtual void Cancel() = 0;
};
using PrefillStream = EventStream<worker::v1::PrefillEvent>;
using DecodeStream = EventStream<worker::v1::DecodeEvent>;

// One worker's Status query.
struct StatusQuery {
  const Worker* worker = nullptr;
  worker::v1::WorkerStatusRequest request;
};

class WorkerTransport {
 public:
  virtual ~WorkerTransport() = default;
  // Called once per worker the pool learns of; null is allowed (a transport
  // that needs nothing per worker).
  virtual std::shared_ptr<WorkerConnection> Connect(const std::string& address, Role role) = 0;
  // A call, started by its Start(); `deadline`: the client's, carried
  // downstream.
  virtual std::unique_ptr<PrefillStream> Prefill(const Worker& worker, const worker::v1::PrefillRequest& request,
                                                 std::optional<absl::Time> deadline) = 0;
  virtual std::unique_ptr<DecodeStream> Decode(const Worker& worker, const worker::v1::DecodeRequest& request,
                                               std::optional<absl::Time> deadline) = 0;
  // Tells a decode worker that the router is done with request_id there
  // (its Decode call ended without a final message), so that a handoff no
  // call will claim is freed now. Returns at once; the answer, or its
  // failure (a dead worker frees everything anyway), is only logged.
  virtual void Release(const Worker& worker, const worker::v1::ReleaseRequest& request) = 0;
  // Asks prefill worker `worker` to send a cached prefix to another
  // prefill worker (worker.proto's PushPrefix); blocks until it answers or
  // `timeout` passes. UNIMPLEMENTED where the transport has no such call.
  virtual absl::StatusOr<worker::v1::PushPrefixResponse> PushPrefix(const Worker& worker,
                                                                     const worker::v1::PushPrefixRequest& request,
                                                                     absl::Duration timeout) {
    (void)worker;
    (void)request;
    (void)timeout;
    return absl::UnimplementedError("no prefix pushes over this transport");
  }
  // A decode worker's running sequence, moved to another (worker.proto's
  // PauseSequence and MoveSequence); each blocks until it answers or
  // `timeout` passes. UNIMPLEMENTED where the transport has no such call.
  virtual absl::StatusOr<worker::v1::PauseSequenceResponse> PauseSequence(
      const Worker& worker, const worker::v1::PauseSequenceRequest& request, absl::Duration timeout) {
    (void)worker;
    (void)request;
    (void)timeout;
    return absl::UnimplementedError("no sequence moves over this transport");
  }
  virtual absl::StatusOr<worker::v1::MoveSequenceResponse> MoveSequence(const Worker& worker,
                                                                        const worker::v1::MoveSequenceRequest& request,
                                                                        absl::Duration timeout) {
    (void)worker;
    (void)request;
    (void)timeout;
    return absl::UnimplementedError("no sequence moves over this transport");
  }
  // Every query at once; returns when each has answered or failed, within
  // about `timeout`. One result per query, in order.
  virtual std::vector<absl::StatusOr<worker::v1::WorkerInfo>> Status(absl::Span<const StatusQuery> queries,
                                                                     absl::Duration timeout) = 0;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_TRANSPORT_H_
