#include "router/grpc_transport.h"

#include <chrono>
#include <functional>
#include <optional>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "base/grpc_status.h"
#include "base/server_util.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "proto/received.h"
#include "router/worker_pool.h"

namespace pdserve::router {
namespace {

class GrpcConnection final : public WorkerConnection {
 public:
  GrpcConnection(const std::string& address, Role role, const TlsFiles& tls) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    channel = grpc::CreateCustomChannel(
        address, tls.enabled() ? ChannelTlsCredentials(tls, RoleName(role), &args) : grpc::InsecureChannelCredentials(),
        args);
    if (role == Role::kPrefill) {
      prefill = worker::v1::PrefillWorker::NewStub(channel);
    } else {
      decode = worker::v1::DecodeWorker::NewStub(channel);
    }
  }
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<worker::v1::PrefillWorker::Stub> prefill;
  std::unique_ptr<worker::v1::DecodeWorker::Stub> decode;
};

GrpcConnection& ConnectionOf(const Worker& w) { return *static_cast<GrpcConnection*>(w.connection()); }

template <typename Event>
class GrpcStream final : public EventStream<Event> {
 public:
  using typename EventStream<Event>::ReadResult;
  template <typename Request>
  GrpcStream(grpc::Channel* channel, const char* method, const Request& request, std::optional<absl::Time> deadline)
      : ctx_(Context(deadline)), start_([this, channel, method, request] {
          reader_.emplace(channel, method, ctx_.get(), request);
        }) {}

  // A cancel before (or during) the start is kept by the context and ends
  // the call as soon as it exists.
  void Start() override { start_(); }
  ReadResult Read(Event* event) override {
    switch (reader_->Read(event)) {
      case Reader::Result::kMessage: return ReadResult::kMessage;
      case Reader::Result::kEnd: return ReadResult::kEnd;
      case Reader::Result::kUnparseable: return ReadResult::kUnparseable;
    }
    return ReadResult::kEnd;
  }
  absl::Status Finish() override { return FromGrpcStatus(reader_->Finish()); }
  absl::Status parse_error() const override { return reader_->parse_error(); }
  void Cancel() override { ctx_->TryCancel(); }

 private:
  using Reader = rpc::RawStreamReader<Event>;
  static std::unique_ptr<grpc::ClientContext> Context(std::optional<absl::Time> deadline) {
    auto c = std::make_unique<grpc::ClientContext>();
    if (deadline.has_value()) c->set_deadline(absl::ToChronoTime(*deadline));
    return c;
  }
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::function<void()> start_;
  std::optional<Reader> reader_;  // the call, once started
};

}  // namespace

std::shared_ptr<WorkerConnection> GrpcTransport::Connect(const std::string& address, Role role) {
  return std::make_shared<GrpcConnection>(address, role, tls_);
}

std::unique_ptr<PrefillStream> GrpcTransport::Prefill(const Worker& worker, const worker::v1::PrefillRequest& request,
                                                      std::optional<absl::Time> deadline) {
  return std::make_unique<GrpcStream<worker::v1::PrefillEvent>>(
      ConnectionOf(worker).channel.get(), "/pdserve.worker.v1.PrefillWorker/Prefill", request, deadline);
}

std::unique_ptr<DecodeStream> GrpcTransport::Decode(const Worker& worker, const worker::v1::DecodeRequest& request,
                                                    std::optional<absl::Time> deadline) {
  return std::make_unique<GrpcStream<worker::v1::DecodeEvent>>(
      ConnectionOf(worker).channel.get(), "/pdserve.worker.v1.DecodeWorker/Decode", request, deadline);
}

GrpcTransport::~GrpcTransport() {
  Releases& r = *releases_;
  absl::MutexLock lock(&r.mu);
  auto none = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r.mu) { return r.in_flight == 0; };
  r.mu.AwaitWithTimeout(absl::Condition(&none), absl::Seconds(3));
}

absl::StatusOr<worker::v1::PushPrefixResponse> GrpcTransport::PushPrefix(
    const Worker& worker, const worker::v1::PushPrefixRequest& request, absl::Duration timeout) {
  GrpcConnection& conn = ConnectionOf(worker);
  if (conn.prefill == nullptr) return absl::FailedPreconditionError("only prefill workers push prefixes");
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  worker::v1::PushPrefixResponse out;
  const grpc::Status st = conn.prefill->PushPrefix(&ctx, request, &out);
  if (!st.ok()) return FromGrpcStatus(st);
  return out;
}

