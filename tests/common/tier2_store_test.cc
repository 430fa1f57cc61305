#include "kv/tier2_store.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kv/kv_events.h"

namespace pdserve {
namespace {

KvCacheSpec SmallSpec() {
  return {.num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = DType::kF32, .num_blocks = 16};
}

ModelIdentity TestModel() { return HashBytes("tier2 test model"); }

BlockHash HashOf(int i) { return HashBytes(absl::StrCat("tier2 test block ", i)); }

// A fresh directory under the test's temporary directory, removed with
// everything in it at the end.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = ::testing::TempDir() + "/tier2_store_test.XXXXXX";
    const char* made = ::mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr) << pattern;
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

Tier2Options OptionsFor(const std::string& dir, int64_t capacity_bytes) {
  Tier2Options o;
  o.dir = dir;
  o.capacity_bytes = capacity_bytes;
  return o;
}

int64_t FileBytesOf(const KvCacheSpec& spec) {
  return Tier2Store::kHeaderBytes + spec.LayerBlockBytes() * spec.num_layers * spec.num_ranks;
}

std::unique_ptr<Tier2Store> OpenOrDie(const std::string& dir, const KvCacheSpec& spec = SmallSpec(),
                                      const ModelIdentity& model = TestModel(), int64_t capacity_files = 16) {
  absl::StatusOr<std::unique_ptr<Tier2Store>> store =
      Tier2Store::Open(model, spec, OptionsFor(dir, capacity_files * FileBytesOf(spec)));
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

std::unique_ptr<BlockPool> PoolOrDie(const KvCacheSpec& spec = SmallSpec()) {
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::Create(spec);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

// A pattern distinct per (seed, rank, layer, byte).
void Fill(const KvStorage& storage, int32_t block, int seed) {
  const int64_t bytes = storage.spec.LayerBlockBytes();
  for (int32_t rank = 0; rank < storage.spec.num_ranks; ++rank) {
    for (int32_t layer = 0; layer < storage.spec.num_layers; ++layer) {
      auto* p = static_cast<unsigned char*>(storage.BlockData(layer, BlockId{block}, rank));
      for (int64_t j = 0; j < bytes; ++j) p[j] = static_cast<unsigned char>(seed * 61 + rank * 29 + layer * 13 + j);
    }
  }
}

std::string Payload(const KvStorage& storage, int32_t block) {
  const KvCacheSpec& s = storage.spec;
  std::string out(static_cast<size_t>(s.LayerBlockBytes() * s.num_layers * s.num_ranks), '\0');
  CopyBlockOut(storage, block, out.data());
  return out;
}

bool WriteBlock(Tier2Store& store, const KvStorage& storage, int32_t block, const BlockHash& hash,
                const BlockHash& parent = {}) {
  return store.Write(hash, parent, [storage, block](char* out) {
    CopyBlockOut(storage, block, out);
    return true;
  });
}

int32_t RestoreAndWait(Tier2Store& store, const KvStorage& storage, std::vector<BlockHash> hashes,
                       std::vector<int32_t> blocks) {
  absl::Notification done;
  int32_t restored = -1;
  store.Restore(storage, std::move(hashes), std::move(blocks), [&](int32_t n) {
    restored = n;
    done.Notify();
  });
  done.WaitForNotification();
  return restored;
}

std::string FileOf(const std::string& dir, const BlockHash& hash) {
  return absl::StrCat(dir, "/", hash.ToHex(), ".kvb");
}

void FlipByte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.is_open()) << path;
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  ASSERT_TRUE(f.good()) << path << " at " << offset;
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(offset);
  f.write(&c, 1);
  ASSERT_TRUE(f.good()) << path << " at " << offset;
}

TEST(Tier2StoreTest, AWrittenBlockRestoresByteIdenticalIntoAnotherPoolBlock) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  auto store = OpenOrDie(dir.path());
  ASSERT_NE(store, nullptr);
  const KvStorage storage = pool->storage();
  Fill(storage, 2, 7);
  Fill(storage, 9, 99);
  const std::string written = Payload(storage, 2);
  ASSERT_NE(written, Payload(storage, 9));

  EXPECT_TRUE(WriteBlock(*store, storage, 2, HashOf(0)));
  store->Flush();
  EXPECT_TRUE(store->Contains(HashOf(0)));
  EXPECT_EQ(store->CountPrefix({HashOf(0)}), 1);
  EXPECT_TRUE(std::filesystem::exists(FileOf(dir.path(), HashOf(0))));

