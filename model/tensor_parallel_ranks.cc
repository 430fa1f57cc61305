#include "model/tensor_parallel_ranks.h"

#include "absl/strings/str_cat.h"

namespace pdserve {

TensorParallelRanks::TensorParallelRanks(int tp) : group_(tp), rank_status_(tp), kv_bytes_read_(tp, 0) {}

absl::Status TensorParallelRanks::LoadPeers(const std::string& model_dir, const ModelOptions& options,
                                            absl::Span<kernels::Backend* const> backends) {
  for (int r = 1; r < tp(); ++r) {
    absl::StatusOr<std::unique_ptr<ModelShard>> m =
        ModelShard::Load(model_dir, options, backends[r - 1], TpShard{r, tp()}, &group_.rank(r));
    if (!m.ok()) return m.status();
    peers_.push_back(*std::move(m));
  }
  for (int r = 1; r < tp(); ++r) threads_.emplace_back([this, r] { RankLoop(r); });
  return absl::OkStatus();
}

TensorParallelRanks::~TensorParallelRanks() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

absl::StatusOr<ForwardResult> TensorParallelRanks::RunRank(int r, const Job& job) {
  ForwardOptions o = *job.options;
  o.advance_positions = false;
  // The layer callback (a KV stream) is rank 0's: it runs after rank 0's
  // layer, and the handoff reads every rank's pool.
  if (r != 0) o.on_layer_kv_written = nullptr;
  ModelShard& model = r == 0 ? *job.rank0 : peer(r);
  const bool streaming = job.options->on_layer_kv_written != nullptr;
  // Head-sharded: rank r's own pool; request-sharded: the one pool, each
  // rank in its block range.
  const KvStorage storage = job.storage.spec.request_ranks > 1 ? job.storage : job.storage.Rank(r);
  absl::StatusOr<ForwardResult> result = model.Forward(storage, job.batch, o, streaming);
  if (result.ok()) {
    absl::MutexLock lock(&mu_);
    kv_bytes_read_[r] = result->kv_bytes_read;
  }
  // A rank that fails inside the forward leaves the others waiting in a
  // collective: break the group so they return too.
  if (!result.ok()) group_.Break(result.status());
  return result;
}

void TensorParallelRanks::RankLoop(int r) {
  uint64_t seen = 0;
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && job_id_ == seen) changed_.Wait(&mu_);
      if (stop_) return;
      seen = job_id_;
      job = job_;
    }
    absl::StatusOr<ForwardResult> result = RunRank(r, job);
    absl::MutexLock lock(&mu_);
    rank_status_[r] = result.status();
    if (--pending_ == 0) changed_.SignalAll();
  }
}

absl::StatusOr<ForwardResult> TensorParallelRanks::Run(ModelShard& rank0, const KvStorage& storage,
                                                       absl::Span<const ForwardSequence> batch,
                                                       const ForwardOptions& options) {
  if (absl::Status s = group_.broken(); !s.ok()) return s;
  const Job job{&rank0, storage, batch, &options};
  {
    absl::MutexLock lock(&mu_);
    job_ = job;
    pending_ = tp() - 1;
    ++job_id_;
    changed_.SignalAll();
  }
  absl::StatusOr<ForwardResult> result = RunRank(0, job);
  absl::Status others;
  {
    absl::MutexLock lock(&mu_);
    while (pending_ > 0) changed_.Wait(&mu_);
    for (int r = 1; r < tp(); ++r) {
      if (others.ok() && !rank_status_[r].ok()) others = rank_status_[r];
    }
  }
  if (!result.ok()) return result.status();
  if (!others.ok()) return others;
  {
    // Every rank's attention reads.
    absl::MutexLock lock(&mu_);
    for (int r = 1; r < tp(); ++r) result->kv_bytes_read += kv_bytes_read_[r];
  }
  if (options.advance_positions) {
    for (const ForwardSequence& seq : batch) {
      seq.kv->SetNumPositions(seq.kv->num_positions() + static_cast<int32_t>(seq.tokens.size()));
    }
  }
  return result;
}

}  // namespace pdserve
