#include "kv_transfer/descriptor.h"

#include "absl/strings/str_cat.h"

namespace pdserve::kv {

KvLayoutDescriptor KvLayoutDescriptor::FromSpec(const KvCacheSpec& spec, const ModelIdentity& model) {
  KvLayoutDescriptor d;
  d.model = model;
  d.num_layers = spec.num_layers;
  d.num_kv_heads = spec.ModelKvHeads();
  d.head_dim = spec.head_dim;
  d.dtype = spec.dtype;
  d.block_size = spec.block_size;
  // A request-sharded pool (one pool of every head, ranks owning block
  // ranges) is laid out as one rank's: a sender writes it the same way.
  d.tp = spec.num_ranks;
  d.kv_heads_per_rank = spec.num_kv_heads;
  return d;
}

KvCacheSpec KvLayoutDescriptor::ToSpec(int32_t num_blocks) const {
  return KvCacheSpec{.num_layers = num_layers,
                     .num_kv_heads = kv_heads_per_rank > 0 ? kv_heads_per_rank : num_kv_heads,
                     .head_dim = head_dim,
                     .block_size = block_size,
                     .dtype = dtype,
                     .num_blocks = num_blocks,
                     .num_ranks = tp,
                     .model_kv_heads = num_kv_heads};
}

std::string KvLayoutDescriptor::DebugString() const {
  return absl::StrCat("{protocol ", protocol_version, ", model ", model.ToHex(), ", layers ",
                      num_layers, ", kv heads ", num_kv_heads, ", head dim ", head_dim, ", dtype ",
                      DTypeName(dtype), ", block size ", block_size, ", layout ",
                      static_cast<int>(layout), ", tp ", tp, " x ",
                      kv_heads_per_rank > 0 ? kv_heads_per_rank : num_kv_heads, " kv heads}");
}

absl::Status CheckCompatible(const KvLayoutDescriptor& s, const KvLayoutDescriptor& r) {
  auto refuse = [](absl::string_view field, const auto& sv, const auto& rv) {
    return absl::FailedPreconditionError(absl::StrCat("KV handoff refused: ", field,
                                                      " differs (sender ", sv, ", receiver ", rv,
                                                      ") and cannot be converted"));
  };
  if (s.protocol_version != r.protocol_version) {
    return refuse("protocol version", s.protocol_version, r.protocol_version);
  }
  if (!(s.model == r.model)) return refuse("model identity", s.model.ToHex(), r.model.ToHex());
  if (s.num_layers != r.num_layers) return refuse("number of layers", s.num_layers, r.num_layers);
  if (s.num_kv_heads != r.num_kv_heads) return refuse("KV heads", s.num_kv_heads, r.num_kv_heads);
  if (s.head_dim != r.head_dim) return refuse("head dim", s.head_dim, r.head_dim);
  if (s.dtype != r.dtype) return refuse("KV dtype", DTypeName(s.dtype), DTypeName(r.dtype));
  if (s.layout != r.layout) {
    return refuse("KV layout", static_cast<int>(s.layout), static_cast<int>(r.layout));
  }
  if (s.block_size <= 0 || r.block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("KV handoff: block sizes must be positive (sender ",
                                                   s.block_size, ", receiver ", r.block_size, ")"));
  }
  // Both tensor-parallel layouts must be ones a pool can have; then any
  // pair converts (every model head is on some sender rank).
  for (const KvLayoutDescriptor* d : {&s, &r}) {
    if (absl::Status v = d->ToSpec(1).Validate(); !v.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("KV handoff refused: the ", d == &s ? "sender" : "receiver", "'s tensor-parallel layout (",
                       v.message(), ") cannot be converted; sender ", s.DebugString(), ", receiver ",
                       r.DebugString()));
    }
  }
  return absl::OkStatus();
}

bool SameBlockLayout(const KvLayoutDescriptor& a, const KvLayoutDescriptor& b) {
  return a.block_size == b.block_size && a.ToSpec(1).num_ranks == b.ToSpec(1).num_ranks &&
         a.ToSpec(1).num_kv_heads == b.ToSpec(1).num_kv_heads;
}

}  // namespace pdserve::kv
