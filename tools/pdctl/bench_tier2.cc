#include "tools/pdctl/bench_tier2.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "kv/block_hash.h"
#include "kv/kv_manager.h"
#include "kv/tier2_store.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, tier2_dir, "",
          "bench-tier2: the directory whose disk is measured (default: a new directory under /var/tmp, removed after)");
ABSL_FLAG(int, tier2_blocks, 128, "bench-tier2: blocks written and read back (the default shape: 2 MiB each)");
ABSL_FLAG(int, tier2_restore_blocks, 32, "bench-tier2: blocks per restore (32: a 512-token prefix)");
ABSL_FLAG(int, tier2_layers, 32, "bench-tier2: layers of the block shape (the default: an 8B model's)");
ABSL_FLAG(int, tier2_kv_heads, 8, "bench-tier2: KV heads of the block shape");
ABSL_FLAG(int, tier2_head_dim, 128, "bench-tier2: head dimension of the block shape (BF16, blocks of 16)");
ABSL_FLAG(int, tier2_rounds, 3, "bench-tier2: rounds of (restores, disk read), alternated");

namespace pdserve::pdctl {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Makes the file's pages leave the page cache, so the next read comes from
// the disk (written out first: dirty pages stay).
absl::Status DropFromCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("bench-tier2: open ", path));
  int rc = ::fdatasync(fd);
  if (rc == 0) rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat("bench-tier2: cannot drop ", path, " from the page cache"));
  return absl::OkStatus();
}

absl::Status DropStoreFromCache(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".kvb") continue;
    if (absl::Status s = DropFromCache(e.path()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Seconds to read `path` front to back in pieces of `piece` bytes.
absl::StatusOr<double> ReadFile(const std::string& path, int64_t piece) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("bench-tier2: open ", path));
  std::vector<char> buf(static_cast<size_t>(piece));
  const absl::Time t0 = absl::Now();
  off_t at = 0;
  for (;;) {
    const ssize_t got = ::pread(fd, buf.data(), buf.size(), at);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    at += got;
  }
  const double s = absl::ToDoubleSeconds(absl::Now() - t0);
  ::close(fd);
  return s;
}

}  // namespace

