// Optional API keys for the router's client APIs (gRPC metadata
// "authorization", HTTP "Authorization: Bearer KEY").
//
// The keys file holds one key per line, `ID:SHA256HEX`: an id that logs and
// metrics may show, and the SHA-256 of the key in lowercase hex (the file
// never holds a key itself). Blank lines and lines starting with '#' are
// skipped. The file is read again when it changes (its modification time,
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
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/measured.h"

namespace pdserve::router {

// SHA-256 of `bytes`, lowercase hex.
std::string Sha256Hex(absl::string_view bytes);

class ApiKeys {
 public:
  // Reads `path` (errors: NOT_FOUND, or INVALID_ARGUMENT naming the line).
  static absl::StatusOr<std::unique_ptr<ApiKeys>> Load(std::string path, Clock clock = RealClock());

  // The id of the key in `authorization` ("Bearer KEY", or the key alone as
  // gRPC clients sometimes send it). Errors: UNAUTHENTICATED ("no API key",
  // "invalid API key"), never quoting the key.
  absl::StatusOr<std::string> Check(absl::string_view authorization);

  // Reads the file again now if it changed; what Check does once a second.
  void ReloadIfChanged();
  size_t size() const;

 private:
  struct Key {
    std::string id;
    std::string sha256;  // 32 raw bytes
  };
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
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_API_KEYS_H_
