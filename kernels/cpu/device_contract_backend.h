// The CPU backend's kernels behind a GPU's memory contract: its memory is
// "not host-addressable", so everything a GPU backend makes take another
// path takes it here too — the forward's logits copied out, the KV pool
// outside the transport's registered memory, the handoff's copies through
// the backend on both sides. It computes exactly what the CPU backend
// computes. For tests of the GPU paths on machines without a GPU
// (`--backend=cpu-device`); never for serving.
#ifndef PDSERVE_KERNELS_CPU_DEVICE_CONTRACT_BACKEND_H_
#define PDSERVE_KERNELS_CPU_DEVICE_CONTRACT_BACKEND_H_

#include <memory>
#include <string>
#include <utility>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/forwarding_backend.h"

namespace pdserve::kernels::cpu {

class DeviceContractBackend final : public ForwardingBackend {
 public:
  explicit DeviceContractBackend(std::unique_ptr<CpuBackend> inner)
      : ForwardingBackend(inner.get()), owned_(std::move(inner)) {}

  std::string Name() const override { return "cpu-device/" + owned_->Name(); }
  bool HostAddressable() const override { return false; }

 private:
  std::unique_ptr<CpuBackend> owned_;
};

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_DEVICE_CONTRACT_BACKEND_H_
