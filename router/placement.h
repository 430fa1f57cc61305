// Where a request runs: a decode worker, whether its context is prefilled
// there (colocated, or conditional disaggregation) and otherwise which
// prefill worker computes it. Placement only decides; the relay sends.
// Admission is given the same decision the request then runs with, made by
// the configured selectors (placement.h's Place).
//
// Thread safety: thread-safe (PromptChains and Exclusions belong to one
// request).
#ifndef PDSERVE_ROUTER_PLACEMENT_H_
#define PDSERVE_ROUTER_PLACEMENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "router/admission.h"
#include "router/assignment.h"
#include "router/decode_room.h"
#include "router/measured.h"
#include "router/prefix_index.h"
#include "router/selection.h"
#include "router/worker_pool.h"
#include "pdserve/v1/worker.pb.h"

namespace pdserve::router {

struct PlacementOptions {
  // Every request to a decode worker, prefilled there (no prefill pool).
  bool colocated = false;
  // A decode worker has batch headroom while it runs fewer than its max
  // batch and, with a target set, its measured step time is under it.
  absl::Duration itl_target = absl::ZeroDuration();
  // Conditional disaggregation: a request whose context the chosen decode
  // worker lacks at most this many positions of (and that has headroom)
  // is prefilled there. 0: off.
  int64_t local_prefill_max_tokens = 0;
  // How long a placed context's blocks count as cached on its worker
  // before the worker's own KV events confirm them.
  absl::Duration prefix_expect = absl::Seconds(10);
  // Prefix pulls: a chosen prefill worker that lacks at least this many
  // of the context's positions which another serving prefill worker holds
  // takes them from that worker, when the predicted transfer (their KV
  // bytes at the link's measured bandwidth, plus pull_overhead) is shorter
  // than computing them at the chosen worker's measured speed. 0: none.
  int64_t pull_min_tokens = 0;
  absl::Duration pull_overhead = absl::Milliseconds(2);
  // Pull whenever another worker holds at least pull_min_tokens more,
  // without the prediction (links known to be faster than any prefill, and
  // tests that need a pull whatever the machine measures under load).
  bool pull_always = false;
  Clock clock = RealClock();
  // The router's ledger of decode KV (none: each worker's last report
  // alone says how much room it has). Must outlive the placement.
  const DecodeRoom* room = nullptr;
};

// A request's context hashed per worker hashing scheme (usually one),
// computed on first use, the chains seeded with the request's cache salt.
class PromptChains {
 public:
  explicit PromptChains(absl::Span<const int32_t> context, const CacheSalt& salt = {})
      : context_(context), salt_(salt) {}
  // The chain a worker hashing with `scheme` would find; empty without one.
  // The last position is never in it (it is always computed).
  absl::Span<const BlockHash> For(const std::optional<HashScheme>& scheme);
  int64_t size() const { return static_cast<int64_t>(context_.size()); }

 private:
  absl::Span<const int32_t> context_;
  CacheSalt salt_;
  std::vector<std::pair<HashScheme, std::vector<BlockHash>>> chains_;
};

// Workers a request gave up on, each in the incarnation it failed in: once
// it restarts (a new instance id) the request may use it again.
class Exclusions {
 public:
  void Add(const Worker& w, std::string error = {}) {
    failed_.push_back({&w, w.instance(), w.address(), std::move(error)});
  }
  bool Excludes(const Worker& w) const;
  bool empty() const { return failed_.empty(); }
  size_t size() const { return failed_.size(); }
  const std::string& last_address() const { return failed_.back().address; }
  const std::string& last_error() const { return failed_.back().error; }

 private:
  struct Failed {
    const Worker* worker;  // compared, never followed: it may be gone
    uint64_t instance;
    std::string address;
    std::string error;
  };
  std::vector<Failed> failed_;
};

// A prefix to pull before a prefill: `positions` of the context (whole
// blocks) from `from`, `gain` of them missing on the puller, with the
// predictions that chose it.
struct PullPlan {
  WorkerPtr from;
  int64_t positions = 0;
  int64_t gain = 0;
  double transfer_s = 0;
  double compute_s = 0;
};

// A placement. decode null: no decode worker can take it now; prefill null
// with !local: no prefill worker can.
struct Placed {
  WorkerPtr decode;
  bool local = false;  // prefilled on the decode worker
  WorkerPtr prefill;
};

class Placement {
 public:
  // `pool`, `index` and `measured` must outlive it.
  Placement(PlacementOptions options, WorkerPool* pool, PrefixIndex* index, MeasuredInputs* measured,
            std::unique_ptr<Selector> prefill_selector, std::unique_ptr<Selector> decode_selector);

