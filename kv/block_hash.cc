#include "kv/block_hash.h"

#include <xxhash.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve {
namespace {

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

std::string BlockHash::ToHex() const { return absl::StrFormat("%016x%016x", hi, lo); }

BlockHash HashBytes(absl::string_view bytes) {
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return {h.low64, h.high64};
}

CacheSalt CacheSaltForKey(absl::string_view key_id) {
  if (key_id.empty()) return {};
  // The label keeps these apart from every other use of HashBytes.
  return HashBytes(absl::StrCat("pdserve.prefix_cache_scope.key", absl::string_view("\0", 1), key_id));
}

BlockHasher::BlockHasher(ModelIdentity model, DType kv_dtype, int32_t block_size)
    : model_(model), kv_dtype_(kv_dtype), block_size_(block_size) {}

BlockHash BlockHasher::HashBlock(const BlockHash& parent,
                                 absl::Span<const int32_t> block_tokens) const {
  std::string bytes;
  bytes.reserve(37 + 4 * block_tokens.size());
  PutU64(bytes, parent.lo);
  PutU64(bytes, parent.hi);
  PutU64(bytes, model_.lo);
  PutU64(bytes, model_.hi);
  bytes.push_back(static_cast<char>(kv_dtype_));
  PutU32(bytes, static_cast<uint32_t>(block_tokens.size()));
  for (int32_t t : block_tokens) PutU32(bytes, static_cast<uint32_t>(t));
  return HashBytes(bytes);
}

std::vector<BlockHash> BlockHasher::FullBlockHashes(absl::Span<const int32_t> tokens, const CacheSalt& salt) const {
  std::vector<BlockHash> out;
  BlockHash parent = salt;
  for (size_t b = 0; (b + 1) * block_size_ <= tokens.size(); ++b) {
    parent = HashBlock(parent, tokens.subspan(b * block_size_, block_size_));
    out.push_back(parent);
  }
  return out;
}

}  // namespace pdserve
