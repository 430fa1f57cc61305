// The HTTP API's TLS: the server context new connections are given, made
// from a certificate chain and key, and made again when those files change
// (a rotation, a Kubernetes Secret update) without a restart. A pair that
// does not load is logged once and the last good context kept (a rotation
// writes the two files one after the other).
//
// Thread safety: one thread (the HTTP event loop).
#ifndef PDSERVE_ROUTER_OPENAI_SERVER_TLS_H_
#define PDSERVE_ROUTER_OPENAI_SERVER_TLS_H_

#include <openssl/ssl.h>
#include <sys/stat.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "base/tls.h"

namespace pdserve::router::openai {

class ServerTls {
 public:
  // Errors: INVALID_ARGUMENT saying which file and why.
  static absl::StatusOr<std::unique_ptr<ServerTls>> Load(const TlsFiles& files);
  ~ServerTls();
  ServerTls(const ServerTls&) = delete;
  ServerTls& operator=(const ServerTls&) = delete;

  // The context for new connections (those open hold their own reference).
  SSL_CTX* context() const { return ctx_; }
  // Loads the pair again if either file changed since the last load.
  void ReloadIfChanged();

  // The identity of a file's contents, as far as stat tells: a rewrite or
  // a rename over it changes one of these.
  struct FileStamp {
    ino_t inode = 0;
    off_t size = -1;
    timespec mtime{};
    bool operator==(const FileStamp& o) const {
      return inode == o.inode && size == o.size && mtime.tv_sec == o.mtime.tv_sec &&
             mtime.tv_nsec == o.mtime.tv_nsec;
    }
  };

 private:
  explicit ServerTls(TlsFiles files) : files_(std::move(files)) {}

  const TlsFiles files_;
  SSL_CTX* ctx_ = nullptr;
  FileStamp cert_stamp_, key_stamp_, failed_cert_, failed_key_;
};

}  // namespace pdserve::router::openai

#endif  // PDSERVE_ROUTER_OPENAI_SERVER_TLS_H_
