#include "kv/tier2_store.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <xxh_x86dispatch.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <iterator>
#include <list>
#include <optional>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace pdserve {
namespace {

// File header, kHeaderBytes long, every field little-endian, every byte not
// listed zero:
//   [0, 8)      magic "PDKVT2\0\0"
//   [8, 12)     format version (u32)
//   [16, 24)    layout fingerprint (u64, Tier2Fingerprint)
//   [24, 40)    the block's hash: lo, then hi (u64 each)
//   [40, 56)    its parent's hash: lo, then hi
//   [56, 64)    payload bytes (u64)
//   [64, 72)    XXH3-64 of the payload (u64)
//   [120, 128)  XXH3-64 of bytes [0, 120)
// The header checksum covers the zero bytes too, so any flipped header byte
// is caught.
constexpr char kMagic[8] = {'P', 'D', 'K', 'V', 'T', '2', '\0', '\0'};
constexpr uint32_t kFormatVersion = 1;
constexpr int kVersionAt = 8;
constexpr int kFingerprintAt = 16;
constexpr int kHashAt = 24;
constexpr int kParentAt = 40;
constexpr int kPayloadBytesAt = 56;
constexpr int kPayloadChecksumAt = 64;
constexpr int kHeaderChecksumAt = 120;
static_assert(kHeaderChecksumAt + 8 == Tier2Store::kHeaderBytes);

constexpr absl::string_view kFileSuffix = ".kvb";
constexpr absl::string_view kTempSuffix = ".kvb.tmp";

void PutU32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
void PutU64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

struct Header {
  uint64_t fingerprint = 0;
  BlockHash hash;
  BlockHash parent;
  uint64_t payload_bytes = 0;
  uint64_t payload_checksum = 0;
};

void EncodeHeader(const Header& h, char* out) {
  std::memset(out, 0, Tier2Store::kHeaderBytes);
  std::memcpy(out, kMagic, sizeof(kMagic));
  PutU32(out + kVersionAt, kFormatVersion);
  PutU64(out + kFingerprintAt, h.fingerprint);
  PutU64(out + kHashAt, h.hash.lo);
  PutU64(out + kHashAt + 8, h.hash.hi);
  PutU64(out + kParentAt, h.parent.lo);
  PutU64(out + kParentAt + 8, h.parent.hi);
  PutU64(out + kPayloadBytesAt, h.payload_bytes);
  PutU64(out + kPayloadChecksumAt, h.payload_checksum);
  PutU64(out + kHeaderChecksumAt, XXH3_64bits(out, kHeaderChecksumAt));
}

// The header in `in`, or nothing when its magic, version or checksum is
// wrong.
std::optional<Header> DecodeHeader(const char* in) {
  if (std::memcmp(in, kMagic, sizeof(kMagic)) != 0) return std::nullopt;
  if (GetU32(in + kVersionAt) != kFormatVersion) return std::nullopt;
  if (GetU64(in + kHeaderChecksumAt) != XXH3_64bits(in, kHeaderChecksumAt)) return std::nullopt;
  Header h;
  h.fingerprint = GetU64(in + kFingerprintAt);
  h.hash = {GetU64(in + kHashAt), GetU64(in + kHashAt + 8)};
  h.parent = {GetU64(in + kParentAt), GetU64(in + kParentAt + 8)};
  h.payload_bytes = GetU64(in + kPayloadBytesAt);
  h.payload_checksum = GetU64(in + kPayloadChecksumAt);
  return h;
}

int64_t PayloadBytes(const KvCacheSpec& spec) { return spec.LayerBlockBytes() * spec.num_layers * spec.num_ranks; }

// Closes a descriptor when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now and reports whether the close succeeded (a write's last
  // chance to see an I/O error).
  bool Close() {
    const int fd = std::exchange(fd_, -1);
    return ::close(fd) == 0;
  }

 private:
  int fd_;
};

