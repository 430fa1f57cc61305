#include "common/tensor_parallel_model.h"

#include "absl/strings/str_cat.h"

namespace pdserve {

TensorParallelModel::TensorParallelModel(int tp) : group_(tp), rank_status_(tp) {}

absl::StatusOr<std::unique_ptr<TensorParallelModel>> TensorParallelModel::Load(
    const std::string& model_dir, const ModelOptions& options, absl::Span<kernels::Backend* const> backends) {
  if (backends.empty()) return absl::InvalidArgumentError("tensor parallelism needs at least one rank");
  const int tp = static_cast<int>(backends.size());
  auto model = std::unique_ptr<TensorParallelModel>(new TensorParallelModel(tp));
  for (int r = 0; r < tp; ++r) {
    ModelOptions o = options;
    o.shard = TpShard{r, tp};
    o.collective = &model->group_.rank(r);
    absl::StatusOr<std::unique_ptr<Model>> m = Model::Load(model_dir, o, backends[r]);
    if (!m.ok()) return m.status();
    model->ranks_.push_back(*std::move(m));
  }
  for (int r = 1; r < tp; ++r) model->threads_.emplace_back([m = model.get(), r] { m->RankLoop(r); });
  return model;
}

TensorParallelModel::~TensorParallelModel() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

absl::StatusOr<ForwardResult> TensorParallelModel::RunRank(int r, const Job& job) {
  ForwardOptions o = *job.options;
  o.advance_positions = false;
  // The layer callback (a KV stream) is rank 0's.
  if (r != 0) o.on_layer_kv_written = nullptr;
  absl::StatusOr<ForwardResult> result = ranks_[r]->Forward(job.storages[r], job.batch, o);
  // A rank that fails inside the forward leaves the others waiting in a
  // collective: break the group so they return too.
  if (!result.ok()) group_.Break(result.status());
  return result;
}

void TensorParallelModel::RankLoop(int r) {
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

absl::StatusOr<ForwardResult> TensorParallelModel::Forward(absl::Span<const KvStorage> storages,
                                                           absl::Span<const ForwardSequence> batch,
                                                           const ForwardOptions& options) {
  if (storages.size() != ranks_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(storages.size(), " KV pools for ", ranks_.size(), " tensor-parallel ranks"));
  }
  // A bad batch fails every rank alike before any collective; refuse it
  // here so that the group stays whole.
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (absl::Status s = ranks_[r]->ValidateBatch(storages[r].spec, batch); !s.ok()) return s;
  }
  if (absl::Status s = group_.broken(); !s.ok()) return s;
  const Job job{storages, batch, &options};
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
  if (options.advance_positions) {
    for (const ForwardSequence& seq : batch) {
      seq.kv->SetNumPositions(seq.kv->num_positions() + static_cast<int32_t>(seq.tokens.size()));
    }
  }
  return result;
}

absl::StatusOr<RankKvPools> AllocateRankKvPools(const KvStorage& rank0, int tp, KvRegionAllocator* allocator) {
  HostKvRegionAllocator host;
  if (allocator == nullptr) allocator = &host;
  RankKvPools pools;
  pools.storages.push_back(rank0);
  for (int r = 1; r < tp; ++r) {
    absl::StatusOr<std::unique_ptr<KvRegion>> region =
        allocator->Allocate(static_cast<size_t>(rank0.spec.TotalBytes()));
    if (!region.ok()) return region.status();
    pools.storages.push_back(KvStorage{rank0.spec, static_cast<char*>((*region)->data())});
    pools.regions.push_back(*std::move(region));
  }
  return pools;
}

}  // namespace pdserve
