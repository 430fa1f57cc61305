#include "prefill_worker/prefix_pull.h"

#include <chrono>
#include <future>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/server_util.h"
#include "kv/block_hash.h"
#include "kv/kv_checksum.h"

namespace pdserve::prefill {

absl::StatusOr<worker::v1::PushPrefixResponse> PrefixPusher::Push(const worker::v1::PushPrefixRequest& req) {
  const auto start = std::chrono::steady_clock::now();
  worker::v1::PushPrefixResponse out;
  const KvCacheSpec& spec = kv_->spec();
  const CacheSalt salt{req.cache_salt_lo(), req.cache_salt_hi()};
  const BlockHasher hasher(model_, spec.dtype, spec.block_size);
  const std::vector<int32_t> tokens(req.tokens().begin(), req.tokens().end());
  // Pinned, block by block, while they are sent: the prefix cache may not
  // evict them, and they are never written (cached blocks are immutable).
  std::vector<SequenceKv> pins;
  std::vector<int32_t> table;
  const std::vector<BlockHash> hashes = hasher.FullBlockHashes(tokens, salt);
  for (const BlockHash& h : hashes) {
    SequenceKv pin = kv_->PinCached(h);
    if (pin.empty()) break;
    table.push_back(pin.block_table()[0]);
    pins.push_back(std::move(pin));
  }
  // The rest of the prefix from the second tier, read into blocks of this
  // push's own (given back when it ends, never published here).
  SequenceKv restored;
  if (tier2_ != nullptr && table.size() < hashes.size()) {
    const std::vector<BlockHash> rest(hashes.begin() + static_cast<ptrdiff_t>(table.size()), hashes.end());
    const int32_t n = tier2_->CountPrefix(rest);
    restored = kv_->NewSequence();
    if (n > 0 && kv_->Grow(restored, n * spec.block_size).ok()) {
      std::promise<int32_t> read;
      std::future<int32_t> verified = read.get_future();
      tier2_->Restore(kv_->storage(), std::vector<BlockHash>(rest.begin(), rest.begin() + n), restored.block_table(),
                      [&read](int32_t v) { read.set_value(v); });
      const int32_t v = verified.get();
      table.insert(table.end(), restored.block_table().begin(), restored.block_table().begin() + v);
      counters_.tier2_blocks += v;
    }
  }
  if (table.empty()) {
    ++counters_.empty;
    return out;
  }
  const int32_t positions = static_cast<int32_t>(table.size()) * spec.block_size;
  absl::MutexLock lock(&mu_);
  auto fail = [&](absl::Status s) {
    ++counters_.failed;
    return s;
  };
  kv::ReserveArgs args;
  args.num_positions = positions;
  args.prompt_tokens.assign(tokens.begin(), tokens.begin() + positions);
  args.grant = req.kv_grant();
  args.cache_salt = salt;
  absl::StatusOr<std::unique_ptr<kv::Handoff>> reserved = connections_.Reserve(req.receiver_kv_address(), args);
  if (!reserved.ok()) return fail(reserved.status());
  std::unique_ptr<kv::Handoff> handoff = *std::move(reserved);
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    if (absl::Status s = handoff->SendLayer(l, table); !s.ok()) return fail(s);
  }
  kv::Commit commit;
  commit.request_id = req.request_id();
  commit.num_positions = positions;
  commit.tokens.assign(tokens.begin(), tokens.begin() + positions);
  commit.cache_salt = salt;
  const int32_t held = handoff->held_positions();
  if (absl::Status s = handoff->Commit(std::move(commit)); !s.ok()) return fail(s);
  const int64_t bytes = static_cast<int64_t>(positions - held) * spec.BytesPerPosition() * spec.num_ranks;
  ++counters_.pushed;
  counters_.bytes += bytes;
  counters_.positions += positions - held;
  out.set_positions(positions);
  out.set_sent_positions(positions - held);
  out.set_bytes(bytes);
  out.set_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return out;
}

void AcceptPulledPrefix(KvManager* kv, const ModelIdentity& model, kv::CommittedSequence c, PullCounters* counters) {
  const KvStorage storage = kv->storage();
  const std::vector<int32_t>& table = c.kv.block_table();
  // A pull receiver asks every sender for checksums; one that came without
  // them is not used either.
  bool ok = c.verify && static_cast<int32_t>(c.state.layer_checksums.size()) == storage.spec.num_layers &&
            c.first_block >= 0 && c.first_block <= c.end_block && c.end_block <= static_cast<int32_t>(table.size());
  int32_t bad_layer = -1;
  for (int32_t l = 0; ok && l < storage.spec.num_layers; ++l) {
    if (LayerChecksum(storage, l, table, c.first_block, c.end_block) != c.state.layer_checksums[l]) {
      ok = false;
      bad_layer = l;
    }
  }
  if (ok) {
    const BlockHasher hasher(model, storage.spec.dtype, storage.spec.block_size);
    kv->Publish(c.kv, hasher.FullBlockHashes(c.state.tokens, c.state.cache_salt));
    ++counters->received;
    counters->positions += c.state.num_positions;
  } else {
    ++counters->checksum_failures;
    LogEvent("warning", "kv_checksum_mismatch",
             {{"request_id", c.state.request_id},
              {"producer", c.producer},
              {"path", "pull"},
              {"layer", absl::StrCat(bad_layer)},
              {"detail", "a pulled prefix does not match its producer's checksums; discarded, computed here"}});
  }
  c.kv.Release();
}

}  // namespace pdserve::prefill