bool PreadFull(int fd, char* out, int64_t n, off_t offset) {
  while (n > 0) {
    const ssize_t got = ::pread(fd, out, static_cast<size_t>(n), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    out += got;
    n -= got;
    offset += got;
  }
  return true;
}

bool PwriteFull(int fd, const char* in, int64_t n, off_t offset) {
  while (n > 0) {
    const ssize_t put = ::pwrite(fd, in, static_cast<size_t>(n), offset);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    in += put;
    n -= put;
    offset += put;
  }
  return true;
}

// Fills every segment of `iov` from `offset` on, in order; false on an
// error or a short file. Consumes `iov`.
bool PreadvFull(int fd, std::vector<iovec>& iov, off_t offset) {
  size_t first = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    const ssize_t got = ::preadv(fd, iov.data() + first, count, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    offset += got;
    size_t left = static_cast<size_t>(got);
    while (left > 0 && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return true;
}

struct XxhStateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

}  // namespace

uint64_t Tier2Fingerprint(const ModelIdentity& model, const KvCacheSpec& spec) {
  // Hashed as the identity (lo, then hi, u64 LE) and then these as i32 LE.
  // The number of blocks is left out: a pool of another size holds the same
  // payload per block.
  const int32_t fields[] = {spec.num_layers, spec.num_kv_heads, spec.ModelKvHeads(),
                            spec.head_dim,   spec.block_size,   static_cast<int32_t>(spec.dtype),
                            spec.num_ranks,  spec.request_ranks};
  char bytes[16 + 4 * std::size(fields)];
  PutU64(bytes, model.lo);
  PutU64(bytes + 8, model.hi);
  char* p = bytes + 16;
  for (int32_t field : fields) {
    PutU32(p, static_cast<uint32_t>(field));
    p += 4;
  }
  return XXH3_64bits(bytes, sizeof(bytes));
}

void CopyBlockOut(const KvStorage& storage, int32_t block, char* out) {
  const int64_t bytes = storage.spec.LayerBlockBytes();
  for (int32_t rank = 0; rank < storage.spec.num_ranks; ++rank) {
    for (int32_t layer = 0; layer < storage.spec.num_layers; ++layer) {
      std::memcpy(out, storage.BlockData(layer, BlockId{block}, rank), static_cast<size_t>(bytes));
      out += bytes;
    }
  }
}

class Tier2Store::Impl {
 public:
  Impl(const ModelIdentity& model, const KvCacheSpec& spec, const Tier2Options& options)
      : spec_(spec),
        options_(options),
        fingerprint_(Tier2Fingerprint(model, spec)),
        payload_bytes_(PayloadBytes(spec)),
        file_bytes_(kHeaderBytes + payload_bytes_) {}

  ~Impl() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    // Each worker leaves only once both queues are empty, so queued work
    // finishes first.
    for (std::thread& t : threads_) t.join();
  }

  // Indexes the directory's files, deleting what fails the checks, then
  // evicts down to the capacity. Runs before the threads start.
  absl::Status Load();
  void Start() {
    for (int32_t i = 0; i < options_.io_threads; ++i) threads_.emplace_back([this] { WorkerLoop(); });
  }

  int64_t file_bytes() const { return file_bytes_; }

  int32_t CountPrefix(absl::Span<const BlockHash> hashes) const {
    absl::ReaderMutexLock lock(&mu_);
    int32_t n = 0;
    while (n < static_cast<int32_t>(hashes.size()) && index_.contains(hashes[n])) ++n;
    return n;
  }

  bool Contains(const BlockHash& hash) const {
    absl::ReaderMutexLock lock(&mu_);
    return index_.contains(hash);
  }

  void Restore(KvStorage storage, std::vector<BlockHash> hashes, std::vector<int32_t> blocks,
               std::function<void(int32_t)> done);
  bool Write(const BlockHash& hash, const BlockHash& parent, std::function<bool(char*)> read);

  void Flush() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &Impl::Idle));
  }

  void SetListener(BlockPoolListener* listener) {
    absl::MutexLock lock(&mu_);
    listener_ = listener;
    if (listener_ == nullptr) return;
    // Oldest first, as they were stored.
    for (const BlockHash& h : lru_) listener_->OnStored(h, index_.at(h).parent);
  }

  Tier2Stats Stats() const {
    absl::ReaderMutexLock lock(&mu_);
    Tier2Stats s = stats_;
    s.blocks = static_cast<int64_t>(index_.size());
    s.bytes = bytes_;
    s.capacity_bytes = options_.capacity_bytes;
    return s;
  }

 private:
  struct RestoreJob {
    KvStorage storage;
    std::vector<BlockHash> hashes;
    std::vector<int32_t> blocks;
    std::function<void(int32_t)> done;
    std::chrono::steady_clock::time_point start;
  };
  struct WriteJob {
    BlockHash hash;
    BlockHash parent;
    std::function<bool(char*)> read;
  };

  std::string PathOf(const BlockHash& hash) const { return absl::StrCat(options_.dir, "/", hash.ToHex(), kFileSuffix); }

  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !restores_.empty() || !writes_.empty() || stopping_;
  }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return restores_.empty() && writes_.empty() && in_flight_ == 0;
  }

  void WorkerLoop();
  void RunRestore(RestoreJob& job);
  // Reads and verifies one block; false when it is absent or fails.
  bool RestoreOne(const KvStorage& storage, const BlockHash& hash, int32_t block);
  void RunWrite(WriteJob& job);

  // Adds `hash` (whose chain parent is `parent`) at the most recently used
  // end, or moves it there when indexed already.
  void Index(const BlockHash& hash, const BlockHash& parent) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops `hash` from the index (its file is the caller's to delete).
  void Forget(const BlockHash& hash) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictToCapacity() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Deletes the file under `hash`'s name if it is still the file `read`
  // describes (the one found corrupt), and drops it from the index.
  void DropCorrupt(const BlockHash& hash, const struct stat& read) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const KvCacheSpec spec_;
  const Tier2Options options_;
  const uint64_t fingerprint_;
  const int64_t payload_bytes_;
  const int64_t file_bytes_;

  // Renames into place and deletions happen under mu_, so that the index
  // and the directory's names change together: a corrupt file's deletion
  // (which checks the name still holds the file it read) can never remove
  // a newer file renamed over it in between.
  mutable absl::Mutex mu_;
  // Least recently used first.
  std::list<BlockHash> lru_ ABSL_GUARDED_BY(mu_);
  struct Entry {
    std::list<BlockHash>::iterator lru;
    BlockHash parent;
  };
  absl::flat_hash_map<BlockHash, Entry> index_ ABSL_GUARDED_BY(mu_);
  BlockPoolListener* listener_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Hashes with a write waiting or in flight.
  absl::flat_hash_set<BlockHash> writing_ ABSL_GUARDED_BY(mu_);
  std::deque<RestoreJob> restores_ ABSL_GUARDED_BY(mu_);
  std::deque<WriteJob> writes_ ABSL_GUARDED_BY(mu_);
  int32_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  Tier2Stats stats_ ABSL_GUARDED_BY(mu_);

  std::vector<std::thread> threads_;
};

