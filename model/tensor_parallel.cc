#include "model/tensor_parallel.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pdserve {
namespace {

IndexRange Even(int64_t n, int rank, int size) { return {n * rank / size, n * (rank + 1) / size}; }

}  // namespace

absl::StatusOr<ShardRanges> ComputeShardRanges(const ModelConfig& c, TpShard shard) {
  const int64_t n = shard.size;
  auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("tensor parallelism over ", n, " ranks: ", why));
  };
  if (n < 1) return refuse("needs at least one rank");
  if (shard.rank < 0 || shard.rank >= n) return refuse(absl::StrCat("rank ", shard.rank, " is outside it"));
  if (c.num_heads % n != 0) {
    return refuse(absl::StrCat("the model's ", c.num_heads, " query heads do not split evenly"));
  }
  if (n % c.num_kv_heads != 0 && c.num_kv_heads % n != 0) {
    return refuse(absl::StrCat("the model's ", c.num_kv_heads,
                               " KV heads neither split evenly nor replicate evenly (one must divide the other)"));
  }
  if (n > c.intermediate_size) {
    return refuse(absl::StrCat("more ranks than the MLP's ", c.intermediate_size, " columns"));
  }
  if ((c.vocab_size + n - 1) / n * (n - 1) >= c.vocab_size) {
    return refuse(absl::StrCat("the ", c.vocab_size, " vocabulary entries leave a rank without a slice"));
  }
  ShardRanges r;
  r.shard = shard;
  r.q_heads = Even(c.num_heads, shard.rank, shard.size);
  if (n <= c.num_kv_heads) {
    r.kv_heads = Even(c.num_kv_heads, shard.rank, shard.size);
  } else {
    r.kv_copies = n / c.num_kv_heads;
    const int64_t h = shard.rank / r.kv_copies;
    r.kv_heads = {h, h + 1};
  }
  r.ffn = Even(c.intermediate_size, shard.rank, shard.size);
  r.vocab_chunk = (c.vocab_size + n - 1) / n;
  r.vocab = {std::min(c.vocab_size, r.vocab_chunk * shard.rank),
             std::min(c.vocab_size, r.vocab_chunk * (shard.rank + 1))};
  return r;
}

}  // namespace pdserve