  EXPECT_EQ(RestoreAndWait(*store, storage, {HashOf(0)}, {9}), 1);
  EXPECT_EQ(Payload(storage, 9), written);
  const Tier2Stats stats = store->Stats();
  EXPECT_EQ(stats.writes, 1);
  EXPECT_EQ(stats.restored_blocks, 1);
  EXPECT_EQ(stats.restores, 1);
  EXPECT_EQ(stats.restore_misses, 0);
  EXPECT_EQ(stats.blocks, 1);
  EXPECT_EQ(stats.bytes, store->FileBytes());
  EXPECT_EQ(store->FileBytes(), FileBytesOf(SmallSpec()));
  EXPECT_GE(stats.restore_seconds, 0.0);
}

TEST(Tier2StoreTest, AHashAlreadyStoredOrQueuedIsNotWrittenAgain) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  auto store = OpenOrDie(dir.path());
  ASSERT_NE(store, nullptr);
  Fill(pool->storage(), 0, 1);
  EXPECT_TRUE(WriteBlock(*store, pool->storage(), 0, HashOf(0)));
  EXPECT_TRUE(WriteBlock(*store, pool->storage(), 0, HashOf(0)));
  store->Flush();
  EXPECT_TRUE(WriteBlock(*store, pool->storage(), 0, HashOf(0)));
  store->Flush();
  EXPECT_EQ(store->Stats().writes, 1);
  EXPECT_EQ(store->Stats().write_drops, 0);
}

TEST(Tier2StoreTest, CountPrefixCountsOnlyTheLeadingStoredRunAndRestoreStopsAtTheFirstAbsentBlock) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  auto store = OpenOrDie(dir.path());
  ASSERT_NE(store, nullptr);
  const KvStorage storage = pool->storage();
  for (int i : {0, 1, 3}) {
    Fill(storage, i, i + 1);
    WriteBlock(*store, storage, i, HashOf(i));
  }
  store->Flush();
  const std::vector<BlockHash> chain = {HashOf(0), HashOf(1), HashOf(2), HashOf(3)};
  EXPECT_EQ(store->CountPrefix(chain), 2);
  EXPECT_EQ(store->CountPrefix({HashOf(2), HashOf(3)}), 0);
  EXPECT_EQ(store->CountPrefix({}), 0);
  EXPECT_TRUE(store->Contains(HashOf(3)));

  EXPECT_EQ(RestoreAndWait(*store, storage, chain, {10, 11, 12, 13}), 2);
  EXPECT_EQ(Payload(storage, 10), Payload(storage, 0));
  EXPECT_EQ(Payload(storage, 11), Payload(storage, 1));
  EXPECT_NE(Payload(storage, 13), Payload(storage, 3));  // Never reached: past the gap.
  const Tier2Stats stats = store->Stats();
  EXPECT_EQ(stats.restored_blocks, 2);
  EXPECT_EQ(stats.restore_misses, 2);
  EXPECT_EQ(stats.restores, 1);
}

TEST(Tier2StoreTest, EvictionDeletesTheLeastRecentlyUsedFileAndARestoreRefreshesRecency) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  auto store = OpenOrDie(dir.path(), SmallSpec(), TestModel(), /*capacity_files=*/3);
  ASSERT_NE(store, nullptr);
  const KvStorage storage = pool->storage();
  // One at a time, so that the order of the writes is the order of use.
  for (int i = 0; i < 4; ++i) {
    Fill(storage, i, i + 1);
    WriteBlock(*store, storage, i, HashOf(i));
    store->Flush();
  }
  EXPECT_FALSE(store->Contains(HashOf(0)));
  EXPECT_FALSE(std::filesystem::exists(FileOf(dir.path(), HashOf(0))));
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(store->Contains(HashOf(i))) << i;
  EXPECT_EQ(store->Stats().evictions, 1);
  EXPECT_EQ(store->Stats().bytes, 3 * store->FileBytes());

  // Block 1 is now the least recent; restoring it makes block 2 so.
  EXPECT_EQ(RestoreAndWait(*store, storage, {HashOf(1)}, {8}), 1);
  Fill(storage, 4, 5);
  WriteBlock(*store, storage, 4, HashOf(4));
  store->Flush();
  EXPECT_TRUE(store->Contains(HashOf(1)));
  EXPECT_FALSE(store->Contains(HashOf(2)));
  EXPECT_FALSE(std::filesystem::exists(FileOf(dir.path(), HashOf(2))));
  EXPECT_TRUE(store->Contains(HashOf(3)));
  EXPECT_TRUE(store->Contains(HashOf(4)));
  const Tier2Stats stats = store->Stats();
  EXPECT_EQ(stats.evictions, 2);
  EXPECT_EQ(stats.blocks, 3);
  EXPECT_EQ(stats.capacity_bytes, 3 * store->FileBytes());
}

