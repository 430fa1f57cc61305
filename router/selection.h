// How the router chooses a worker of a pool for a request: one interface,
// so policies can be swapped by flag and new ones (prefix-aware) added
// without touching the request path. The router filters first (serving,
// not excluded for this request, with KV room where that applies) and
// hands the selector what is left, in pool order.
//
// Thread safety: Select may be called from many request threads at once.
#ifndef PDSERVE_ROUTER_SELECTION_H_
#define PDSERVE_ROUTER_SELECTION_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace pdserve::router {

struct SelectionCandidate {
  absl::string_view address;
  // Prefill: prompt tokens queued on the worker; decode: requests in flight.
  int64_t load = 0;
};

class Selector {
 public:
  virtual ~Selector() = default;
  virtual absl::string_view name() const = 0;
  // An index into `candidates`. REQUIRES: !candidates.empty().
  virtual size_t Select(absl::Span<const SelectionCandidate> candidates) = 0;
};

// The smallest load; ties go to the first in pool order.
class LeastLoadedSelector final : public Selector {
 public:
  absl::string_view name() const override { return "least_loaded"; }
  size_t Select(absl::Span<const SelectionCandidate> candidates) override;
};

// Each request to the next candidate in turn, whatever the loads.
class RoundRobinSelector final : public Selector {
 public:
  absl::string_view name() const override { return "round_robin"; }
  size_t Select(absl::Span<const SelectionCandidate> candidates) override;

 private:
  std::atomic<uint64_t> next_{0};
};

// "least_loaded" or "round_robin"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<std::unique_ptr<Selector>> MakeSelector(absl::string_view policy);

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_SELECTION_H_
