// A tensor-parallel model on the CPU: N shards of one checkpoint (each rank
// loads only its slices, common/tensor_parallel.h), each on its own backend
// and its own thread, meeting in a ThreadCollectiveGroup. A forward runs
// the same batch on every rank (rank 0 on the calling thread) over each
// rank's own KV pool; every rank ends with the full logits.
//
// KV: rank r's pool holds its KV heads (model(r).MakeKvSpec); all ranks'
// pools use the same block numbering, so one block table (one KvManager)
// addresses them all.
//
// Failure: a collective that fails (or a rank's internal error) breaks the
// group; that forward and every later one return the error, and the worker
// that owns the model reports NOT_SERVING.
//
// Thread safety: Forward is single-caller, like Model::Forward.
#ifndef PDSERVE_COMMON_TENSOR_PARALLEL_MODEL_H_
#define PDSERVE_COMMON_TENSOR_PARALLEL_MODEL_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/kv_cache.h"
#include "common/model.h"
#include "kernels/cpu/thread_collective.h"

namespace pdserve {

class TensorParallelModel {
 public:
  // Loads backends.size() shards of model_dir, rank r on backends[r]
  // (which must outlive the model). `options.shard` and
  // `options.collective` are set here.
  static absl::StatusOr<std::unique_ptr<TensorParallelModel>> Load(const std::string& model_dir,
                                                                   const ModelOptions& options,
                                                                   absl::Span<kernels::Backend* const> backends);
  ~TensorParallelModel();

  int tp() const { return static_cast<int>(ranks_.size()); }
  Model& rank(int r) { return *ranks_[r]; }
  const ModelConfig& config() const { return ranks_[0]->config(); }
  kernels::cpu::ThreadCollectiveGroup& group() { return group_; }

  // Runs the batch on every rank: storages[r] is rank r's pool. The
  // sequences' positions advance once, after every rank is done.
  // Errors: Model::Forward's for a bad batch (no rank has computed), or
  // the group's error.
  absl::StatusOr<ForwardResult> Forward(absl::Span<const KvStorage> storages,
                                        absl::Span<const ForwardSequence> batch,
                                        const ForwardOptions& options = {});

 private:
  struct Job {
    absl::Span<const KvStorage> storages;
    absl::Span<const ForwardSequence> batch;
    const ForwardOptions* options = nullptr;
  };
  explicit TensorParallelModel(int tp);
  void RankLoop(int r);
  absl::StatusOr<ForwardResult> RunRank(int r, const Job& job);

  kernels::cpu::ThreadCollectiveGroup group_;
  std::vector<std::unique_ptr<Model>> ranks_;
  std::vector<std::thread> threads_;  // Ranks 1..N-1.

  absl::Mutex mu_;
  absl::CondVar changed_;  // A new job, a rank done, or stop.
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;
  Job job_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;  // Ranks 1..N-1 still running the job.
  std::vector<absl::Status> rank_status_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

// Pools for ranks 1..N-1 beside a KvManager's (rank 0's): the same spec,
// so its block tables address them too.
struct RankKvPools {
  std::vector<std::unique_ptr<KvRegion>> regions;
  std::vector<KvStorage> storages;  // [rank 0's, then the regions']
};
absl::StatusOr<RankKvPools> AllocateRankKvPools(const KvStorage& rank0, int tp,
                                                KvRegionAllocator* allocator = nullptr);

}  // namespace pdserve

#endif  // PDSERVE_COMMON_TENSOR_PARALLEL_MODEL_H_
