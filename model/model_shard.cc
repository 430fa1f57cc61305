#include "model/model_shard.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "model/checkpoint.h"
#include "kernels/device_array.h"

namespace pdserve {

struct ModelShard::Layer {
  kernels::DeviceArray<float> input_norm;
  kernels::DeviceArray<float> post_norm;
  kernels::DeviceArray<float> qkv_bias;  // Empty unless the architecture has q/k/v biases.
  std::unique_ptr<kernels::LinearWeight> qkv;      // [Qd + 2 KVd, D]
  std::unique_ptr<kernels::LinearWeight> o;        // [D, Qd]
  std::unique_ptr<kernels::LinearWeight> gate_up;  // [2F, D]: gate rows then up rows
  std::unique_ptr<kernels::LinearWeight> down;     // [D, F]
};

namespace {

std::vector<float> ToF32(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.NumElements()));
  ConvertToF32(t.dtype, t.data, out.size(), out.data());
  return out;
}

// Rows [first, first + count) of a matrix.
kernels::MatrixPart Rows(const TensorView& t, int64_t first, int64_t count) {
  const int64_t width = t.shape[1];
  return {t.dtype, static_cast<const char*>(t.data) + first * width * DTypeSize(t.dtype), count};
}

// Columns from `first` on of a matrix (as many as the packed K says), every row.
kernels::MatrixPart Cols(const TensorView& t, int64_t first) {
  return {t.dtype, static_cast<const char*>(t.data) + first * DTypeSize(t.dtype), t.shape[0], t.shape[1]};
}

// Elements [first, first + count) of a tensor, as F32.
std::vector<float> SliceToF32(const TensorView& t, int64_t first, int64_t count) {
  std::vector<float> out(static_cast<size_t>(count));
  ConvertToF32(t.dtype, static_cast<const char*>(t.data) + first * DTypeSize(t.dtype), out.size(), out.data());
  return out;
}

// Host values into a new array in the backend's memory.
absl::StatusOr<kernels::DeviceArray<float>> Upload(kernels::Backend* backend, absl::Span<const float> v) {
  kernels::DeviceArray<float> a(backend);
  if (absl::Status s = a.Assign(v); !s.ok()) return s;
  return a;
}

}  // namespace

ModelShard::ModelShard(ModelConfig config, kernels::Backend* backend)
    : config_(std::move(config)),
      backend_(backend),
      final_norm_(backend),
      rope_(config_),
      rope_cos_(backend),
      rope_sin_(backend),
      x_(backend),
      xn_(backend),
      qkv_(backend),
      q_(backend),
      k_(backend),
      v_(backend),
      attn_(backend),
      gate_up_(backend),
      act_(backend),
      partial_(backend),
      vocab_slices_(backend),
      logits_(backend),
      all_qkv_(backend),
      all_q_(backend),
      all_k_(backend),
      all_v_(backend),
      all_attn_(backend) {}

ModelShard::~ModelShard() = default;

