#include "base/tls.h"

#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <cstdio>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace pdserve {
namespace {

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

absl::StatusOr<File> Open(const std::string& path, const char* what) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": cannot be read"));
  return File(f);
}

// Every certificate in a PEM file, in order.
absl::StatusOr<std::vector<X509*>> ReadCerts(const std::string& path, const char* what) {
  absl::StatusOr<File> f = Open(path, what);
  if (!f.ok()) return f.status();
  std::vector<X509*> certs;
  while (X509* c = PEM_read_X509(f->get(), nullptr, nullptr, nullptr)) certs.push_back(c);
  if (certs.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": no PEM certificate in it"));
  return certs;
}

void FreeCerts(std::vector<X509*>& certs) {
  for (X509* c : certs) X509_free(c);
  certs.clear();
}

// Refuses calls whose peer certificate does not name the expected role.
class PeerRoleCheck final : public grpc::AuthMetadataProcessor {
 public:
  explicit PeerRoleCheck(std::string role) : role_(std::move(role)), host_(RoleHostName(role_)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata&, grpc::AuthContext* context, OutputMetadata*, OutputMetadata*) override {
    std::string names;
    for (const grpc::string_ref& san : context->FindPropertyValues("x509_subject_alternative_name")) {
      const std::string s(san.data(), san.size());
      if (s == host_) return grpc::Status::OK;
      if (absl::EndsWith(s, ".pdserve.internal")) absl::StrAppend(&names, names.empty() ? "" : ", ", s);
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat("the peer's certificate is not a ", role_, "'s (it names ",
                                     names.empty() ? "no pdserve role" : names, ")"));
  }

 private:
  const std::string role_;
  const std::string host_;
};

}  // namespace

std::string RoleHostName(const std::string& role) { return absl::StrCat(role, ".pdserve.internal"); }

absl::Status CheckTlsFiles(const TlsFiles& files, const std::string& role) {
  if (files.cert.empty() || files.key.empty() || files.ca.empty()) {
    return absl::InvalidArgumentError("TLS needs a certificate, its key and the cluster CA (all three files)");
  }
  absl::StatusOr<std::vector<X509*>> chain = ReadCerts(files.cert, "certificate");
  if (!chain.ok()) return chain.status();
  absl::StatusOr<std::vector<X509*>> cas = ReadCerts(files.ca, "CA");
  if (!cas.ok()) {
    FreeCerts(*chain);
    return cas.status();
  }
  absl::Status st;
  absl::StatusOr<File> kf = Open(files.key, "key");
  EVP_PKEY* key = kf.ok() ? PEM_read_PrivateKey(kf->get(), nullptr, nullptr, nullptr) : nullptr;
  X509* leaf = (*chain)[0];
  if (!kf.ok()) {
    st = kf.status();
  } else if (key == nullptr) {
    st = absl::InvalidArgumentError(absl::StrCat("key ", files.key, ": no PEM private key in it"));
  } else if (X509_check_private_key(leaf, key) != 1) {
    st = absl::InvalidArgumentError(absl::StrCat("key ", files.key, " is not the key of certificate ", files.cert));
  } else {
    X509_STORE* store = X509_STORE_new();
    for (X509* ca : *cas) X509_STORE_add_cert(store, ca);
    STACK_OF(X509)* untrusted = sk_X509_new_null();
    for (size_t i = 1; i < chain->size(); ++i) sk_X509_push(untrusted, (*chain)[i]);
    X509_STORE_CTX* ctx = X509_STORE_CTX_new();
    X509_STORE_CTX_init(ctx, store, leaf, untrusted);
    if (X509_verify_cert(ctx) != 1) {
      st = absl::InvalidArgumentError(
          absl::StrCat("certificate ", files.cert, " does not verify against the CA ", files.ca, ": ",
                       X509_verify_cert_error_string(X509_STORE_CTX_get_error(ctx))));
    } else if (!role.empty()) {
      const std::string host = RoleHostName(role);
      if (X509_check_host(leaf, host.data(), host.size(), 0, nullptr) != 1) {
        st = absl::InvalidArgumentError(
            absl::StrCat("certificate ", files.cert, " does not name the role ", role, " (DNS name ", host, ")"));
      }
    }
    X509_STORE_CTX_free(ctx);
    sk_X509_free(untrusted);
    X509_STORE_free(store);
  }
  EVP_PKEY_free(key);
  FreeCerts(*chain);
  FreeCerts(*cas);
  return st;
}

std::shared_ptr<grpc::ServerCredentials> ServerTlsCredentials(const TlsFiles& files, const std::string& peer_role) {
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.ca, static_cast<unsigned>(absl::ToInt64Seconds(files.refresh)));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  options.watch_root_certs();
  options.set_cert_request_type(peer_role.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                  : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::experimental::TlsServerCredentials(options);
  if (!peer_role.empty()) creds->SetAuthMetadataProcessor(std::make_shared<PeerRoleCheck>(peer_role));
  return creds;
}

std::shared_ptr<grpc::ChannelCredentials> ChannelTlsCredentials(const TlsFiles& files, const std::string& server_role,
                                                                grpc::ChannelArguments* args) {
  const unsigned refresh = static_cast<unsigned>(absl::ToInt64Seconds(files.refresh));
  auto provider = files.cert.empty()
                      ? std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.ca, refresh)
                      : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.key, files.cert,
                                                                                            files.ca, refresh);
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  if (!files.cert.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  if (!server_role.empty()) args->SetSslTargetNameOverride(RoleHostName(server_role));
  return grpc::experimental::TlsCredentials(options);
}

}  // namespace pdserve
