// The ranks of a tensor-parallel model on the CPU (Model::Load with
// options.tp > 1): ranks 1..N-1 are shards of the same checkpoint (each
// loads only its slices, model/tensor_parallel.h) on their own backends
// and threads; rank 0 is the shard the Model (model/model.h) holds
// itself. All meet in one ThreadCollectiveGroup. A forward runs the same
// batch on every rank (rank 0 on the calling thread), rank r over its pool
// of the KV region
// (KvStorage::Rank); every rank ends with the full logits, and the
// sequences' positions advance once.
//
// Failure: a collective that fails, or a rank's internal error, breaks the
// group; that forward and every later one return the error (the worker
// reports NOT_SERVING with it). A bad batch is refused before any rank
// computes and leaves the group whole.
//
// Thread safety: Run is single-caller, like Model::Forward.
#ifndef PDSERVE_MODEL_TENSOR_PARALLEL_RANKS_H_
#define PDSERVE_MODEL_TENSOR_PARALLEL_RANKS_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv/kv_cache.h"
#include "model/model_shard.h"
#include "kernels/cpu/thread_collective.h"

namespace pdserve {

class TensorParallelRanks {
 public:
  explicit TensorParallelRanks(int tp);
  ~TensorParallelRanks();
  TensorParallelRanks(const TensorParallelRanks&) = delete;
  TensorParallelRanks& operator=(const TensorParallelRanks&) = delete;

  int tp() const { return group_.size(); }
  kernels::cpu::ThreadCollectiveGroup& group() { return group_; }
  // Rank r >= 1's shard, once loaded.
  ModelShard& peer(int r) { return *peers_[r - 1]; }

  // Loads ranks 1..N-1 on backends[0..N-2] and starts their threads.
  absl::Status LoadPeers(const std::string& model_dir, const ModelOptions& options,
                         absl::Span<kernels::Backend* const> backends);

  // The forward of every rank over a batch Model::Forward has checked;
  // `rank0` is the Model's own shard.
  absl::StatusOr<ForwardResult> Run(ModelShard& rank0, const KvStorage& storage,
                                    absl::Span<const ForwardSequence> batch, const ForwardOptions& options);

 private:
  struct Job {
    ModelShard* rank0 = nullptr;
    KvStorage storage;
    absl::Span<const ForwardSequence> batch;
    const ForwardOptions* options = nullptr;
  };
  void RankLoop(int r);
  absl::StatusOr<ForwardResult> RunRank(int r, const Job& job);

  kernels::cpu::ThreadCollectiveGroup group_;
  std::vector<std::unique_ptr<ModelShard>> peers_;  // Ranks 1..N-1.
  std::vector<std::thread> threads_;

  absl::Mutex mu_;
  absl::CondVar changed_;  // A new job, a rank done, or stop.
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;
  Job job_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;  // Ranks 1..N-1 still running the job.
  std::vector<absl::Status> rank_status_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> kv_bytes_read_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pdserve

#endif  // PDSERVE_MODEL_TENSOR_PARALLEL_RANKS_H_