absl::StatusOr<std::unique_ptr<ModelShard>> ModelShard::CreateRandom(const ModelConfig& config, DType storage,
                                                         uint64_t seed, kernels::Backend* backend) {
  if (storage != DType::kF32 && storage != DType::kBF16 && storage != DType::kI8) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights cannot be held as ", DTypeName(storage), " (f32, bf16 or int8)"));
  }
  if (config.num_layers < 1 || config.hidden_size < 1 || config.vocab_size < 1 || config.num_heads < 1 ||
      config.num_kv_heads < 1 || config.num_heads % config.num_kv_heads != 0 || config.head_dim < 2 ||
      config.head_dim % 2 != 0 || config.intermediate_size < 1) {
    return absl::InvalidArgumentError("a random model needs a whole Llama shape (layers, hidden, heads, FFN, vocab)");
  }
  absl::StatusOr<ShardRanges> ranges = ComputeShardRanges(config, TpShard{0, 1});
  if (!ranges.ok()) return ranges.status();
  auto model = std::unique_ptr<ModelShard>(new ModelShard(config, backend));
  model->ranges_ = *ranges;
  model->weight_dtype_ = storage;
  const ModelConfig& c = model->config_;
  const int64_t D = c.hidden_size, F = c.intermediate_size, Qd = c.QDim(), KVd = c.KvDim();
  uint64_t next = seed;
  auto random = [&](int64_t n, int64_t k) {
    next += 0x1000193;
    return backend->RandomLinear(n, k, storage, 1.0f / std::sqrt(static_cast<float>(k)), next);
  };
  auto embed = backend->RandomEmbedding(c.vocab_size, D, storage, 1.0f, seed);
  if (!embed.ok()) return embed.status();
  model->embed_ = *std::move(embed);
  const std::vector<float> ones(static_cast<size_t>(D), 1.0f);
  model->layers_.resize(c.num_layers);
  for (Layer& layer : model->layers_) {
    auto in_norm = Upload(backend, ones);
    auto post_norm = Upload(backend, ones);
    if (!in_norm.ok()) return in_norm.status();
    if (!post_norm.ok()) return post_norm.status();
    layer.input_norm = *std::move(in_norm);
    layer.post_norm = *std::move(post_norm);
    if (c.qkv_bias) {
      auto bias = Upload(backend, std::vector<float>(static_cast<size_t>(Qd + 2 * KVd), 0.0f));
      if (!bias.ok()) return bias.status();
      layer.qkv_bias = *std::move(bias);
    }
    auto qkv = random(Qd + 2 * KVd, D);
    auto o = random(D, Qd);
    auto gu = random(2 * F, D);
    auto down = random(D, F);
    for (const auto* t : {&qkv, &o, &gu, &down}) {
      if (!t->ok()) return t->status();
    }
    layer.qkv = *std::move(qkv);
    layer.o = *std::move(o);
    layer.gate_up = *std::move(gu);
    layer.down = *std::move(down);
  }
  auto final_norm = Upload(backend, ones);
  if (!final_norm.ok()) return final_norm.status();
  model->final_norm_ = *std::move(final_norm);
  auto head = random(c.vocab_size, D);
  if (!head.ok()) return head.status();
  model->lm_head_ = *std::move(head);
  model->identity_ = HashBytes(absl::StrCat("random\n", c.num_layers, " ", D, " ", F, " ", c.num_heads, " ",
                                            c.num_kv_heads, " ", c.head_dim, " ", c.vocab_size, " ", c.rope_theta,
                                            "\n", DTypeName(storage), "\n", seed));
  return model;
}

absl::StatusOr<std::unique_ptr<ModelShard>> ModelShard::Load(const std::string& model_dir, const ModelOptions& options,
                                                        kernels::Backend* backend, TpShard shard,
                                                        kernels::Collective* collective) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(model_dir);
  if (!config.ok()) return config.status();
  const int64_t g = config->GroupSize();
  if (g > 64 || g * config->head_dim > 8192) {
    return absl::InvalidArgumentError(absl::StrCat(
        model_dir, "/config.json: ", g, " query heads per KV head of dim ", config->head_dim,
        " exceed the attention kernel's limits (64 heads, 8192 values)"));
  }
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(model_dir);
  if (!ckpt.ok()) return ckpt.status();

  DType storage = DType::kF32;
  if (options.weight_dtype.has_value()) {
    storage = *options.weight_dtype;
    if (storage != DType::kF32 && storage != DType::kBF16 && storage != DType::kI8) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights cannot be held as ", DTypeName(storage), " (f32, bf16 or int8)"));
    }
  } else if ((*ckpt)->Has("model.embed_tokens.weight")) {
    absl::StatusOr<const TensorView*> probe =
        (*ckpt)->Take("model.embed_tokens.weight", {config->vocab_size, config->hidden_size});
    if (!probe.ok()) return probe.status();
    if ((*probe)->dtype == DType::kBF16) storage = DType::kBF16;
  }
  absl::StatusOr<ShardRanges> ranges = ComputeShardRanges(*config, shard);
  if (!ranges.ok()) return absl::InvalidArgumentError(absl::StrCat(model_dir, ": ", ranges.status().message()));
  auto model = std::unique_ptr<ModelShard>(new ModelShard(*std::move(config), backend));
  model->ranges_ = *ranges;
  model->collective_ = collective;
  if (absl::Status s = model->LoadWeights(**ckpt, storage); !s.ok()) return s;
  absl::StatusOr<std::string> config_text = ReadFileToString(model_dir + "/config.json");
  if (!config_text.ok()) return config_text.status();
  model->identity_ = HashBytes(absl::StrCat(*config_text, "\n", DTypeName(storage), "\n",
                                            (*ckpt)->Fingerprint()));
  return model;
}