// The router follows the tier through its listener: every block indexed
// (with its chain parent) and dropped, and, when a listener is set, every
// block indexed then, also after a restart (the parents from the headers).
TEST(Tier2StoreTest, AListenerHearsEveryBlockStoredAndDroppedAndOnBeingSetWhatIsHeld) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  const KvStorage storage = pool->storage();
  {
    auto store = OpenOrDie(dir.path(), SmallSpec(), TestModel(), /*capacity_files=*/3);
    ASSERT_NE(store, nullptr);
    KvEventLog log;
    store->set_listener(&log);
    for (int i = 0; i < 4; ++i) {
      Fill(storage, i, i + 1);
      WriteBlock(*store, storage, i, HashOf(i), i == 0 ? BlockHash{} : HashOf(i - 1));
      store->Flush();
    }
    store->set_listener(nullptr);
    const KvEventBatch b = log.Read(0);
    std::vector<std::pair<KvEventKind, BlockHash>> got;
    for (const KvEvent& e : b.events) {
      if (e.kind != KvEventKind::kCleared) got.emplace_back(e.kind, e.hash);
    }
    EXPECT_EQ(got, (std::vector<std::pair<KvEventKind, BlockHash>>{{KvEventKind::kStored, HashOf(0)},
                                                                   {KvEventKind::kStored, HashOf(1)},
                                                                   {KvEventKind::kStored, HashOf(2)},
                                                                   {KvEventKind::kStored, HashOf(3)},
                                                                   {KvEventKind::kRemoved, HashOf(0)}}));
    EXPECT_EQ(b.events[4].parent, HashOf(2));
  }
  auto store = OpenOrDie(dir.path(), SmallSpec(), TestModel(), /*capacity_files=*/3);
  ASSERT_NE(store, nullptr);
  KvEventLog log;
  store->set_listener(&log);
  const KvEventBatch b = log.Read(0);
  ASSERT_EQ(b.events.size(), 4u);  // Cleared, then the three held (in the order of their files' times).
  absl::flat_hash_map<BlockHash, BlockHash> parents;
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(b.events[i].kind, KvEventKind::kStored);
    parents[b.events[i].hash] = b.events[i].parent;
  }
  EXPECT_EQ(parents, (absl::flat_hash_map<BlockHash, BlockHash>{
                         {HashOf(1), HashOf(0)}, {HashOf(2), HashOf(1)}, {HashOf(3), HashOf(2)}}));
  store->set_listener(nullptr);
}

TEST(Tier2StoreTest, ReopeningTheDirectoryIndexesTheSameBlocksAndRestoresThemByteIdentical) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  const KvStorage storage = pool->storage();
  {
    auto store = OpenOrDie(dir.path());
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 3; ++i) {
      Fill(storage, i, 40 + i);
      WriteBlock(*store, storage, i, HashOf(i));
    }
    // No Flush: the destructor finishes the queued writes.
  }
  auto store = OpenOrDie(dir.path());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->CountPrefix({HashOf(0), HashOf(1), HashOf(2)}), 3);
  const Tier2Stats opened = store->Stats();
  EXPECT_EQ(opened.blocks, 3);
  EXPECT_EQ(opened.discarded_at_open, 0);
  EXPECT_EQ(RestoreAndWait(*store, storage, {HashOf(0), HashOf(1), HashOf(2)}, {5, 6, 7}), 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Payload(storage, 5 + i), Payload(storage, i)) << i;
}

