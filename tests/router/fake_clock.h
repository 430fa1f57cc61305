// A settable time source for the router's measured inputs and admission
// control, so tests drive time instead of waiting for it.
#ifndef PDSERVE_TESTS_ROUTER_FAKE_CLOCK_H_
#define PDSERVE_TESTS_ROUTER_FAKE_CLOCK_H_

#include "absl/time/time.h"
#include "router/measured.h"

namespace pdserve::router {

struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1'000'000);
  // Reads `now`; the FakeClock must outlive it.
  Clock clock() {
    return [this] { return now; };
  }
};

// Options of either kind (MeasuredOptions, AdmissionOptions) on `c`.
template <typename OptionsT>
OptionsT OptionsOn(FakeClock& c) {
  OptionsT o;
  o.clock = c.clock();
  return o;
}

}  // namespace pdserve::router

#endif  // PDSERVE_TESTS_ROUTER_FAKE_CLOCK_H_