absl::Status ModelShard::LoadWeights(Checkpoint& ckpt, DType storage) {
  weight_dtype_ = storage;
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size, F = c.intermediate_size;
  const int64_t Qd = c.QDim(), KVd = c.KvDim(), Hd = c.head_dim;
  const IndexRange q_heads = ranges_.q_heads, kv_heads = ranges_.kv_heads, ffn = ranges_.ffn;

  absl::StatusOr<const TensorView*> embed = ckpt.Take("model.embed_tokens.weight", {c.vocab_size, D});
  if (!embed.ok()) return embed.status();
  // This rank's vocabulary rows only.
  const IndexRange vocab = ranges_.vocab;
  absl::StatusOr<std::unique_ptr<kernels::EmbeddingTable>> table =
      backend_->PackEmbedding(Rows(**embed, vocab.begin, vocab.size()), D, storage);
  if (!table.ok()) return table.status();
  embed_ = *std::move(table);

  layers_.resize(c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    Layer& layer = layers_[l];
    const std::string p = absl::StrCat("model.layers.", l, ".");
    auto take = [&](const std::string& name, std::vector<int64_t> shape) {
      return ckpt.Take(p + name, shape);
    };
    auto in_norm = take("input_layernorm.weight", {D});
    auto post_norm = take("post_attention_layernorm.weight", {D});
    auto q = take("self_attn.q_proj.weight", {Qd, D});
    auto k = take("self_attn.k_proj.weight", {KVd, D});
    auto v = take("self_attn.v_proj.weight", {KVd, D});
    auto o = take("self_attn.o_proj.weight", {D, Qd});
    auto gate = take("mlp.gate_proj.weight", {F, D});
    auto up = take("mlp.up_proj.weight", {F, D});
    auto down = take("mlp.down_proj.weight", {D, F});
    for (const auto* t : {&in_norm, &post_norm, &q, &k, &v, &o, &gate, &up, &down}) {
      if (!t->ok()) return t->status();
    }
    auto in_norm_dev = Upload(backend_, ToF32(**in_norm));
    auto post_norm_dev = Upload(backend_, ToF32(**post_norm));
    if (!in_norm_dev.ok()) return in_norm_dev.status();
    if (!post_norm_dev.ok()) return post_norm_dev.status();
    layer.input_norm = *std::move(in_norm_dev);
    layer.post_norm = *std::move(post_norm_dev);
    if (c.qkv_bias) {
      auto qb = take("self_attn.q_proj.bias", {Qd});
      auto kb = take("self_attn.k_proj.bias", {KVd});
      auto vb = take("self_attn.v_proj.bias", {KVd});
      for (const auto* t : {&qb, &kb, &vb}) {
        if (!t->ok()) return t->status();
      }
      const std::pair<const TensorView*, IndexRange> slices[] = {
          {*qb, {q_heads.begin * Hd, q_heads.end * Hd}},
          {*kb, {kv_heads.begin * Hd, kv_heads.end * Hd}},
          {*vb, {kv_heads.begin * Hd, kv_heads.end * Hd}}};
      std::vector<float> bias;
      for (const auto& [t, range] : slices) {
        std::vector<float> b = SliceToF32(*t, range.begin, range.size());
        bias.insert(bias.end(), b.begin(), b.end());
      }
      auto bias_dev = Upload(backend_, bias);
      if (!bias_dev.ok()) return bias_dev.status();
      layer.qkv_bias = *std::move(bias_dev);
    }
    // Older checkpoints carry a RoPE buffer; it is recomputed, not loaded.
    if (ckpt.Has(p + "self_attn.rotary_emb.inv_freq")) ckpt.Ignore(p + "self_attn.rotary_emb.inv_freq");

    // Column-parallel q/k/v, gate and up: this rank's output rows;
    // row-parallel o and down: its input columns.
    const kernels::MatrixPart qkv_parts[] = {Rows(**q, q_heads.begin * Hd, q_heads.size() * Hd),
                                             Rows(**k, kv_heads.begin * Hd, kv_heads.size() * Hd),
                                             Rows(**v, kv_heads.begin * Hd, kv_heads.size() * Hd)};
    const kernels::MatrixPart gu_parts[] = {Rows(**gate, ffn.begin, ffn.size()), Rows(**up, ffn.begin, ffn.size())};
    const kernels::MatrixPart o_part[] = {Cols(**o, q_heads.begin * Hd)};
    const kernels::MatrixPart down_part[] = {Cols(**down, ffn.begin)};
    auto qkv_w = backend_->PackLinear(qkv_parts, D, storage);
    auto o_w = backend_->PackLinear(o_part, q_heads.size() * Hd, storage);
    auto gu_w = backend_->PackLinear(gu_parts, D, storage);
    auto down_w = backend_->PackLinear(down_part, ffn.size(), storage);
    for (const auto* t : {&qkv_w, &o_w, &gu_w, &down_w}) {
      if (!t->ok()) return t->status();
    }
    layer.qkv = *std::move(qkv_w);
    layer.o = *std::move(o_w);
    layer.gate_up = *std::move(gu_w);
    layer.down = *std::move(down_w);
  }

  auto norm = ckpt.Take("model.norm.weight", {D});
  if (!norm.ok()) return norm.status();
  auto final_norm = Upload(backend_, ToF32(**norm));
  if (!final_norm.ok()) return final_norm.status();
  final_norm_ = *std::move(final_norm);

  const TensorView* head = *embed;
  if (!c.tie_word_embeddings) {
    auto lm = ckpt.Take("lm_head.weight", {c.vocab_size, D});
    if (!lm.ok()) return lm.status();
    head = *lm;
  } else if (ckpt.Has("lm_head.weight")) {
    ckpt.Ignore("lm_head.weight");  // A tied copy; the embedding is used.
  }
  const kernels::MatrixPart head_part[] = {Rows(*head, vocab.begin, vocab.size())};
  auto head_w = backend_->PackLinear(head_part, D, storage);
  if (!head_w.ok()) return head_w.status();
  lm_head_ = *std::move(head_w);
  return ckpt.CheckAllTaken();
}