absl::Status Tier2Store::Impl::Load() {
  // Names first, then the checks: deleting entries while a directory is
  // being read may hide or repeat others.
  std::vector<std::string> names;
  std::error_code ec;
  std::filesystem::directory_iterator it(options_.dir, ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    std::error_code type_ec;
    // Only regular files: a link or a folder with a matching name is not
    // the store's.
    if (it->symlink_status(type_ec).type() != std::filesystem::file_type::regular) continue;
    names.push_back(it->path().filename().string());
  }
  if (ec) {
    return absl::ErrnoToStatus(ec.value(), absl::StrCat("tier-2 store: cannot read directory ", options_.dir));
  }

  struct Found {
    struct timespec mtime;
    std::string name;
    BlockHash hash;
    BlockHash parent;
  };
  std::vector<Found> found;
  int64_t discarded = 0;
  for (const std::string& name : names) {
    const std::string path = absl::StrCat(options_.dir, "/", name);
    if (absl::EndsWith(name, kTempSuffix)) {
      ::unlink(path.c_str());
      continue;
    }
    if (!absl::EndsWith(name, kFileSuffix)) continue;
    std::optional<Header> header;
    struct stat st {};
    {
      Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      char bytes[kHeaderBytes];
      if (fd.get() >= 0 && ::fstat(fd.get(), &st) == 0 && st.st_size == file_bytes_ &&
          PreadFull(fd.get(), bytes, kHeaderBytes, 0)) {
        header = DecodeHeader(bytes);
      }
    }
    if (!header.has_value() || header->fingerprint != fingerprint_ ||
        header->payload_bytes != static_cast<uint64_t>(payload_bytes_) ||
        name != absl::StrCat(header->hash.ToHex(), kFileSuffix)) {
      ::unlink(path.c_str());
      ++discarded;
      continue;
    }
    found.push_back({st.st_mtim, name, header->hash, header->parent});
  }
  // Oldest first; the name breaks ties (timestamps are coarser than a burst
  // of writes) so that the order does not depend on the directory's.
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return std::tie(a.mtime.tv_sec, a.mtime.tv_nsec, a.name) < std::tie(b.mtime.tv_sec, b.mtime.tv_nsec, b.name);
  });

  absl::MutexLock lock(&mu_);
  stats_.discarded_at_open = discarded;
  for (const Found& f : found) Index(f.hash, f.parent);
  EvictToCapacity();
  return absl::OkStatus();
}

