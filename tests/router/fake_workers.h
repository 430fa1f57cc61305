// Fake prefill and decode workers behind the router's WorkerTransport, so
// the worker pool, placement and relay run in-process: each fake answers
// Status from its fields and serves Prefill and Decode from a script, with
// faults queued per worker (a worker that dies before its handoff commits,
// a handoff the decode side refuses, a decode worker that dies mid-stream,
// a message that does not parse, a stream that holds until cancelled).
//
// Every fake samples the same tokens for a request (FakeToken of its seed
// and the position), as real workers do, so a stream that survives faults
// can be compared with the one that met none.
#ifndef PDSERVE_TESTS_ROUTER_FAKE_WORKERS_H_
#define PDSERVE_TESTS_ROUTER_FAKE_WORKERS_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kv/block_hash.h"
#include "base/dtype.h"
#include "router/transport.h"
#include "router/worker_pool.h"

namespace pdserve::router::testing {

// The token every fake samples at generated position `i` of a request.
inline int32_t FakeToken(uint64_t seed, int64_t i) {
  return 300 + static_cast<int32_t>((seed * 31 + static_cast<uint64_t>(i) * 7) % 200);
}

enum class PrefillFault {
  kNone,
  kDieBeforeFirst,  // the process dies before sampling: no events, UNAVAILABLE, Status fails
  kShutDown,        // a graceful shutdown (SIGTERM) ends the call: CANCELLED from the server, Status fails
  kDieAfterFirst,   // the first token, then it dies before the commit
  kRefuseHandoff,   // the decode side refused the handoff: UNAVAILABLE, but the worker still answers
  kUnparseable,     // its first message does not parse
  kInvalid,         // INVALID_ARGUMENT
  kHoldStart,       // the call cannot even be sent (a worker that does not read) until cancelled
};

enum class DecodeFault {
  kNone,
  kDieAfter,          // `after` tokens, then the process dies (UNAVAILABLE; Status fails)
  kUnparseableAfter,  // `after` tokens, then a message that does not parse
  kHoldAfter,         // `after` tokens, then nothing until the call is cancelled
  kShutDownAfter,     // `after` tokens, then its server shuts down: CANCELLED from the server, Status fails
  kCancelAfter,       // `after` tokens, then it cancels the stream (its reader stalled): CANCELLED, still serving
  kErrorAfter,        // `after` tokens, then a final that ends the request with FINISH_REASON_ERROR
};

struct FakeWorker {
  Role role = Role::kDecode;
  std::string address;
  bool alive = true;    // answers calls at all
  bool serving = true;  // its Status says healthy
  // When not OK (and alive), how its Status calls end instead of answering:
  // DEADLINE_EXCEEDED is a worker too busy to answer within the timeout.
  absl::Status status_error;
  std::string unhealthy_reason;
  uint64_t instance = 1;
  int32_t kv_blocks_free = 1000;
  int32_t kv_blocks_total = 0;  // 0: not reported (the router's ledger knows no pool size)
  int32_t kv_block_size = 16;
  int32_t max_batch = 64;
  int32_t running = 0;
  double step_seconds = 0;
  std::optional<HashScheme> prefix_hash;
  bool pulls = false;  // A prefill worker with a pull receiver (reports a kv_address).
  // KV events served by the next Status that asks for them (then cleared).
  std::optional<worker::v1::KvEvents> kv_events;
  std::deque<PrefillFault> prefill_faults;
  std::deque<std::pair<DecodeFault, int>> decode_faults;
  // What it was asked.
  std::vector<worker::v1::PrefillRequest> prefills;
  std::vector<worker::v1::DecodeRequest> decodes;
  // The deadline each call carried (nullopt: none).
  std::vector<std::optional<absl::Time>> prefill_deadlines, decode_deadlines;
  std::vector<std::string> releases;  // Release's request ids, in order.
  int status_calls = 0;
  // When set, its Decode streams' events (tokens, then the final) come out
  // one per permit: a test adds permits to let the stream go on.
  std::shared_ptr<std::atomic<int>> decode_permits;
};

// One scripted call: its events, then how it ends.
template <typename Event>
class ScriptedStream final : public EventStream<Event> {
 public:
  using typename EventStream<Event>::ReadResult;
  ScriptedStream(std::vector<Event> events, absl::Status end, bool unparseable, bool hold, bool hold_start = false,
                 std::shared_ptr<std::atomic<int>> permits = nullptr)
      : events_(std::move(events)), end_(std::move(end)), unparseable_(unparseable), hold_(hold),
        hold_start_(hold_start), permits_(std::move(permits)) {}