absl::Status RunBenchTier2(bool json) {
  const int blocks = absl::GetFlag(FLAGS_tier2_blocks);
  const int per_restore = absl::GetFlag(FLAGS_tier2_restore_blocks);
  const int rounds = absl::GetFlag(FLAGS_tier2_rounds);
  if (blocks < 1 || per_restore < 1 || rounds < 1) {
    return absl::InvalidArgumentError(
        "bench-tier2: --tier2_blocks, --tier2_restore_blocks and --tier2_rounds must be >= 1");
  }
  const KvCacheSpec spec{.num_layers = absl::GetFlag(FLAGS_tier2_layers),
                         .num_kv_heads = absl::GetFlag(FLAGS_tier2_kv_heads),
                         .head_dim = absl::GetFlag(FLAGS_tier2_head_dim),
                         .block_size = 16,
                         .dtype = DType::kBF16,
                         .num_blocks = 2 * blocks};
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<KvManager>> made = KvManager::Create(spec);
  if (!made.ok()) return made.status();
  KvManager& kv = **made;
  {
    std::mt19937_64 rng(7);
    auto* words = static_cast<uint64_t*>(kv.region().data());
    for (size_t i = 0; i < kv.region().size() / 8; ++i) words[i] = rng();
  }

  std::string dir = absl::GetFlag(FLAGS_tier2_dir);
  const bool own_dir = dir.empty();
  if (own_dir) {
    char templ[] = "/var/tmp/pdserve-bench-tier2-XXXXXX";
    if (::mkdtemp(templ) == nullptr) return absl::ErrnoToStatus(errno, "bench-tier2: mkdtemp under /var/tmp");
    dir = templ;
  }
  struct Cleanup {
    std::string dir;
    bool own;
    ~Cleanup() {
      if (own) std::filesystem::remove_all(dir);
    }
  } cleanup{dir, own_dir};

  const ModelIdentity model = HashBytes("bench-tier2");
  absl::StatusOr<std::unique_ptr<Tier2Store>> opened =
      Tier2Store::Open(model, spec,
                       {.dir = dir,
                        .capacity_bytes = int64_t{2} * blocks *
                                          (spec.LayerBlockBytes() * spec.num_layers + Tier2Store::kHeaderBytes)});
  if (!opened.ok()) return opened.status();
  Tier2Store& store = **opened;
  const int64_t file_bytes = store.FileBytes();

  // The blocks written: pool blocks [0, blocks), each under a hash of its own.
  SequenceKv source = kv.NewSequence();
  if (absl::Status s = kv.Grow(source, blocks * spec.block_size); !s.ok()) return s;
  std::vector<BlockHash> hashes(static_cast<size_t>(blocks));
  for (int i = 0; i < blocks; ++i) hashes[i] = HashBytes(absl::StrCat("bench-tier2 block ", i));
  const KvStorage pool = kv.storage();
  const absl::Time w0 = absl::Now();
  for (int i = 0; i < blocks; ++i) {
    const int32_t b = source.block_table()[i];
    store.Write(hashes[i], i > 0 ? hashes[i - 1] : BlockHash{}, [pool, b](char* out) {
      CopyBlockOut(pool, b, out);
      return true;
    });
  }
  store.Flush();
  const double write_s = absl::ToDoubleSeconds(absl::Now() - w0);
  if (store.Stats().writes != blocks) {
    return absl::InternalError(absl::StrCat("bench-tier2: ", store.Stats().writes, " of ", blocks,
                                            " blocks written (", store.Stats().write_drops, " dropped, ",
                                            store.Stats().write_errors, " failed)"));
  }

  // The disk's own rate: a plain file of the same bytes.
  const std::string plain = dir + "/sequential.bin";
  {
    const int fd = ::open(plain.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return absl::ErrnoToStatus(errno, "bench-tier2: create the sequential file");
    std::vector<char> buf(static_cast<size_t>(file_bytes));
    bool ok = true;
    for (int i = 0; i < blocks && ok; ++i) {
      CopyBlockOut(pool, source.block_table()[i], buf.data() + Tier2Store::kHeaderBytes);
      ok = ::pwrite(fd, buf.data(), buf.size(), static_cast<off_t>(i) * file_bytes) == static_cast<ssize_t>(buf.size());
    }
    ::close(fd);
    if (!ok) return absl::InternalError("bench-tier2: writing the sequential file failed");
  }

  SequenceKv target = kv.NewSequence();
  if (absl::Status s = kv.Grow(target, blocks * spec.block_size); !s.ok()) return s;
  std::vector<double> restore_s, per_restore_ms, disk_s;
  for (int round = 0; round < rounds; ++round) {
    if (absl::Status s = DropStoreFromCache(dir); !s.ok()) return s;
    const absl::Time r0 = absl::Now();
    for (int first = 0; first < blocks; first += per_restore) {
      const int n = std::min(per_restore, blocks - first);
      std::vector<BlockHash> h(hashes.begin() + first, hashes.begin() + first + n);
      std::vector<int32_t> into(target.block_table().begin() + first, target.block_table().begin() + first + n);
      absl::Notification done;
      int32_t verified = 0;
      const absl::Time c0 = absl::Now();
      store.Restore(pool, std::move(h), std::move(into), [&](int32_t v) {
        verified = v;
        done.Notify();
      });
      done.WaitForNotification();
      per_restore_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - c0));
      if (verified != n) {
        return absl::DataLossError(absl::StrCat("bench-tier2: ", verified, " of ", n, " blocks restored and verified"));
      }
    }
    restore_s.push_back(absl::ToDoubleSeconds(absl::Now() - r0));
    if (absl::Status s = DropFromCache(plain); !s.ok()) return s;
    absl::StatusOr<double> d = ReadFile(plain, file_bytes);
    if (!d.ok()) return d.status();
    disk_s.push_back(*d);
  }
  for (int i = 0; i < blocks; ++i) {
    for (int32_t l = 0; l < spec.num_layers; ++l) {
      if (std::memcmp(pool.BlockData(l, BlockId{source.block_table()[i]}),
                      pool.BlockData(l, BlockId{target.block_table()[i]}), spec.LayerBlockBytes()) != 0) {
        return absl::DataLossError(absl::StrCat("bench-tier2: block ", i, " came back different"));
      }
    }
  }

  const double total = static_cast<double>(file_bytes) * blocks;
  nlohmann::json out = {{"dir", dir},
                        {"block_file_bytes", file_bytes},
                        {"blocks", blocks},
                        {"blocks_per_restore", per_restore},
                        {"rounds", rounds},
                        {"write_gbps", total / write_s / 1e9},
                        {"restore_gbps", total / Median(restore_s) / 1e9},
                        {"restore_ms_median", Median(per_restore_ms)},
                        {"disk_read_gbps", total / Median(disk_s) / 1e9},
                        {"restore_vs_disk_read", Median(disk_s) / Median(restore_s)}};
  if (json) {
    std::printf("%s\n", out.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("bench-tier2  %d blocks of %.2f MiB in %s, restores of %d blocks, %d rounds (medians)\n", blocks,
              static_cast<double>(file_bytes) / (1 << 20), dir.c_str(), per_restore, rounds);
  std::printf("  write (queued, flushed)    %7.2f GB/s\n", out["write_gbps"].get<double>());
  std::printf("  restore, checked           %7.2f GB/s   %.2f ms per restore of %d blocks\n",
              out["restore_gbps"].get<double>(), out["restore_ms_median"].get<double>(), per_restore);
  std::printf("  disk sequential read       %7.2f GB/s   (the same bytes, one file, pieces of one block file)\n",
              out["disk_read_gbps"].get<double>());
  std::printf("  restore / disk read        %7.1f %%\n", 100 * out["restore_vs_disk_read"].get<double>());
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