size_t ModelShard::WeightBytes() const {
  size_t n = embed_->bytes() + lm_head_->bytes() + final_norm_.size() * 4;
  for (const Layer& l : layers_) {
    n += l.qkv->bytes() + l.o->bytes() + l.gate_up->bytes() + l.down->bytes() +
         (l.input_norm.size() + l.post_norm.size() + l.qkv_bias.size()) * 4;
  }
  return n;
}

size_t ModelShard::WeightBytesPerStep() const {
  size_t n = lm_head_->bytes() + final_norm_.size() * 4 +
             static_cast<size_t>(config_.hidden_size) * DTypeSize(weight_dtype_);
  for (const Layer& l : layers_) {
    n += l.qkv->bytes() + l.o->bytes() + l.gate_up->bytes() + l.down->bytes() +
         (l.input_norm.size() + l.post_norm.size() + l.qkv_bias.size()) * 4;
  }
  return n;
}

KvCacheSpec ModelShard::MakeKvSpec(DType kv_dtype, int32_t block_size, int32_t num_blocks, TpKvLayout layout) const {
  KvCacheSpec s;
  s.num_layers = static_cast<int32_t>(config_.num_layers);
  s.model_kv_heads = static_cast<int32_t>(config_.num_kv_heads);
  if (layout == TpKvLayout::kRequestSharded) {
    s.num_kv_heads = s.model_kv_heads;
    s.request_ranks = tp();
    num_blocks = (num_blocks + tp() - 1) / tp() * tp();
  } else {
    s.num_kv_heads = static_cast<int32_t>(ranges_.kv_heads.size());
    s.num_ranks = tp();
  }
  s.head_dim = static_cast<int32_t>(config_.head_dim);
  s.block_size = block_size;
  s.dtype = kv_dtype;
  s.num_blocks = num_blocks;
  return s;
}

absl::Status ModelShard::ValidateBatch(const KvCacheSpec& spec, absl::Span<const ForwardSequence> batch) const {
  const ModelConfig& c = config_;
  const bool request_sharded = spec.request_ranks > 1;
  const bool heads_match = request_sharded ? spec.request_ranks == tp() && spec.num_ranks == 1 &&
                                                 spec.num_kv_heads == c.num_kv_heads
                                           : spec.num_kv_heads == ranges_.kv_heads.size() && spec.num_ranks == tp();
  if (spec.num_layers != c.num_layers || !heads_match || spec.ModelKvHeads() != c.num_kv_heads ||
      spec.head_dim != c.head_dim) {
    return absl::InvalidArgumentError("KV spec does not match the model");
  }
  if (request_sharded) {
    for (size_t s = 0; s < batch.size(); ++s) {
      if (batch[s].kv == nullptr) continue;  // Refused below.
      for (int32_t b : batch[s].kv->block_table()) {
        if (spec.RankOfBlock(b) != batch[s].kv->rank()) {
          return absl::InvalidArgumentError(absl::StrCat("sequence ", s, " of rank ", batch[s].kv->rank(),
                                                         " holds block ", b, " of rank ", spec.RankOfBlock(b)));
        }
      }
    }
  }
  for (size_t s = 0; s < batch.size(); ++s) {
    const ForwardSequence& seq = batch[s];
    if (seq.kv == nullptr || seq.tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s, " of the batch has no tokens"));
    }
    for (int32_t t : seq.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", t, " in sequence ", s,
                                                       " is outside the vocabulary [0, ",
                                                       c.vocab_size, ")"));
      }
    }
    const int64_t end = static_cast<int64_t>(seq.kv->num_positions()) + seq.tokens.size();
    if (end > c.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", s, " would reach ", end, " positions, past max_position_embeddings ",
          c.max_position_embeddings));
    }
  }
  return absl::OkStatus();
}