  void Start() override {
    absl::MutexLock lock(&mu_);
    if (hold_start_) mu_.Await(absl::Condition(&cancelled_));
  }

  ReadResult Read(Event* event) override {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return ReadResult::kEnd;
    if (next_ < events_.size()) {
      // A permit per event, taken when it comes (polled: the test adds them).
      while (permits_ != nullptr && !cancelled_ && permits_->load() <= 0) {
        mu_.AwaitWithTimeout(absl::Condition(&cancelled_), absl::Milliseconds(1));
      }
      if (cancelled_) return ReadResult::kEnd;
      if (permits_ != nullptr) permits_->fetch_sub(1);
      *event = events_[next_++];
      return ReadResult::kMessage;
    }
    if (unparseable_) {
      cancelled_ = true;  // as the real reader does
      return ReadResult::kUnparseable;
    }
    if (hold_) mu_.Await(absl::Condition(&cancelled_));
    return ReadResult::kEnd;
  }
  absl::Status Finish() override {
    absl::MutexLock lock(&mu_);
    return cancelled_ ? absl::CancelledError("Cancelled") : end_;
  }
  absl::Status parse_error() const override {
    return unparseable_ ? absl::InternalError("pdserve.v1.TokenChunk.text: not valid UTF-8") : absl::OkStatus();
  }
  void Cancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }

 private:
  absl::Mutex mu_;
  std::vector<Event> events_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status end_;
  bool unparseable_;
  bool hold_;
  bool hold_start_;
  std::shared_ptr<std::atomic<int>> permits_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

class FakeWorkers final : public WorkerTransport {
 public:
  FakeWorker& Add(Role role, const std::string& address) {
    absl::MutexLock lock(&mu_);
    auto w = std::make_unique<FakeWorker>();
    w->role = role;
    w->address = address;
    w->kv_events.emplace();
    w->kv_events->set_snapshot(true);
    if (role == Role::kDecode) w->prefix_hash = HashScheme{ModelIdentity{1, 2}, DType::kF32, w->kv_block_size};
    FakeWorker& ref = *w;
    workers_[address] = std::move(w);
    return ref;
  }
  // REQUIRES: Add(address) came first. Change fields only while no call runs.
  FakeWorker& at(const std::string& address) {
    absl::MutexLock lock(&mu_);
    return *workers_.at(address);
  }

  std::shared_ptr<WorkerConnection> Connect(const std::string&, Role) override { return nullptr; }