absl::StatusOr<worker::v1::PauseSequenceResponse> GrpcTransport::PauseSequence(
    const Worker& worker, const worker::v1::PauseSequenceRequest& request, absl::Duration timeout) {
  GrpcConnection& conn = ConnectionOf(worker);
  if (conn.decode == nullptr) return absl::FailedPreconditionError("only decode workers run sequences");
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  worker::v1::PauseSequenceResponse out;
  const grpc::Status st = conn.decode->PauseSequence(&ctx, request, &out);
  if (!st.ok()) return FromGrpcStatus(st);
  return out;
}

absl::StatusOr<worker::v1::MoveSequenceResponse> GrpcTransport::MoveSequence(
    const Worker& worker, const worker::v1::MoveSequenceRequest& request, absl::Duration timeout) {
  GrpcConnection& conn = ConnectionOf(worker);
  if (conn.decode == nullptr) return absl::FailedPreconditionError("only decode workers run sequences");
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  worker::v1::MoveSequenceResponse out;
  const grpc::Status st = conn.decode->MoveSequence(&ctx, request, &out);
  if (!st.ok()) return FromGrpcStatus(st);
  return out;
}

void GrpcTransport::Release(const Worker& worker, const worker::v1::ReleaseRequest& request) {
  struct Call {
    grpc::ClientContext ctx;
    worker::v1::ReleaseRequest request;
    worker::v1::ReleaseResponse response;
    std::string address;
  };
  GrpcConnection& conn = ConnectionOf(worker);
  if (conn.decode == nullptr) return;  // Only decode workers hold handoffs.
  auto* c = new Call;
  c->request = request;
  c->address = worker.address();
  c->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  {
    absl::MutexLock lock(&releases_->mu);
    ++releases_->in_flight;
  }
  auto done = [releases = releases_, c](grpc::Status st) {
    if (!st.ok()) {
      LogEvent("warning", "release_failed", {{"request_id", c->request.request_id()}, {"worker", c->address},
                                             {"error", st.error_message()}});
    } else if (c->response.freed()) {
      LogEvent("info", "released_handoff", {{"request_id", c->request.request_id()}, {"worker", c->address}});
    }
    delete c;
    absl::MutexLock lock(&releases->mu);
    --releases->in_flight;
  };
  conn.decode->async()->Release(&c->ctx, &c->request, &c->response, std::move(done));
}

std::vector<absl::StatusOr<worker::v1::WorkerInfo>> GrpcTransport::Status(absl::Span<const StatusQuery> queries,
                                                                          absl::Duration timeout) {
  struct Call {
    grpc::ClientContext ctx;
    worker::v1::WorkerInfo info;
    grpc::Status status;
  };
  std::vector<Call> calls(queries.size());
  absl::Mutex mu;
  size_t done = 0;
  const auto deadline = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
  for (size_t i = 0; i < queries.size(); ++i) {
    Call* c = &calls[i];
    c->ctx.set_deadline(deadline);
    auto on_done = [c, &mu, &done](grpc::Status st) {
      absl::MutexLock lock(&mu);
      c->status = std::move(st);
      ++done;
    };
    GrpcConnection& conn = ConnectionOf(*queries[i].worker);
    if (conn.prefill != nullptr) {
      conn.prefill->async()->Status(&c->ctx, &queries[i].request, &c->info, on_done);
    } else {
      conn.decode->async()->Status(&c->ctx, &queries[i].request, &c->info, on_done);
    }
  }
  {
    absl::MutexLock lock(&mu);
    auto all_done = [&done, n = calls.size()] { return done == n; };
    mu.Await(absl::Condition(&all_done));
  }
  std::vector<absl::StatusOr<worker::v1::WorkerInfo>> out;
  out.reserve(calls.size());
  for (Call& c : calls) {
    if (c.status.ok()) {
      out.emplace_back(std::move(c.info));
    } else {
      out.emplace_back(FromGrpcStatus(c.status));
    }
  }
  return out;
}

}  // namespace pdserve::router
