#include "router/openai/server_tls.h"

#include <openssl/err.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/server_util.h"

namespace pdserve::router::openai {
namespace {

ServerTls::FileStamp Stamp(const std::string& path) {
  struct stat st;
  ServerTls::FileStamp f;
  if (stat(path.c_str(), &st) == 0) f = {st.st_ino, st.st_size, st.st_mtim};
  return f;
}

std::string OpenSslError() {
  char buf[256];
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "unknown error";
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

// A server SSL_CTX for the certificate chain and key. Errors:
// INVALID_ARGUMENT saying which file and why.
absl::StatusOr<SSL_CTX*> MakeSslContext(const TlsFiles& tls) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) return absl::InternalError("SSL_CTX_new failed");
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION);
  absl::Status st;
  if (SSL_CTX_use_certificate_chain_file(ctx, tls.cert.c_str()) != 1) {
    st = absl::InvalidArgumentError(absl::StrCat("certificate ", tls.cert, ": ", OpenSslError()));
  } else if (SSL_CTX_use_PrivateKey_file(ctx, tls.key.c_str(), SSL_FILETYPE_PEM) != 1) {
    st = absl::InvalidArgumentError(absl::StrCat("key ", tls.key, ": ", OpenSslError()));
  } else if (SSL_CTX_check_private_key(ctx) != 1) {
    st = absl::InvalidArgumentError(absl::StrCat("key ", tls.key, " is not the key of ", tls.cert));
  }
  if (!st.ok()) {
    SSL_CTX_free(ctx);
    return st;
  }
  return ctx;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerTls>> ServerTls::Load(const TlsFiles& files) {
  std::unique_ptr<ServerTls> t(new ServerTls(files));
  t->cert_stamp_ = Stamp(files.cert);
  t->key_stamp_ = Stamp(files.key);
  absl::StatusOr<SSL_CTX*> ctx = MakeSslContext(files);
  if (!ctx.ok()) return ctx.status();
  t->ctx_ = *ctx;
  return t;
}

ServerTls::~ServerTls() {
  if (ctx_ != nullptr) SSL_CTX_free(ctx_);
}

void ServerTls::ReloadIfChanged() {
  const FileStamp cert = Stamp(files_.cert), key = Stamp(files_.key);
  if (cert == cert_stamp_ && key == key_stamp_) return;
  absl::StatusOr<SSL_CTX*> ctx = MakeSslContext(files_);
  if (!ctx.ok()) {
    if (!(cert == failed_cert_ && key == failed_key_)) {
      LogEvent("warning", "http_tls_reload_failed", {{"error", std::string(ctx.status().message())}});
      failed_cert_ = cert;
      failed_key_ = key;
    }
    return;
  }
  SSL_CTX_free(ctx_);  // connections still using it hold their own reference
  ctx_ = *ctx;
  cert_stamp_ = cert;
  key_stamp_ = key;
  LogEvent("info", "http_tls_reloaded", {{"cert", files_.cert}});
}

}  // namespace pdserve::router::openai