struct ModelShard::StepRows {
  int64_t tokens = 0;
  std::vector<int32_t> positions, blocks, slots, ids;
  std::vector<kernels::AttentionSequence> sequences;  // the batch's, in order
  // Those this rank attends for: every sequence when heads are sharded (or
  // nothing is); with request-sharded KV, the ones in its block range.
  std::vector<kernels::AttentionSequence> own_sequences;
  std::vector<int64_t> logit_rows;
  bool request_sharded = false;
};

absl::StatusOr<ForwardResult> ModelShard::Forward(const KvStorage& kv_storage, absl::Span<const ForwardSequence> batch,
                                                  const ForwardOptions& options, bool sync_layer_kv) {
  StepRows rows;
  ForwardResult result;
  if (absl::Status s = BeginStep(kv_storage, batch, rows, result); !s.ok()) return s;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    if (absl::Status s = AttentionHalf(l, kv_storage, rows, options, sync_layer_kv, result); !s.ok()) return s;
    if (absl::Status s = MlpHalf(l, rows.tokens); !s.ok()) return s;
  }
  if (options.advance_positions) {
    for (size_t s = 0; s < batch.size(); ++s) {
      SequenceKv& kv = *batch[s].kv;
      kv.SetNumPositions(kv.num_positions() + static_cast<int32_t>(batch[s].tokens.size()));
    }
  }
  if (absl::Status s = EndStep(rows, result); !s.ok()) return s;
  return result;
}

absl::Status ModelShard::BeginStep(const KvStorage& kv_storage, absl::Span<const ForwardSequence> batch, StepRows& rows,
                              ForwardResult& result) {
  const ModelConfig& c = config_;
  const KvCacheSpec& spec = kv_storage.spec;
  int64_t T = 0;
  int32_t max_end = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const ForwardSequence& seq = batch[s];
    const int64_t end = static_cast<int64_t>(seq.kv->num_positions()) + seq.tokens.size();
    T += static_cast<int64_t>(seq.tokens.size());
    max_end = std::max<int32_t>(max_end, static_cast<int32_t>(end));
  }
  rope_.EnsurePositions(max_end);
  if (rope_uploaded_ != rope_.num_positions()) {
    // The tables grew (or are new): the backend's copies follow.
    const size_t n = static_cast<size_t>(rope_.num_positions()) * (config_.head_dim / 2);
    if (absl::Status s = rope_cos_.Assign(absl::MakeConstSpan(rope_.cos(), n)); !s.ok()) return s;
    if (absl::Status s = rope_sin_.Assign(absl::MakeConstSpan(rope_.sin(), n)); !s.ok()) return s;
    rope_uploaded_ = rope_.num_positions();
  }

  // This rank's share (all of it unsharded).
  const int64_t D = c.hidden_size, F = ranges_.ffn.size();
  const int32_t H = static_cast<int32_t>(c.head_dim);
  const int64_t Qd = static_cast<int64_t>(ranges_.q_heads.size()) * H;
  const int64_t KVd = static_cast<int64_t>(ranges_.kv_heads.size()) * H;
  const int32_t bs = spec.block_size;
  for (auto [a, n] : {std::pair{&x_, T * D}, {&xn_, T * D}, {&qkv_, T * (Qd + 2 * KVd)}, {&q_, T * Qd},
                      {&k_, T * KVd}, {&v_, T * KVd}, {&attn_, T * Qd}, {&gate_up_, T * 2 * F}, {&act_, T * F}}) {
    if (absl::Status s = a->Grow(static_cast<size_t>(n)); !s.ok()) return s;
  }

  rows.tokens = T;
  rows.positions.resize(T);
  rows.blocks.resize(T);
  rows.slots.resize(T);
  rows.ids.resize(T);
  rows.sequences.resize(batch.size());
  result.vocab_size = c.vocab_size;
  int64_t row = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const ForwardSequence& seq = batch[s];
    const int32_t s0 = seq.kv->num_positions();
    const int32_t m = static_cast<int32_t>(seq.tokens.size());
    rows.sequences[s] = {absl::MakeConstSpan(seq.kv->block_table()), s0, m, static_cast<int32_t>(row)};
    result.first_row.push_back(static_cast<int32_t>(rows.logit_rows.size()));
    for (int32_t i = 0; i < m; ++i, ++row) {
      const int32_t pos = s0 + i;
      rows.positions[row] = pos;
      rows.blocks[row] = seq.kv->block_table()[pos / bs];
      rows.slots[row] = pos % bs;
      // Row of this rank's vocabulary slice; another rank's token embeds
      // as zeros, and the all-reduce below makes it every rank's.
      rows.ids[row] = seq.tokens[i] - static_cast<int32_t>(ranges_.vocab.begin);
      if (seq.logits == LogitsMode::kAll || (seq.logits == LogitsMode::kLast && i == m - 1)) {
        rows.logit_rows.push_back(row);
      }
    }
    result.num_rows.push_back(static_cast<int32_t>(rows.logit_rows.size()) - result.first_row.back());
  }
  backend_->Embed(*embed_, rows.ids.data(), T, x_.data());
  if (ranges_.shard.size > 1) {
    if (absl::Status s = collective_->AllReduceSum(x_.data(), T * D); !s.ok()) return s;
  }

  // Request-sharded KV (spec.request_ranks > 1): this rank attends only for
  // the sequences in its block range, over every head.
  rows.request_sharded = spec.request_ranks > 1;
  if (rows.request_sharded) {
    for (size_t s = 0; s < batch.size(); ++s) {
      if (batch[s].kv->rank() == ranges_.shard.rank) rows.own_sequences.push_back(rows.sequences[s]);
    }
    for (auto [a, n] : {std::pair{&all_qkv_, T * (c.QDim() + 2 * c.KvDim())}, {&all_q_, T * c.QDim()},
                        {&all_k_, T * c.KvDim()}, {&all_v_, T * c.KvDim()}, {&all_attn_, T * c.QDim()}}) {
      if (absl::Status s = a->Grow(static_cast<size_t>(n)); !s.ok()) return s;
    }
  } else {
    rows.own_sequences = rows.sequences;
  }
  return absl::OkStatus();
}

