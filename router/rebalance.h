// The rebalance: which running sequence, if any, a decode worker should
// move to a peer, from what the workers report (step time, KV in use) and
// what the router knows of each sequence (where it runs, its context,
// what it has left to generate).
//
// A worker is hot when its step time exceeds the coolest serving peer's
// by more than `step_margin` (a fraction), or its KV in use exceeds that
// peer's by more than `kv_margin` (a fraction of the pool). A move is
// chosen only when:
//   - the worker has been hot for `sustain` without a break (a burst or
//     one slow report moves nothing), restarted by each move it makes, so
//     that the next waits for reports taken after the move;
//   - the sequence has not moved within `window` (at most one move per
//     sequence per window), and its worker has not received a move within
//     `window` (no ping-pong: what came in does not go straight back out);
//   - the move pays: its remaining tokens, each a step of
//     (hot step - cool step) faster on the peer, save more than the
//     transfer (its KV bytes over the link's measured bandwidth) and the
//     switch (`switch_steps` of the hot worker's steps) cost.
// Of the sequences that pay, the one that saves the most moves.
//
// Pure: no clock of its own, no I/O; the router's rebalance thread feeds
// it (router_service.cc) and tests drive it on a fake clock.
//
// Thread safety: none; one caller.
#ifndef PDSERVE_ROUTER_REBALANCE_H_
#define PDSERVE_ROUTER_REBALANCE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace pdserve::router {

struct RebalanceOptions {
  double step_margin = 0.5;
  double kv_margin = 0.25;
  absl::Duration sustain = absl::Seconds(3);
  absl::Duration window = absl::Seconds(30);
  double switch_steps = 3;
  // The link bandwidth assumed before any transfer between the two
  // workers (or any other pair) is measured.
  double default_bytes_per_s = 1e9;
};

struct DecodeLoad {
  std::string address;
  double step_seconds = 0;      // 0: no decode step measured yet.
  double kv_used_fraction = 0;  // Of the pool.
  int64_t kv_bytes_per_position = 0;
  bool serving = true;
};

struct SequenceLoad {
  std::string id;      // The router's id of its decode attempt.
  std::string worker;  // Its decode worker's address.
  int64_t context = 0;    // Positions it holds.
  int64_t remaining = 0;  // Tokens it may still generate.
};

struct MoveChoice {
  std::string id;
  std::string from;
  std::string to;  // The coolest peer (the relay's placement picks the target).
  double saves_s = 0;
  double costs_s = 0;
};

class RebalancePolicy {
 public:
  explicit RebalancePolicy(RebalanceOptions options) : options_(options) {}

  // One look at the pool at `now`. `link_bytes_per_s(from, to)`: the
  // measured bandwidth (0: none measured). A choice is recorded as made.
  std::optional<MoveChoice> Decide(absl::Time now, absl::Span<const DecodeLoad> workers,
                                   absl::Span<const SequenceLoad> sequences,
                                   const std::function<double(const std::string&, const std::string&)>& link_bytes_per_s);

 private:
  const RebalanceOptions options_;
  absl::flat_hash_map<std::string, absl::Time> hot_since_;   // By worker.
  absl::flat_hash_map<std::string, absl::Time> received_;    // By worker: its latest move in.
  absl::flat_hash_map<std::string, absl::Time> moved_;       // By sequence: its latest move.
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_REBALANCE_H_
