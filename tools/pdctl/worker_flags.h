// The engine flags both worker binaries take (--model, --threads, --weights,
// --kv, --block_size, --kv_positions), defined once, and the engine +
// tokenizer they load. Linked by the workers only (pdctl has its own flags).
#ifndef PDSERVE_TOOLS_PDCTL_WORKER_FLAGS_H_
#define PDSERVE_TOOLS_PDCTL_WORKER_FLAGS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "common/tokenizer/tokenizer.h"
#include "tools/pdctl/engine_setup.h"

namespace pdserve::pdctl {

struct WorkerEngine {
  Engine engine;
  std::unique_ptr<tok::Tokenizer> tokenizer;
};

// Loads what the flags name, with the pool's region from `allocator`.
// Errors: INVALID_ARGUMENT without --model; load errors as they come.
absl::StatusOr<WorkerEngine> LoadWorkerEngine(KvRegionAllocator* allocator);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_WORKER_FLAGS_H_