absl::Status ModelShard::AttentionHalf(int64_t l, const KvStorage& kv_storage, const StepRows& rows,
                                  const ForwardOptions& options, bool sync_layer_kv, ForwardResult& result) {
  const ModelConfig& c = config_;
  const int64_t T = rows.tokens, D = c.hidden_size;
  const int32_t H = static_cast<int32_t>(c.head_dim);
  const int32_t num_heads = static_cast<int32_t>(ranges_.q_heads.size());
  const int32_t num_kv_heads = static_cast<int32_t>(ranges_.kv_heads.size());
  const int64_t Qd = num_heads * H, KVd = num_kv_heads * H;
  const bool request_sharded = rows.request_sharded;
  const float eps = static_cast<float>(c.rms_norm_eps);
  constexpr size_t kF = sizeof(float);
  const Layer& layer = layers_[l];
  backend_->RmsNorm(x_.data(), layer.input_norm.data(), T, D, eps, xn_.data());
  backend_->Linear(*layer.qkv, xn_.data(), T, layer.qkv_bias.empty() ? nullptr : layer.qkv_bias.data(), qkv_.data(),
                   false);
  const int64_t ld = Qd + 2 * KVd;
  backend_->Copy2D(q_.data(), Qd * kF, qkv_.data(), ld * kF, Qd * kF, T);
  backend_->Copy2D(k_.data(), KVd * kF, qkv_.data() + Qd, ld * kF, KVd * kF, T);
  backend_->Copy2D(v_.data(), KVd * kF, qkv_.data() + Qd + KVd, ld * kF, KVd * kF, T);
  backend_->Rope(q_.data(), T, num_heads, H, rows.positions.data(), rope_cos_.data(), rope_sin_.data());
  backend_->Rope(k_.data(), T, num_kv_heads, H, rows.positions.data(), rope_cos_.data(), rope_sin_.data());
  const kernels::KvLayerView kv = kv_storage.LayerView(static_cast<int32_t>(l));
  if (request_sharded) {
    // Every head of every row, then this rank's requests' new KV.
    if (absl::Status s = GatherAllHeads(T); !s.ok()) return s;
    for (const kernels::AttentionSequence& seq : rows.own_sequences) {
      const int64_t at = seq.row_offset;
      backend_->WriteKv(kv, static_cast<int32_t>(c.num_kv_heads), H, all_k_.data() + at * c.KvDim(),
                        all_v_.data() + at * c.KvDim(), seq.num_new, rows.blocks.data() + at,
                        rows.slots.data() + at);
    }
  } else {
    backend_->WriteKv(kv, num_kv_heads, H, k_.data(), v_.data(), T, rows.blocks.data(), rows.slots.data());
  }
  if (sync_layer_kv) {
    if (absl::Status s = collective_->Barrier(); !s.ok()) return s;
  }
  if (options.on_layer_kv_written) {
    // The layer's KV must be in the pool before a handoff reads it.
    backend_->Synchronize();
    options.on_layer_kv_written(static_cast<int32_t>(l));
  }
  // Head-sharded: this rank's heads of every row; request-sharded: every
  // head of its own requests' rows (the other rows stay zero).
  if (request_sharded) backend_->Zero(all_attn_.data(), T * c.QDim() * kF);
  if (!rows.own_sequences.empty()) {
    const auto attention_start = std::chrono::steady_clock::now();
    backend_->Attention(kernels::AttentionBatch{
        .q = request_sharded ? all_q_.data() : q_.data(),
        .out = request_sharded ? all_attn_.data() : attn_.data(),
        .sequences = rows.own_sequences,
        .kv = kv,
        .num_heads = request_sharded ? static_cast<int32_t>(c.num_heads) : num_heads,
        .num_kv_heads = request_sharded ? static_cast<int32_t>(c.num_kv_heads) : num_kv_heads,
        .head_dim = H,
        .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H))),
        .group_shared_blocks = options.group_shared_kv,
        .kv_bytes_read = &result.kv_bytes_read,
        .same_sequences_as_previous = l > 0,
    });
    result.attention_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - attention_start).count();
    // The next layer attends over the same sequences: its KV may come
    // closer while this layer's MLP and its QKV product run.
    if (l + 1 < c.num_layers) {
      backend_->PrefetchKv(kv_storage.LayerView(static_cast<int32_t>(l + 1)), rows.own_sequences);
    }
  }
  if (request_sharded) {
    if (absl::Status s = TakeOwnHeads(T); !s.ok()) return s;
  }
  return RowParallel(*layers_[l].o, attn_.data(), T, x_.data());
}