TEST(Tier2StoreTest, ReopeningWithASmallerCapacityEvictsDownToIt) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  const KvStorage storage = pool->storage();
  {
    auto store = OpenOrDie(dir.path());
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 4; ++i) {
      Fill(storage, i, i);
      WriteBlock(*store, storage, i, HashOf(i));
    }
  }
  auto store = OpenOrDie(dir.path(), SmallSpec(), TestModel(), /*capacity_files=*/2);
  ASSERT_NE(store, nullptr);
  const Tier2Stats stats = store->Stats();
  EXPECT_EQ(stats.blocks, 2);
  EXPECT_EQ(stats.evictions, 2);
  EXPECT_EQ(stats.bytes, 2 * store->FileBytes());
}

// Opens `dir` again and expects `hash`'s file to be refused: deleted,
// counted, never restored.
void ExpectDiscardedAtOpen(const std::string& dir, const BlockHash& hash, int64_t discarded = 1) {
  auto store = OpenOrDie(dir);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->Stats().discarded_at_open, discarded);
  EXPECT_FALSE(store->Contains(hash));
  EXPECT_FALSE(std::filesystem::exists(FileOf(dir, hash)));
  auto pool = PoolOrDie();
  EXPECT_EQ(RestoreAndWait(*store, pool->storage(), {hash}, {0}), 0);
  EXPECT_EQ(store->Stats().restore_misses, 1);
}

// Writes HashOf(0) into `dir` through a store of `model` and `spec`.
void WriteOne(const std::string& dir, const KvCacheSpec& spec = SmallSpec(), const ModelIdentity& model = TestModel()) {
  auto pool = PoolOrDie(spec);
  auto store = OpenOrDie(dir, spec, model);
  ASSERT_NE(store, nullptr);
  Fill(pool->storage(), 0, 3);
  WriteBlock(*store, pool->storage(), 0, HashOf(0));
  store->Flush();
  ASSERT_TRUE(store->Contains(HashOf(0)));
}

TEST(Tier2StoreTest, ATruncatedFileIsDeletedAtOpen) {
  ScratchDir dir;
  WriteOne(dir.path());
  const std::string path = FileOf(dir.path(), HashOf(0));
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1);
  ExpectDiscardedAtOpen(dir.path(), HashOf(0));
}

TEST(Tier2StoreTest, AFileWithACorruptedHeaderByteIsDeletedAtOpen) {
  ScratchDir dir;
  WriteOne(dir.path());
  FlipByte(FileOf(dir.path(), HashOf(0)), 60);  // Inside the payload-size field.
  ExpectDiscardedAtOpen(dir.path(), HashOf(0));
}

TEST(Tier2StoreTest, AFileOfAnotherModelIsDeletedAtOpen) {
  ScratchDir dir;
  WriteOne(dir.path(), SmallSpec(), HashBytes("another model"));
  ExpectDiscardedAtOpen(dir.path(), HashOf(0));
}

TEST(Tier2StoreTest, AFileOfAnotherPoolShapeOfTheSameSizeIsDeletedAtOpen) {
  ScratchDir dir;
  KvCacheSpec bf16 = SmallSpec();
  bf16.dtype = DType::kBF16;
  bf16.head_dim = 16;  // Same bytes per block as f32 with 8: only the fingerprint tells them apart.
  ASSERT_EQ(FileBytesOf(bf16), FileBytesOf(SmallSpec()));
  WriteOne(dir.path(), bf16);
  ExpectDiscardedAtOpen(dir.path(), HashOf(0));
}

TEST(Tier2StoreTest, AFileWhoseNameIsNotItsHashIsDeletedAtOpen) {
  ScratchDir dir;
  WriteOne(dir.path());
  std::filesystem::rename(FileOf(dir.path(), HashOf(0)), FileOf(dir.path(), HashOf(1)));
  ExpectDiscardedAtOpen(dir.path(), HashOf(1));
}

TEST(Tier2StoreTest, OpenDeletesTemporaryFilesAndLeavesOtherFilesAlone) {
  ScratchDir dir;
  const std::string temp = FileOf(dir.path(), HashOf(0)) + ".tmp";
  const std::string other = dir.path() + "/notes.txt";
  std::ofstream(temp) << "half a block";
  std::ofstream(other) << "not the store's";
  auto store = OpenOrDie(dir.path());
  ASSERT_NE(store, nullptr);
  EXPECT_FALSE(std::filesystem::exists(temp));
  EXPECT_TRUE(std::filesystem::exists(other));
  EXPECT_EQ(store->Stats().blocks, 0);
  EXPECT_EQ(store->Stats().discarded_at_open, 0);
}