void Tier2Store::Impl::Index(const BlockHash& hash, const BlockHash& parent) {
  if (auto it = index_.find(hash); it != index_.end()) {
    lru_.splice(lru_.end(), lru_, it->second.lru);
    return;
  }
  index_.emplace(hash, Entry{lru_.insert(lru_.end(), hash), parent});
  bytes_ += file_bytes_;
  if (listener_ != nullptr) listener_->OnStored(hash, parent);
}

void Tier2Store::Impl::Forget(const BlockHash& hash) {
  auto it = index_.find(hash);
  if (it == index_.end()) return;
  lru_.erase(it->second.lru);
  index_.erase(it);
  bytes_ -= file_bytes_;
  if (listener_ != nullptr) listener_->OnRemoved(hash);
}

void Tier2Store::Impl::EvictToCapacity() {
  while (bytes_ > options_.capacity_bytes && !lru_.empty()) {
    const BlockHash victim = lru_.front();
    ::unlink(PathOf(victim).c_str());
    Forget(victim);
    ++stats_.evictions;
  }
}

void Tier2Store::Impl::DropCorrupt(const BlockHash& hash, const struct stat& read) {
  const std::string path = PathOf(hash);
  struct stat now {};
  if (::stat(path.c_str(), &now) == 0 && now.st_dev == read.st_dev && now.st_ino == read.st_ino) {
    ::unlink(path.c_str());
    Forget(hash);
  }
}

void Tier2Store::Impl::Restore(KvStorage storage, std::vector<BlockHash> hashes, std::vector<int32_t> blocks,
                               std::function<void(int32_t)> done) {
  if (hashes.size() != blocks.size()) {
    ABSL_RAW_LOG(FATAL, "Tier2Store::Restore of %zu hashes into %zu blocks", hashes.size(), blocks.size());
  }
  // A pool of another shape would take the payload at the wrong offsets.
  if (Tier2Fingerprint({}, storage.spec) != Tier2Fingerprint({}, spec_)) {
    ABSL_RAW_LOG(FATAL, "Tier2Store::Restore into a pool of another shape than the store's");
  }
  for (int32_t b : blocks) {
    if (b < 0 || b >= storage.spec.num_blocks) {
      ABSL_RAW_LOG(FATAL, "Tier2Store::Restore into block %d of a pool of %d", b, storage.spec.num_blocks);
    }
  }
  const auto start = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  restores_.push_back({storage, std::move(hashes), std::move(blocks), std::move(done), start});
}

bool Tier2Store::Impl::Write(const BlockHash& hash, const BlockHash& parent, std::function<bool(char*)> read) {
  absl::MutexLock lock(&mu_);
  if (index_.contains(hash) || writing_.contains(hash)) return true;
  if (static_cast<int64_t>(writes_.size()) >= options_.max_queued_writes) {
    ++stats_.write_drops;
    return false;
  }
  writing_.insert(hash);
  writes_.push_back({hash, parent, std::move(read)});
  return true;
}