  const PlacementOptions& options() const { return options_; }

  // The whole decision for a context that needs `positions` of KV.
  Placed Place(int64_t positions, PromptChains& chains, const Exclusions& exclude_decode = {},
               const Exclusions& exclude_prefill = {});
  // A serving decode worker with free KV for `positions`, chosen by the
  // decode selector; if none has room, the one with the most free KV, or
  // with `need_room`, none.
  WorkerPtr PickDecode(int64_t positions, const Exclusions& exclude, PromptChains& chains, bool need_room = false);
  // Room for `positions` on `w` as the ledger (or, without one, its last
  // report) counts it; -1: not known.
  int64_t FreeFor(const Worker& w) const;
  // A serving prefill worker chosen by the prefill selector.
  WorkerPtr PickPrefill(const Exclusions& exclude, PromptChains& chains);
  // Whether the context is prefilled on decode worker `d` (colocated, or
  // little of it is missing there and `d` has batch headroom).
  bool PrefillOnDecode(const Worker& d, PromptChains& chains);

  bool HasHeadroom(const Worker& w) const;
  // Positions of the context `w` holds in its prefix cache, as the index
  // sees it.
  int64_t CachedTokens(const Worker& w, PromptChains& chains);
  // The context is on its way to `w`: count its blocks there for a while.
  void Expect(const Worker& w, PromptChains& chains);
  // The context's prefill goes to `p`: its blocks are expected there, and
  // the Assignment holds one of p's in_flight and, on its queue, the tokens
  // p will compute (the context less what p holds cached) until the first
  // token comes back or it is released.
  Assignment AssignPrefill(WorkerPtr p, PromptChains& chains);
  // A Decode call goes to `d`: the Assignment holds one of its in_flight.
  static Assignment AssignDecode(WorkerPtr d) { return Assignment(std::move(d), 0); }
  // The pull, if any, that should come before `p` prefills the context:
  // the serving prefill worker holding the most of it (pull receivers on
  // both, the same block hashing) when that beats computing it (options'
  // pull_min_tokens, pull_overhead). Counts the decisions (pull_stats).
  std::optional<PullPlan> PlanPull(const Worker& p, PromptChains& chains);
  // The answer to `plan`'s PushPrefix (for `request_id`, logged): the
  // pulled blocks count as cached on `p` (as Expect does for a prefill),
  // the transfer is measured on the link, and the outcome counted.
  void PullDone(const Worker& p, PromptChains& chains, const PullPlan& plan,
                const absl::StatusOr<worker::v1::PushPrefixResponse>& result, const std::string& request_id);
  struct PullStats {
    std::atomic<int64_t> slower{0};       // A holder existed; computing was predicted faster.
    std::atomic<int64_t> unmeasured{0};   // A holder existed; no link or prefill speed measured yet.
    std::atomic<int64_t> pulled{0};       // Pushes that committed.
    std::atomic<int64_t> empty{0};        // The holder no longer held the prefix.
    std::atomic<int64_t> failed{0};       // Pushes that failed (the prefix was computed).
    std::atomic<int64_t> pulled_positions{0};  // Positions now cached on the puller thanks to pulls.
    std::atomic<int64_t> bytes{0};
    std::atomic<double> seconds{0};
  };
  const PullStats& pull_stats() const { return pull_stats_; }
  // What admission weighs for `placed`.
  AdmissionRequest AdmissionInputs(const Placed& placed, PromptChains& chains, int64_t min_samples);
  // Prompt tokens assigned to a prefill worker that computes them although
  // another serving prefill worker holds them in its prefix cache, as the
  // index sees it (the most any other holds, less what the chosen one
  // holds, a successful pull counting as held), since start: the
  // computing that prefix pulls did not avoid.
  int64_t tokens_cached_elsewhere() const { return tokens_cached_elsewhere_.load(std::memory_order_relaxed); }

 private:
  SelectionCandidate PrefillCandidate(const Worker& w, PromptChains& chains);

  const PlacementOptions options_;
  std::atomic<int64_t> tokens_cached_elsewhere_{0};
  PullStats pull_stats_;
  WorkerPool* const pool_;
  PrefixIndex* const index_;
  MeasuredInputs* const measured_;
  const std::unique_ptr<Selector> prefill_selector_;
  const std::unique_ptr<Selector> decode_selector_;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_PLACEMENT_H_