  std::unique_ptr<PrefillStream> Prefill(const Worker& worker, const worker::v1::PrefillRequest& request,
                                         std::optional<absl::Time> deadline) override {
    absl::MutexLock lock(&mu_);
    FakeWorker& w = *workers_.at(worker.address());
    w.prefills.push_back(request);
    w.prefill_deadlines.push_back(deadline);
    if (!w.alive) return Ended<worker::v1::PrefillEvent>(absl::UnavailableError("failed to connect"));
    PrefillFault fault = PrefillFault::kNone;
    if (!w.prefill_faults.empty()) {
      fault = w.prefill_faults.front();
      w.prefill_faults.pop_front();
    }
    const worker::v1::WorkRequest& work = request.request();
    std::vector<worker::v1::PrefillEvent> events;
    worker::v1::PrefillEvent first;
    first.mutable_first()->mutable_token()->set_token_id(FakeToken(work.seed(), work.generated_ids_size()));
    first.mutable_first()->set_prefill_seconds(0.01);
    worker::v1::PrefillEvent done;
    done.mutable_done()->set_handoff_seconds(0.002);
    switch (fault) {
      case PrefillFault::kNone:
        return Stream(std::vector{first, done}, absl::OkStatus());
      case PrefillFault::kDieBeforeFirst:
        w.alive = false;
        return Ended<worker::v1::PrefillEvent>(absl::UnavailableError("Socket closed"));
      case PrefillFault::kShutDown:
        w.alive = false;
        return Ended<worker::v1::PrefillEvent>(absl::CancelledError("Cancelled"));
      case PrefillFault::kDieAfterFirst:
        w.alive = false;
        return Stream(std::vector{first}, absl::UnavailableError("Socket closed"));
      case PrefillFault::kRefuseHandoff:
        return Ended<worker::v1::PrefillEvent>(
            absl::UnavailableError("handoff: the decode worker refused the reservation"));
      case PrefillFault::kUnparseable:
        return std::make_unique<ScriptedStream<worker::v1::PrefillEvent>>(
            std::vector<worker::v1::PrefillEvent>{}, absl::OkStatus(), true, false);
      case PrefillFault::kInvalid:
        return Ended<worker::v1::PrefillEvent>(absl::InvalidArgumentError("prompt_ids: empty"));
      case PrefillFault::kHoldStart:
        return std::make_unique<ScriptedStream<worker::v1::PrefillEvent>>(
            std::vector{first, done}, absl::OkStatus(), false, false, /*hold_start=*/true);
    }
    return nullptr;
  }

  std::unique_ptr<DecodeStream> Decode(const Worker& worker, const worker::v1::DecodeRequest& request,
                                       std::optional<absl::Time> deadline) override {
    absl::MutexLock lock(&mu_);
    FakeWorker& w = *workers_.at(worker.address());
    w.decodes.push_back(request);
    w.decode_deadlines.push_back(deadline);
    if (!w.alive) return Ended<worker::v1::DecodeEvent>(absl::UnavailableError("failed to connect"));
    std::pair<DecodeFault, int> fault{DecodeFault::kNone, 0};
    if (!w.decode_faults.empty()) {
      fault = w.decode_faults.front();
      w.decode_faults.pop_front();
    }
    // A handed-off request's first token came from the prefill worker.
    const worker::v1::WorkRequest& work = request.request();
    const int64_t start = work.generated_ids_size() + (request.prefill_here() ? 0 : 1);
    std::vector<worker::v1::DecodeEvent> events;
    for (int64_t i = start; i < work.max_tokens(); ++i) {
      if (fault.first != DecodeFault::kNone && i - start == fault.second) break;
      worker::v1::DecodeEvent e;
      e.mutable_chunk()->add_token_ids(FakeToken(work.seed(), i));
      events.push_back(std::move(e));
    }
    switch (fault.first) {
      case DecodeFault::kNone: {
        worker::v1::DecodeEvent fin;
        fin.mutable_final()->set_finish_reason(v1::FINISH_REASON_LENGTH);
        events.push_back(std::move(fin));
        if (w.decode_permits != nullptr) {
          return std::make_unique<ScriptedStream<worker::v1::DecodeEvent>>(
              std::move(events), absl::OkStatus(), false, false, false, w.decode_permits);
        }
        return Stream(std::move(events), absl::OkStatus());
      }
      case DecodeFault::kDieAfter:
        w.alive = false;
        return Stream(std::move(events), absl::UnavailableError("Socket closed"));
      case DecodeFault::kShutDownAfter:
        w.alive = false;
        return Stream(std::move(events), absl::CancelledError("Cancelled"));
      case DecodeFault::kCancelAfter:
        return Stream(std::move(events), absl::CancelledError("the client stopped reading"));
      case DecodeFault::kErrorAfter: {
        worker::v1::DecodeEvent fin;
        fin.mutable_final()->set_finish_reason(v1::FINISH_REASON_ERROR);
        fin.mutable_final()->set_error("the sampler found a NaN logit");
        events.push_back(std::move(fin));
        return Stream(std::move(events), absl::OkStatus());
      }
      case DecodeFault::kUnparseableAfter:
        return std::make_unique<ScriptedStream<worker::v1::DecodeEvent>>(std::move(events), absl::OkStatus(), true,
                                                                         false);
      case DecodeFault::kHoldAfter:
        return std::make_unique<ScriptedStream<worker::v1::DecodeEvent>>(std::move(events), absl::OkStatus(), false,
                                                                         true);
    }
    return nullptr;
  }

