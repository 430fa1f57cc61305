// Optional API keys for the router's client APIs (gRPC metadata
// "authorization", HTTP "Authorization: Bearer KEY").
//
// The keys file holds one key per line, `ID:SHA256HEX [rate=R] [burst=B]
// [concurrency=C]`: an id that logs and metrics may show (letters, digits,
// '.', '_', '-'), the SHA-256 of the key in lowercase hex (the file never
// holds a key itself), and optional limits on the key's generations: R
// requests per second (a token bucket holding B, default max(1, R)), and C
// requests in flight at once. Blank lines and lines starting with '#' are
// skipped. A key's limit state (its bucket, its requests in flight) is
// kept by id across reloads. The file is read again when it changes (its modification time,
// size or inode), checked at most once per second: a Kubernetes Secret
// update arrives as a new file and sends no signal. A file that no longer
// parses keeps the keys last read (and says why in the log).
//
// Thread safety: thread-safe.
#ifndef PDSERVE_ROUTER_API_KEYS_H_
#define PDSERVE_ROUTER_API_KEYS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/measured.h"

namespace pdserve::router {

// SHA-256 of `bytes`, lowercase hex.
std::string Sha256Hex(absl::string_view bytes);

// The limits of one key (0: none).
struct KeyLimits {
  double rate = 0;   // requests per second
  double burst = 0;  // the bucket's size
  int64_t concurrency = 0;
};

namespace internal {
struct KeyState;  // a key's bucket and requests in flight
}

// A generation admitted under a key: the key's id, and its place in the
// key's concurrency limit, given back when the lease is destroyed. Empty
// (id "") when keys are off.
class KeyLease {
 public:
  KeyLease() = default;
  KeyLease(std::string id, std::shared_ptr<internal::KeyState> state);
  KeyLease(KeyLease&& o) noexcept = default;
  KeyLease& operator=(KeyLease&& o) noexcept;
  ~KeyLease();
  const std::string& id() const { return id_; }

 private:
  void Release();
  std::string id_;
  std::shared_ptr<internal::KeyState> state_;
};

// A status payload (seconds, as text) saying when a refused request may be
// sent again; set on the limits' RESOURCE_EXHAUSTED.
inline constexpr char kRetryAfterPayload[] = "type.pdserve.dev/retry_after_seconds";
// And the id of the key over its limit.
inline constexpr char kKeyIdPayload[] = "type.pdserve.dev/key_id";

class ApiKeys {
 public:
  // Reads `path` (errors: NOT_FOUND, or INVALID_ARGUMENT naming the line).
  static absl::StatusOr<std::unique_ptr<ApiKeys>> Load(std::string path, Clock clock = RealClock());

  // The id of the key in `authorization` ("Bearer KEY", or the key alone as
  // gRPC clients sometimes send it). Errors: UNAUTHENTICATED ("no API key",
  // "invalid API key"), never quoting the key.
  absl::StatusOr<std::string> Check(absl::string_view authorization);

  // Check, then the key's limits for one more generation. Errors:
  // UNAUTHENTICATED as Check; RESOURCE_EXHAUSTED naming the key id and the
  // limit, with kRetryAfterPayload and kKeyIdPayload.
  absl::StatusOr<KeyLease> Admit(absl::string_view authorization);

  // Reads the file again now if it changed; what Check does once a second.
  void ReloadIfChanged();
  size_t size() const;

 private:
  struct Key {
    std::string id;
    std::string sha256;  // 32 raw bytes
    KeyLimits limits;
  };
  // The key `authorization` holds (nullptr: none). REQUIRES: mu_ held.
  absl::StatusOr<const Key*> Find(absl::string_view authorization) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct FileStamp {
    int64_t mtime_ns = 0, size = -1;
    uint64_t inode = 0;
    friend bool operator==(const FileStamp& a, const FileStamp& b) {
      return a.mtime_ns == b.mtime_ns && a.size == b.size && a.inode == b.inode;
    }
  };
  ApiKeys(std::string path, Clock clock) : path_(std::move(path)), clock_(std::move(clock)) {}
  static absl::StatusOr<std::vector<Key>> Parse(const std::string& path, absl::string_view text);
  absl::StatusOr<FileStamp> Stamp() const;

  const std::string path_;
  const Clock clock_;
  mutable absl::Mutex mu_;
  std::vector<Key> keys_ ABSL_GUARDED_BY(mu_);
  FileStamp stamp_ ABSL_GUARDED_BY(mu_);
  absl::Time next_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::flat_hash_map<std::string, std::shared_ptr<internal::KeyState>> states_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_API_KEYS_H_
