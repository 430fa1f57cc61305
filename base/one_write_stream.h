// A server-streaming reactor (gRPC callback API) with at most one write
// outstanding: what the stream does next (write `out_`, or finish) is
// decided under mu_ by the subclass, which returns an Action, and done by
// Do() outside the lock. While a write is outstanding or after Finish,
// nothing else starts, so the reactor cannot be done (and deleted) under
// a write or a finish that this object started.
#ifndef PDSERVE_BASE_ONE_WRITE_STREAM_H_
#define PDSERVE_BASE_ONE_WRITE_STREAM_H_

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/status.h"

namespace pdserve {

template <typename Message>
class OneWriteStream : public grpc::ServerWriteReactor<Message> {
 protected:
  struct Action {
    enum Kind { kNone, kWrite, kFinish } kind = kNone;
    grpc::Status status;
  };

  // The message in out_ goes out next. REQUIRES: !busy().
  Action WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    return {Action::kWrite, {}};
  }
  Action FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finish_called_ = true;
    return {Action::kFinish, std::move(status)};
  }
  // From OnWriteDone.
  void WriteDoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { writing_ = false; }
  bool writing() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return writing_; }
  bool finish_called() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finish_called_; }
  // A write or the finish is under way: nothing else may start.
  bool busy() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return writing_ || finish_called_; }

  void Do(const Action& a) {
    switch (a.kind) {
      case Action::kNone: return;
      case Action::kWrite: this->StartWrite(&out_); return;
      case Action::kFinish: this->Finish(a.status); return;
    }
  }

  absl::Mutex mu_;
  Message out_ ABSL_GUARDED_BY(mu_);  // The message being written.

 private:
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pdserve

#endif  // PDSERVE_BASE_ONE_WRITE_STREAM_H_