absl::Status ModelShard::MlpHalf(int64_t l, int64_t rows) {
  const Layer& layer = layers_[l];
  const int64_t D = config_.hidden_size, F = ranges_.ffn.size();
  backend_->RmsNorm(x_.data(), layer.post_norm.data(), rows, D, static_cast<float>(config_.rms_norm_eps), xn_.data());
  backend_->Linear(*layer.gate_up, xn_.data(), rows, nullptr, gate_up_.data(), false);
  backend_->SiluMul(gate_up_.data(), rows, F, act_.data());
  return RowParallel(*layer.down, act_.data(), rows, x_.data());
}

absl::Status ModelShard::EndStep(const StepRows& rows, ForwardResult& result) {
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size;
  constexpr size_t kF = sizeof(float);
  const std::vector<int64_t>& logit_rows = rows.logit_rows;
  const int64_t R = static_cast<int64_t>(logit_rows.size());
  result.logits.resize(R * c.vocab_size);
  if (R > 0) {
    // The logit rows into xn_, consecutive rows in one copy.
    for (int64_t i = 0; i < R;) {
      int64_t n = 1;
      while (i + n < R && logit_rows[i + n] == logit_rows[i] + n) ++n;
      backend_->Copy2D(xn_.data() + i * D, D * kF, x_.data() + logit_rows[i] * D, D * kF, n * D * kF, 1);
      i += n;
    }
    backend_->RmsNorm(xn_.data(), final_norm_.data(), R, D, static_cast<float>(c.rms_norm_eps), xn_.data());
    // Host-addressable memory takes the logits in place.
    float* logits = result.logits.data();
    if (!backend_->HostAddressable()) {
      if (absl::Status s = logits_.Grow(R * c.vocab_size); !s.ok()) return s;
      logits = logits_.data();
    }
    if (ranges_.shard.size <= 1) {
      backend_->Linear(*lm_head_, xn_.data(), R, nullptr, logits, false);
    } else if (absl::Status s = GatherLogits(R, logits); !s.ok()) {
      return s;
    }
    if (!backend_->HostAddressable()) {
      backend_->CopyToHost(result.logits.data(), logits, R * c.vocab_size * kF);
    }
  } else {
    backend_->Synchronize();
  }
  return backend_->status();
}

