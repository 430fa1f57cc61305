// The prefix cache's second tier: full KV blocks kept in files on local
// disk after (or while) the pool holds them, so that a prefix evicted from
// the pool is read back instead of computed again, also after the worker
// restarts.
//
// One file per block, named by its chain hash (`<32 hex digits>.kvb`):
//   header (kHeaderBytes, little-endian): magic "PDKVT2\0\0", format
//     version, the layout fingerprint (Tier2Fingerprint: model identity and
//     the pool's shape), the block's hash and its parent's, payload bytes,
//     XXH3-64 of the payload, XXH3-64 of the header's preceding bytes;
//   payload: the block's bytes of every rank and layer, rank-major then
//     layer (LayerBlockBytes() each), exactly as the pool holds them.
// A file is written under a temporary name and renamed into place, so a
// reader never sees half of one. On open every file's header is read and
// checked (magic, version, fingerprint, header checksum, hash against the
// name, size against the header): a file that fails is deleted and
// counted, never indexed. The payload's checksum is verified on every
// restore, before the caller uses a byte of it; a mismatch deletes the
// file and counts a checksum failure.
//
// Capacity is in bytes (whole files); adding past it deletes the least
// recently used files (written or restored) first. On open, recency is
// taken from the files' modification times, which a restore refreshes.
//
// I/O runs on the store's own bounded pool of threads (pread/pwrite), never
// on the caller's: writes are queued (a full queue drops the write and
// counts it), restores are queued ahead of writes, and each completion is
// reported through a callback on an I/O thread.
//
// Host memory only: the pool's region must be readable and writable by the
// CPU (a GPU pool's blocks are not).
//
// Thread safety: thread-safe.
#ifndef PDSERVE_KV_TIER2_STORE_H_
#define PDSERVE_KV_TIER2_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "kv/kv_cache.h"

namespace pdserve {

// What every file of a store must carry to be read back into a pool: the
// model identity and the pool's shape (layers, KV heads and the model's,
// head dim, block size, dtype, TP ranks, request ranks), hashed (XXH3-64).
uint64_t Tier2Fingerprint(const ModelIdentity& model, const KvCacheSpec& spec);

struct Tier2Options {
  std::string dir;              // Created if missing.
  int64_t capacity_bytes = 0;   // At least one block's file.
  int32_t io_threads = 2;       // >= 1.
  int32_t max_queued_writes = 256;  // Beyond it a write is dropped (counted).
};

struct Tier2Stats {
  int64_t blocks = 0;           // Files indexed now.
  int64_t bytes = 0;            // Their total size.
  int64_t capacity_bytes = 0;
  int64_t writes = 0;           // Files written.
  int64_t write_drops = 0;      // Writes dropped: queue full, or the block was gone.
  int64_t write_errors = 0;     // Writes that failed (I/O error, disk full).
  int64_t evictions = 0;        // Files deleted for room.
  int64_t restored_blocks = 0;  // Blocks read back and verified.
  int64_t restore_misses = 0;   // Blocks asked for and not restored (absent by then, or failed).
  int64_t checksum_failures = 0;  // Files that failed their checks on restore: payload or header (deleted).
  int64_t discarded_at_open = 0;  // Files refused on open: truncated, corrupt header, foreign.
  double restore_seconds = 0;   // Summed over restore calls, queueing included.
  int64_t restores = 0;         // Restore calls completed.
};

class Tier2Store {
 public:
  // Opens `options.dir` for pools of `spec` holding `model`'s KV: indexes
  // the files that pass the header checks, deletes the rest (and leftover
  // temporary files), and then evicts down to the capacity. Errors: bad
  // options, a directory that cannot be created or read.
  static absl::StatusOr<std::unique_ptr<Tier2Store>> Open(const ModelIdentity& model, const KvCacheSpec& spec,
                                                          const Tier2Options& options);
  // Waits for the queued I/O to finish, then stops the threads.
  ~Tier2Store();

  // Bytes of one block's file (header + payload).
  int64_t FileBytes() const;
  // How many leading hashes of `hashes` are stored (the in-memory index;
  // no I/O).
  int32_t CountPrefix(absl::Span<const BlockHash> hashes) const;
  bool Contains(const BlockHash& hash) const;

  // Reads the blocks stored under hashes[i] into pool block blocks[i] of
  // `storage`, in order, and verifies each; stops at the first block that
  // is absent or fails. `done(n)` runs on an I/O thread once finished, n =
  // how many leading blocks were read and verified: only those hold valid
  // KV. The caller must hold the blocks (and not touch their bytes) until
  // `done` runs, and `done` must not call Flush or destroy the store (its
  // own job still counts as running). REQUIRES: hashes.size() ==
  // blocks.size(); `storage` has the store's shape and is host memory; each
  // block is in range (a violation aborts).
  void Restore(KvStorage storage, std::vector<BlockHash> hashes, std::vector<int32_t> blocks,
               std::function<void(int32_t)> done);

  // Writes a block to the store unless its hash is already stored or
  // queued. `read` runs on an I/O thread and must copy the block's payload
  // (FileBytes() - kHeaderBytes bytes, laid out as above) into its argument
  // and return true, or return false when the block is no longer available
  // (the write is dropped); like `done`, it must not call Flush or destroy
  // the store. Returns false when the write was dropped at
  // once (queue full); true when it was queued or is already stored.
  bool Write(const BlockHash& hash, const BlockHash& parent, std::function<bool(char*)> read);

  // Blocks until every queued write and restore has finished (tests,
  // shutdown).
  void Flush();

  Tier2Stats Stats() const;

  // Told of every block the store indexes (stored, with its chain parent)
  // and drops (removed: evicted, found corrupt), as a pool's listener is;
  // on being set, of every block indexed now, oldest first. Called under
  // the store's lock: must not call back into the store. Null: none.
  // REQUIRES: outlives the store or is reset first.
  void set_listener(BlockPoolListener* listener);

  static constexpr int64_t kHeaderBytes = 128;

  class Impl;

 private:
  explicit Tier2Store(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Copies block `block`'s bytes of every rank and layer out of `storage`
// into `out` (rank-major, then layer; LayerBlockBytes() each): the payload
// a Tier2Store file holds. Host storage only.
void CopyBlockOut(const KvStorage& storage, int32_t block, char* out);

}  // namespace pdserve

#endif  // PDSERVE_KV_TIER2_STORE_H_