void Tier2Store::Impl::WorkerLoop() {
  while (true) {
    std::optional<RestoreJob> restore;
    std::optional<WriteJob> write;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Impl::HasWorkOrStopping));
      // Restores first: a request waits on them, while a write only saves
      // work for a later one.
      if (!restores_.empty()) {
        restore.emplace(std::move(restores_.front()));
        restores_.pop_front();
      } else if (!writes_.empty()) {
        write.emplace(std::move(writes_.front()));
        writes_.pop_front();
      } else {
        return;  // Stopping, and nothing is left.
      }
      ++in_flight_;
    }
    if (restore.has_value()) {
      RunRestore(*restore);
    } else {
      RunWrite(*write);
    }
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }
}

void Tier2Store::Impl::RunRestore(RestoreJob& job) {
  int32_t restored = 0;
  const int32_t asked = static_cast<int32_t>(job.hashes.size());
  while (restored < asked && RestoreOne(job.storage, job.hashes[restored], job.blocks[restored])) ++restored;
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - job.start;
  {
    absl::MutexLock lock(&mu_);
    ++stats_.restores;
    stats_.restored_blocks += restored;
    stats_.restore_misses += asked - restored;
    stats_.restore_seconds += elapsed.count();
  }
  job.done(restored);
}

bool Tier2Store::Impl::RestoreOne(const KvStorage& storage, const BlockHash& hash, int32_t block) {
  {
    absl::ReaderMutexLock lock(&mu_);
    if (!index_.contains(hash)) return false;
  }
  const std::string path = PathOf(hash);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  struct stat st {};
  if (fd.get() < 0 || ::fstat(fd.get(), &st) != 0) {
    // Deleted behind the store's back: forget it, unless a write has put
    // it back in the meantime.
    absl::MutexLock lock(&mu_);
    struct stat now {};
    if (::stat(path.c_str(), &now) != 0 && errno == ENOENT) Forget(hash);
    return false;
  }

  char header_bytes[kHeaderBytes];
  std::optional<Header> header;
  if (st.st_size == file_bytes_ && PreadFull(fd.get(), header_bytes, kHeaderBytes, 0)) {
    header = DecodeHeader(header_bytes);
  }
  bool ok = header.has_value() && header->fingerprint == fingerprint_ && header->hash == hash &&
            header->payload_bytes == static_cast<uint64_t>(payload_bytes_);
  if (ok) {
    // Straight into the pool block, then the checksum over the same
    // segments in file order: the caller trusts no byte unless it matches.
    const size_t layer_bytes = static_cast<size_t>(spec_.LayerBlockBytes());
    std::vector<iovec> segments;
    segments.reserve(static_cast<size_t>(spec_.num_ranks) * spec_.num_layers);
    for (int32_t rank = 0; rank < spec_.num_ranks; ++rank) {
      for (int32_t layer = 0; layer < spec_.num_layers; ++layer) {
        segments.push_back({storage.BlockData(layer, BlockId{block}, rank), layer_bytes});
      }
    }
    std::vector<iovec> pending = segments;
    ok = PreadvFull(fd.get(), pending, kHeaderBytes);
    if (ok) {
      std::unique_ptr<XXH3_state_t, XxhStateDeleter> state(XXH3_createState());
      if (state == nullptr) ABSL_RAW_LOG(FATAL, "XXH3_createState: out of memory");
      XXH3_64bits_reset(state.get());
      for (const iovec& s : segments) XXH3_64bits_update_dispatch(state.get(), s.iov_base, s.iov_len);
      ok = XXH3_64bits_digest(state.get()) == header->payload_checksum;
    }
  }
  if (!ok) {
    absl::MutexLock lock(&mu_);
    ++stats_.checksum_failures;
    DropCorrupt(hash, st);
    return false;
  }
  // The modification time is the recency a later open sees.
  ::futimens(fd.get(), nullptr);
  absl::MutexLock lock(&mu_);
  if (auto it = index_.find(hash); it != index_.end()) Index(hash, it->second.parent);
  return true;
}

