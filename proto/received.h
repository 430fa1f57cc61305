// Reading messages that another process sent: parse them ourselves from the
// raw bytes, so a message that does not parse is an error that names the
// field at fault, not a silently ended stream.
//
// gRPC's typed readers turn a message that fails to parse into the end of
// the stream; a reader that then waits for the call's status waits for
// every unread message, so a router stream hangs until its deadline.
// RawStreamReader reads the bytes, parses them here, and cancels
// the call on a failure.
//
// Thread safety: the functions are; a reader is used by one thread.
#ifndef PDSERVE_PROTO_RECEIVED_H_
#define PDSERVE_PROTO_RECEIVED_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/sync_stream.h"

namespace pdserve::rpc {

// Why `bytes` does not parse as `type`: the first string field (by path,
// e.g. "pdserve.v1.TokenChunk.text") that is not valid UTF-8, or the first
// field whose data is malformed; "" if nothing specific is found.
std::string DescribeParseFailure(const google::protobuf::Descriptor& type, absl::string_view bytes);

// Parses `bytes` into `msg`. Errors: INTERNAL, naming the message type and
// the field (DescribeParseFailure).
absl::Status ParseReceived(absl::string_view bytes, google::protobuf::Message* msg);

// Fault tests only: turns `msg` into one that serializes but does not parse
// (its field 1 holds malformed wire data).
void MakeUnparseable(google::protobuf::Message* msg);

// Fault tests only: which streams get an unparseable message. Thread-safe.
class UnparseableFault {
 public:
  // `streams`: the first N streams; -1: every one; 0: none.
  explicit UnparseableFault(int32_t streams) : left_(streams) {}
  // Whether the stream starting now gets one.
  bool Take() {
    int32_t n = left_.load();
    while (n > 0 && !left_.compare_exchange_weak(n, n - 1)) {
    }
    return n != 0;
  }

 private:
  std::atomic<int32_t> left_;
};

// A server-streaming call whose messages are parsed by ParseReceived.
template <typename Response>
class RawStreamReader {
 public:
  // Starts `method` (e.g. "/pdserve.worker.v1.DecodeWorker/Decode") on
  // `channel`. REQUIRES: `ctx` outlives the reader.
  template <typename Request>
  RawStreamReader(grpc::ChannelInterface* channel, const char* method, grpc::ClientContext* ctx,
                  const Request& request)
      : ctx_(ctx),
        method_(method, grpc::internal::RpcMethod::SERVER_STREAMING),
        reader_(grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel, method_, ctx, request)) {}

  enum class Result { kMessage, kEnd, kUnparseable };
  // The next message. kUnparseable: the call is cancelled; parse_error()
  // says why; Finish() then returns at once.
  Result Read(Response* msg) {
    grpc::ByteBuffer buffer;
    if (!reader_->Read(&buffer)) return Result::kEnd;
    // Parsed in place: a message usually arrives as one slice.
    grpc::Slice slice;
    if (!buffer.TrySingleSlice(&slice).ok()) (void)buffer.DumpToSingleSlice(&slice);
    parse_error_ =
        ParseReceived(absl::string_view(reinterpret_cast<const char*>(slice.begin()), slice.size()), msg);
    if (parse_error_.ok()) return Result::kMessage;
    ctx_->TryCancel();
    return Result::kUnparseable;
  }
  const absl::Status& parse_error() const { return parse_error_; }
  grpc::Status Finish() { return reader_->Finish(); }

 private:
  grpc::ClientContext* ctx_;
  grpc::internal::RpcMethod method_;
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader_;
  absl::Status parse_error_;
};

}  // namespace pdserve::rpc

#endif  // PDSERVE_PROTO_RECEIVED_H_