TEST(Tier2StoreTest, ACorruptedPayloadByteFailsTheRestoreAndDeletesTheFile) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  auto store = OpenOrDie(dir.path());
  ASSERT_NE(store, nullptr);
  const KvStorage storage = pool->storage();
  Fill(storage, 0, 11);
  WriteBlock(*store, storage, 0, HashOf(0));
  store->Flush();
  FlipByte(FileOf(dir.path(), HashOf(0)), Tier2Store::kHeaderBytes + 37);

  // The target block's bytes are not asserted on: a failed restore leaves
  // them unspecified.
  EXPECT_EQ(RestoreAndWait(*store, storage, {HashOf(0)}, {5}), 0);
  const Tier2Stats stats = store->Stats();
  EXPECT_EQ(stats.checksum_failures, 1);
  EXPECT_EQ(stats.restored_blocks, 0);
  EXPECT_EQ(stats.restore_misses, 1);
  EXPECT_EQ(stats.blocks, 0);
  EXPECT_EQ(stats.bytes, 0);
  EXPECT_FALSE(store->Contains(HashOf(0)));
  EXPECT_FALSE(std::filesystem::exists(FileOf(dir.path(), HashOf(0))));
}

TEST(Tier2StoreTest, AFullWriteQueueDropsTheWriteAndCountsIt) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  const KvStorage storage = pool->storage();
  Tier2Options options = OptionsFor(dir.path(), 16 * FileBytesOf(SmallSpec()));
  options.io_threads = 1;
  options.max_queued_writes = 1;
  auto opened = Tier2Store::Open(TestModel(), SmallSpec(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  Tier2Store& store = **opened;

  absl::Notification started;
  absl::Notification release;
  EXPECT_TRUE(store.Write(HashOf(0), BlockHash{}, [&](char* out) {
    started.Notify();
    release.WaitForNotification();
    CopyBlockOut(storage, 0, out);
    return true;
  }));
  // The only thread holds write 0, so the queue is empty.
  started.WaitForNotification();
  EXPECT_TRUE(WriteBlock(store, storage, 1, HashOf(1)));   // Queued.
  EXPECT_FALSE(WriteBlock(store, storage, 2, HashOf(2)));  // Queue full.
  EXPECT_TRUE(WriteBlock(store, storage, 1, HashOf(1)));   // Already queued.
  EXPECT_TRUE(WriteBlock(store, storage, 0, HashOf(0)));   // In flight.
  EXPECT_EQ(store.Stats().write_drops, 1);
  release.Notify();
  store.Flush();

  const Tier2Stats stats = store.Stats();
  EXPECT_EQ(stats.writes, 2);
  EXPECT_EQ(stats.write_drops, 1);
  EXPECT_TRUE(store.Contains(HashOf(0)));
  EXPECT_TRUE(store.Contains(HashOf(1)));
  EXPECT_FALSE(store.Contains(HashOf(2)));
}

TEST(Tier2StoreTest, RestoresRunAheadOfQueuedWrites) {
  ScratchDir dir;
  auto pool = PoolOrDie();
  const KvStorage storage = pool->storage();
  Tier2Options options = OptionsFor(dir.path(), 16 * FileBytesOf(SmallSpec()));
  options.io_threads = 1;
  auto opened = Tier2Store::Open(TestModel(), SmallSpec(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  Tier2Store& store = **opened;
  Fill(storage, 0, 1);
  WriteBlock(store, storage, 0, HashOf(0));
  store.Flush();

  absl::Notification started;
  absl::Notification release;
  store.Write(HashOf(1), BlockHash{}, [&](char* out) {
    started.Notify();
    release.WaitForNotification();
    CopyBlockOut(storage, 1, out);
    return true;
  });
  started.WaitForNotification();
  absl::Mutex mu;
  std::vector<std::string> order;
  store.Write(HashOf(2), BlockHash{}, [&](char* out) {
    absl::MutexLock lock(&mu);
    order.push_back("write");
    CopyBlockOut(storage, 2, out);
    return true;
  });
  store.Restore(storage, {HashOf(0)}, {9}, [&](int32_t n) {
    absl::MutexLock lock(&mu);
    order.push_back(absl::StrCat("restore ", n));
  });
  release.Notify();
  store.Flush();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<std::string>{"restore 1", "write"}));
}

TEST(Tier2StoreTest, AReadThatReturnsFalseDropsTheWriteAndIndexesNothing) {
  ScratchDir dir;
  auto store = OpenOrDie(dir.path());
  ASSERT_NE(store, nullptr);
  EXPECT_TRUE(store->Write(HashOf(0), BlockHash{}, [](char*) { return false; }));
  store->Flush();
  EXPECT_FALSE(store->Contains(HashOf(0)));
  EXPECT_FALSE(std::filesystem::exists(FileOf(dir.path(), HashOf(0))));
  EXPECT_FALSE(std::filesystem::exists(FileOf(dir.path(), HashOf(0)) + ".tmp"));
  const Tier2Stats stats = store->Stats();
  EXPECT_EQ(stats.write_drops, 1);
  EXPECT_EQ(stats.writes, 0);
  EXPECT_EQ(stats.blocks, 0);

  // A later write of the same hash is not taken for a duplicate.
  auto pool = PoolOrDie();
  EXPECT_TRUE(WriteBlock(*store, pool->storage(), 0, HashOf(0)));
  store->Flush();
  EXPECT_TRUE(store->Contains(HashOf(0)));
}

TEST(Tier2StoreTest, ATwoRankPoolRoundTripsEveryRanksBytes) {
  KvCacheSpec spec = SmallSpec();
  spec.num_ranks = 2;
  spec.model_kv_heads = 4;
  ASSERT_TRUE(spec.Validate().ok()) << spec.Validate();
  ScratchDir dir;
  auto pool = PoolOrDie(spec);
  auto store = OpenOrDie(dir.path(), spec);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->FileBytes(), Tier2Store::kHeaderBytes + spec.LayerBlockBytes() * 2 * 3);
  const KvStorage storage = pool->storage();
  Fill(storage, 3, 17);

  // The payload is rank-major, then layer.
  const std::string payload = Payload(storage, 3);
  const int64_t lb = spec.LayerBlockBytes();
  EXPECT_EQ(std::memcmp(payload.data() + (1 * 3 + 2) * lb, storage.BlockData(2, BlockId{3}, 1), lb), 0);

  WriteBlock(*store, storage, 3, HashOf(0));
  store->Flush();
  EXPECT_EQ(RestoreAndWait(*store, storage, {HashOf(0)}, {12}), 1);
  EXPECT_EQ(Payload(storage, 12), payload);
}