  void Release(const Worker& worker, const worker::v1::ReleaseRequest& request) override {
    absl::MutexLock lock(&mu_);
    workers_.at(worker.address())->releases.push_back(request.request_id());
  }

  std::vector<absl::StatusOr<worker::v1::WorkerInfo>> Status(absl::Span<const StatusQuery> queries,
                                                             absl::Duration) override {
    absl::MutexLock lock(&mu_);
    std::vector<absl::StatusOr<worker::v1::WorkerInfo>> out;
    for (const StatusQuery& q : queries) {
      FakeWorker& w = *workers_.at(q.worker->address());
      ++w.status_calls;
      if (!w.alive) {
        out.emplace_back(absl::UnavailableError("failed to connect to all addresses"));
        continue;
      }
      if (!w.status_error.ok()) {
        out.emplace_back(w.status_error);
        continue;
      }
      worker::v1::WorkerInfo info;
      v1::WorkerStatus* s = info.mutable_status();
      s->set_healthy(w.serving);
      s->set_kv_blocks_free(w.kv_blocks_free);
      s->set_kv_blocks_total(w.kv_blocks_total);
      s->set_kv_block_size(w.kv_block_size);
      s->set_max_batch(w.max_batch);
      s->set_running(w.running);
      s->set_step_seconds(w.step_seconds);
      s->set_kv_bytes_per_position(64);
      info.set_unhealthy_reason(w.serving ? "" : w.unhealthy_reason);
      info.set_instance_id(w.instance);
      if (w.role == Role::kDecode) info.set_kv_address(w.address + "-kv");
      if (w.role == Role::kPrefill && w.pulls) info.set_kv_address(w.address + "-pull");
      if (w.prefix_hash.has_value()) {
        worker::v1::PrefixHashConfig* c = info.mutable_prefix_hash();
        c->set_model_lo(w.prefix_hash->model.lo);
        c->set_model_hi(w.prefix_hash->model.hi);
        c->set_kv_dtype(static_cast<int32_t>(w.prefix_hash->kv_dtype));
        c->set_block_size(w.prefix_hash->block_size);
      }
      if (q.request.want_kv_events() && w.kv_events.has_value()) {
        *info.mutable_kv_events() = *w.kv_events;
        w.kv_events.reset();
      }
      out.emplace_back(std::move(info));
    }
    return out;
  }

 private:
  template <typename Event>
  static std::unique_ptr<EventStream<Event>> Ended(absl::Status st) {
    return std::make_unique<ScriptedStream<Event>>(std::vector<Event>{}, std::move(st), false, false);
  }
  template <typename Event>
  static std::unique_ptr<EventStream<Event>> Stream(std::vector<Event> events, absl::Status st) {
    return std::make_unique<ScriptedStream<Event>>(std::move(events), std::move(st), false, false);
  }

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<FakeWorker>> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::router::testing

#endif  // PDSERVE_TESTS_ROUTER_FAKE_WORKERS_H_