void Tier2Store::Impl::RunWrite(WriteJob& job) {
  std::vector<char> file(static_cast<size_t>(file_bytes_));
  if (!job.read(file.data() + kHeaderBytes)) {
    absl::MutexLock lock(&mu_);
    writing_.erase(job.hash);
    ++stats_.write_drops;
    return;
  }
  Header header;
  header.fingerprint = fingerprint_;
  header.hash = job.hash;
  header.parent = job.parent;
  header.payload_bytes = static_cast<uint64_t>(payload_bytes_);
  // The payload's hash runs the CPU's widest vector path (kv/kv_checksum.cc).
  header.payload_checksum = XXH3_64bits_dispatch(file.data() + kHeaderBytes, static_cast<size_t>(payload_bytes_));
  EncodeHeader(header, file.data());

  // No fsync: after a crash a file renamed in place may hold lost bytes,
  // which its payload checksum catches on restore.
  const std::string path = PathOf(job.hash);
  const std::string temp = absl::StrCat(options_.dir, "/", job.hash.ToHex(), kTempSuffix);
  bool ok = false;
  {
    Fd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    ok = fd.get() >= 0 && PwriteFull(fd.get(), file.data(), file_bytes_, 0);
    if (fd.get() >= 0) ok = fd.Close() && ok;
  }
  absl::MutexLock lock(&mu_);
  writing_.erase(job.hash);
  if (ok && ::rename(temp.c_str(), path.c_str()) == 0) {
    Index(job.hash, job.parent);
    ++stats_.writes;
    EvictToCapacity();
  } else {
    ::unlink(temp.c_str());
    ++stats_.write_errors;
  }
}

absl::StatusOr<std::unique_ptr<Tier2Store>> Tier2Store::Open(const ModelIdentity& model, const KvCacheSpec& spec,
                                                             const Tier2Options& options) {
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  const int64_t file_bytes = kHeaderBytes + PayloadBytes(spec);
  if (options.dir.empty()) return absl::InvalidArgumentError("tier-2 store: dir must not be empty");
  if (options.capacity_bytes < file_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tier-2 store: capacity_bytes must hold at least one block's file (",
                                                   file_bytes, " bytes), got ", options.capacity_bytes));
  }
  if (options.io_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier-2 store: io_threads must be at least 1, got ", options.io_threads));
  }
  if (options.max_queued_writes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier-2 store: max_queued_writes must be at least 1, got ", options.max_queued_writes));
  }
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) {
    return absl::ErrnoToStatus(ec.value(), absl::StrCat("tier-2 store: cannot create directory ", options.dir));
  }
  auto impl = std::make_unique<Impl>(model, spec, options);
  if (absl::Status s = impl->Load(); !s.ok()) return s;
  impl->Start();
  return std::unique_ptr<Tier2Store>(new Tier2Store(std::move(impl)));
}

Tier2Store::Tier2Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Tier2Store::~Tier2Store() = default;

int64_t Tier2Store::FileBytes() const { return impl_->file_bytes(); }

int32_t Tier2Store::CountPrefix(absl::Span<const BlockHash> hashes) const { return impl_->CountPrefix(hashes); }

bool Tier2Store::Contains(const BlockHash& hash) const { return impl_->Contains(hash); }

void Tier2Store::Restore(KvStorage storage, std::vector<BlockHash> hashes, std::vector<int32_t> blocks,
                         std::function<void(int32_t)> done) {
  impl_->Restore(storage, std::move(hashes), std::move(blocks), std::move(done));
}

bool Tier2Store::Write(const BlockHash& hash, const BlockHash& parent, std::function<bool(char*)> read) {
  return impl_->Write(hash, parent, std::move(read));
}

void Tier2Store::Flush() { impl_->Flush(); }

Tier2Stats Tier2Store::Stats() const { return impl_->Stats(); }

void Tier2Store::set_listener(BlockPoolListener* listener) { impl_->SetListener(listener); }

}  // namespace pdserve