TEST(Tier2StoreTest, BadOptionsAreRefusedWithInvalidArgument) {
  ScratchDir dir;
  const int64_t file = FileBytesOf(SmallSpec());
  struct Case {
    Tier2Options options;
    const char* names;
  };
  Tier2Options empty_dir = OptionsFor("", file);
  Tier2Options zero_capacity = OptionsFor(dir.path(), 0);
  Tier2Options under_one_file = OptionsFor(dir.path(), file - 1);
  Tier2Options no_threads = OptionsFor(dir.path(), file);
  no_threads.io_threads = 0;
  Tier2Options no_queue = OptionsFor(dir.path(), file);
  no_queue.max_queued_writes = 0;
  for (const Case& c :
       {Case{empty_dir, "dir"}, Case{zero_capacity, "capacity_bytes"}, Case{under_one_file, "capacity_bytes"},
        Case{no_threads, "io_threads"}, Case{no_queue, "max_queued_writes"}}) {
    const auto store = Tier2Store::Open(TestModel(), SmallSpec(), c.options);
    ASSERT_FALSE(store.ok()) << c.names;
    EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument) << store.status();
    EXPECT_NE(store.status().message().find(c.names), absl::string_view::npos) << store.status();
  }
  EXPECT_TRUE(Tier2Store::Open(TestModel(), SmallSpec(), OptionsFor(dir.path(), file)).ok());

  KvCacheSpec bad = SmallSpec();
  bad.num_layers = 0;
  EXPECT_EQ(Tier2Store::Open(TestModel(), bad, OptionsFor(dir.path(), file)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Tier2StoreTest, ADirectoryThatCannotBeCreatedIsAnError) {
  ScratchDir dir;
  const std::string file = dir.path() + "/plain_file";
  std::ofstream(file) << "x";
  const auto store = Tier2Store::Open(TestModel(), SmallSpec(), OptionsFor(file + "/store", FileBytesOf(SmallSpec())));
  EXPECT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find(file), absl::string_view::npos) << store.status();
}

}  // namespace
}  // namespace pdserve