absl::Status ModelShard::GatherAllHeads(int64_t T) {
  const ModelConfig& c = config_;
  constexpr size_t kF = sizeof(float);
  const int64_t H = c.head_dim, q_all = c.QDim(), kv_all = c.KvDim(), width = q_all + 2 * kv_all;
  const int64_t Qd = ranges_.q_heads.size() * H, KVd = ranges_.kv_heads.size() * H;
  const int64_t q_at = ranges_.q_heads.begin * H, kv_at = ranges_.kv_heads.begin * H;
  // Each rank writes its heads (a replicated KV head by its first rank
  // only) into zeros; the sum (exact: the others add zeros) gives every
  // rank all of them.
  backend_->Zero(all_qkv_.data(), T * width * kF);
  const bool writes_kv = ranges_.shard.rank % ranges_.kv_copies == 0;
  float* rows = all_qkv_.data();
  backend_->Copy2D(rows + q_at, width * kF, q_.data(), Qd * kF, Qd * kF, T);
  if (writes_kv) {
    backend_->Copy2D(rows + q_all + kv_at, width * kF, k_.data(), KVd * kF, KVd * kF, T);
    backend_->Copy2D(rows + q_all + kv_all + kv_at, width * kF, v_.data(), KVd * kF, KVd * kF, T);
  }
  if (absl::Status s = collective_->AllReduceSum(all_qkv_.data(), T * width); !s.ok()) return s;
  backend_->Copy2D(all_q_.data(), q_all * kF, rows, width * kF, q_all * kF, T);
  backend_->Copy2D(all_k_.data(), kv_all * kF, rows + q_all, width * kF, kv_all * kF, T);
  backend_->Copy2D(all_v_.data(), kv_all * kF, rows + q_all + kv_all, width * kF, kv_all * kF, T);
  return absl::OkStatus();
}

absl::Status ModelShard::TakeOwnHeads(int64_t T) {
  constexpr size_t kF = sizeof(float);
  const int64_t H = config_.head_dim, q_all = config_.QDim();
  const int64_t Qd = ranges_.q_heads.size() * H, q_at = ranges_.q_heads.begin * H;
  // Every row's output (each rank computed its requests' rows), then this
  // rank's heads of it for the row-parallel o projection.
  if (absl::Status s = collective_->AllReduceSum(all_attn_.data(), T * q_all); !s.ok()) return s;
  backend_->Copy2D(attn_.data(), Qd * kF, all_attn_.data() + q_at, q_all * kF, Qd * kF, T);
  return absl::OkStatus();
}

absl::Status ModelShard::RowParallel(const kernels::LinearWeight& w, const float* x, int64_t m, float* y) {
  if (ranges_.shard.size == 1) {
    backend_->Linear(w, x, m, nullptr, y, /*accumulate=*/true);
    return absl::OkStatus();
  }
  const int64_t n = m * config_.hidden_size;
  if (absl::Status s = partial_.Grow(n); !s.ok()) return s;
  backend_->Linear(w, x, m, nullptr, partial_.data(), /*accumulate=*/false);
  if (absl::Status s = collective_->AllReduceSum(partial_.data(), n); !s.ok()) return s;
  backend_->Add(y, partial_.data(), n);
  return absl::OkStatus();
}

absl::Status ModelShard::GatherLogits(int64_t rows, float* logits) {
  // Each rank's slice in its slot of [ranks][rows][chunk], then in place.
  constexpr size_t kF = sizeof(float);
  const int64_t V = config_.vocab_size, chunk = ranges_.vocab_chunk;
  const int ranks = ranges_.shard.size;
  const int64_t slot = rows * chunk;
  if (absl::Status s = vocab_slices_.Grow((ranks + 1) * slot); !s.ok()) return s;
  float* mine = vocab_slices_.data() + ranks * slot;
  backend_->Linear(*lm_head_, xn_.data(), rows, nullptr, mine, false);
  if (absl::Status s = collective_->AllGather(mine, slot * kF, vocab_slices_.data()); !s.ok()) {
    return s;
  }
  for (int r = 0; r < ranks; ++r) {
    const int64_t begin = std::min(V, chunk * r), end = std::min(V, chunk * (r + 1));
    // Rank r's Linear wrote [rows, end - begin] contiguously.
    backend_->Copy2D(logits + begin, V * kF, vocab_slices_.data() + r * slot, (end - begin) * kF,
                     (end - begin) * kF, rows);
  }
  return absl::OkStatus();
}

}  // namespace pdserve
