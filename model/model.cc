#include "model/model.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "model/tensor_parallel_ranks.h"

namespace pdserve {

Model::Model(std::unique_ptr<TensorParallelRanks> ranks, std::unique_ptr<ModelShard> rank0)
    : ranks_(std::move(ranks)), rank0_(std::move(rank0)) {}

Model::~Model() = default;

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& model_dir, const ModelOptions& options,
                                                   kernels::Backend* backend) {
  if (options.tp < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tensor parallelism over ", options.tp, " ranks"));
  }
  if (options.tp == 1) {
    absl::StatusOr<std::unique_ptr<ModelShard>> whole =
        ModelShard::Load(model_dir, options, backend, TpShard{0, 1}, nullptr);
    if (!whole.ok()) return whole.status();
    return std::unique_ptr<Model>(new Model(nullptr, *std::move(whole)));
  }
  if (static_cast<int>(options.rank_backends.size()) != options.tp - 1) {
    return absl::InvalidArgumentError(absl::StrCat("tensor parallelism over ", options.tp, " ranks needs ",
                                                   options.tp - 1, " more backends, got ",
                                                   options.rank_backends.size()));
  }
  auto ranks = std::make_unique<TensorParallelRanks>(options.tp);
  absl::StatusOr<std::unique_ptr<ModelShard>> rank0 =
      ModelShard::Load(model_dir, options, backend, TpShard{0, options.tp}, &ranks->group().rank(0));
  if (!rank0.ok()) return rank0.status();
  if (absl::Status s = ranks->LoadPeers(model_dir, options, options.rank_backends); !s.ok()) return s;
  return std::unique_ptr<Model>(new Model(std::move(ranks), *std::move(rank0)));
}

absl::StatusOr<std::unique_ptr<Model>> Model::CreateRandom(const ModelConfig& config, DType storage, uint64_t seed,
                                                           kernels::Backend* backend) {
  absl::StatusOr<std::unique_ptr<ModelShard>> whole = ModelShard::CreateRandom(config, storage, seed, backend);
  if (!whole.ok()) return whole.status();
  return std::unique_ptr<Model>(new Model(nullptr, *std::move(whole)));
}

kernels::cpu::ThreadCollectiveGroup* Model::tp_group() { return ranks_ ? &ranks_->group() : nullptr; }

size_t Model::WeightBytes() const {
  size_t n = rank0_->WeightBytes();
  for (int r = 1; r < tp(); ++r) n += ranks_->peer(r).WeightBytes();
  return n;
}

size_t Model::WeightBytesPerStep() const {
  size_t n = rank0_->WeightBytesPerStep();
  for (int r = 1; r < tp(); ++r) n += ranks_->peer(r).WeightBytesPerStep();
  return n;
}

absl::StatusOr<ForwardResult> Model::Forward(const KvStorage& kv_storage, absl::Span<const ForwardSequence> batch,
                                             const ForwardOptions& options) {
  // Validate everything before touching the cache.
  if (absl::Status s = ValidateBatch(kv_storage.spec, batch); !s.ok()) return s;
  const int32_t block_size = kv_storage.spec.block_size;
  for (size_t s = 0; s < batch.size(); ++s) {
    const ForwardSequence& seq = batch[s];
    const int64_t end = static_cast<int64_t>(seq.kv->num_positions()) + seq.tokens.size();
    if (end > seq.kv->capacity(block_size)) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s, " needs ", end, " positions of KV but holds ",
                                                     seq.kv->capacity(block_size),
                                                     ": grow it first (KvManager::Grow)"));
    }
  }
  if (ranks_ == nullptr) return rank0_->Forward(kv_storage.Rank(0), batch, options);
  return ranks_->Run(*rank0_, kv_storage, batch, options);
}

absl::StatusOr<ForwardResult> ForwardGrowing(Model& model, KvManager& kv, absl::Span<const ForwardSequence> batch,
                                             const ForwardOptions& options) {
  // A request the caller must fix takes no block.
  if (absl::Status s = model.ValidateBatch(kv.spec(), batch); !s.ok()) return s;
  std::vector<KvManager::GrowRequest> grow;
  grow.reserve(batch.size());
  for (const ForwardSequence& seq : batch) {
    grow.push_back({seq.kv, seq.kv->num_positions() + static_cast<int32_t>(seq.tokens.size())});
  }
  if (absl::Status s = kv.GrowAll(grow); !s.ok()) return s;
  return model.Forward(kv.storage(), batch, options);
}

}  // namespace pdserve
