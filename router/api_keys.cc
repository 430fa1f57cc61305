#include "router/api_keys.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/numbers.h"
#include "absl/strings/cord.h"
#include "base/server_util.h"

namespace pdserve::router {
namespace {

std::string Sha256Raw(absl::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &n, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(digest), n);
}

bool ValidId(absl::string_view id) {
  return !id.empty() && std::all_of(id.begin(), id.end(), [](char c) {
    return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-';
  });
}

}  // namespace

namespace internal {
struct KeyState {
  absl::Mutex mu;
  double tokens ABSL_GUARDED_BY(mu) = -1;  // -1: not yet filled
  absl::Time refilled ABSL_GUARDED_BY(mu);
  int64_t in_flight ABSL_GUARDED_BY(mu) = 0;
};
}  // namespace internal

KeyLease::KeyLease(std::string id, std::shared_ptr<internal::KeyState> state)
    : id_(std::move(id)), state_(std::move(state)) {}

KeyLease& KeyLease::operator=(KeyLease&& o) noexcept {
  if (this != &o) {
    Release();
    id_ = std::move(o.id_);
    state_ = std::move(o.state_);
  }
  return *this;
}

KeyLease::~KeyLease() { Release(); }

void KeyLease::Release() {
  if (state_ == nullptr) return;
  absl::MutexLock lock(&state_->mu);
  --state_->in_flight;
  state_.reset();
}

std::string Sha256Hex(absl::string_view bytes) { return absl::BytesToHexString(Sha256Raw(bytes)); }

absl::StatusOr<std::vector<ApiKeys::Key>> ApiKeys::Parse(const std::string& path, absl::string_view text) {
  std::vector<Key> keys;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const std::string at = absl::StrCat(path, ":", line_no, ": ");
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos || colon == 0) {
      return absl::InvalidArgumentError(absl::StrCat(at, "expected ID:SHA256HEX"));
    }
    const absl::string_view id = line.substr(0, colon);
    if (!ValidId(id)) {
      return absl::InvalidArgumentError(absl::StrCat(at, "the key id may hold letters, digits, '.', '_' and '-' only"));
    }
    std::vector<absl::string_view> fields = absl::StrSplit(line.substr(colon + 1), ' ', absl::SkipWhitespace());
    const absl::string_view hex = fields.empty() ? absl::string_view() : fields[0];
    if (hex.size() != 64 || !std::all_of(hex.begin(), hex.end(), [](char c) {
          return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f');
        })) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, "the hash must be 64 lowercase hex digits (sha256sum of the key), not the key"));
    }
    Key k{std::string(id), absl::HexStringToBytes(hex), {}};
    bool burst_given = false;
    for (size_t i = 1; i < fields.size(); ++i) {
      const size_t eq = fields[i].find('=');
      const absl::string_view name = fields[i].substr(0, eq);
      double v = 0;
      if (eq == absl::string_view::npos || !absl::SimpleAtod(fields[i].substr(eq + 1), &v) || !(v > 0) ||
          (name != "rate" && name != "burst" && name != "concurrency") ||
          (name == "concurrency" && v != static_cast<int64_t>(v))) {
        return absl::InvalidArgumentError(absl::StrCat(
            at, "'", fields[i], "': expected rate=R (requests/s), burst=B or concurrency=C, each above 0"));
      }
      if (name == "rate") k.limits.rate = v;
      if (name == "burst") {
        k.limits.burst = v;
        burst_given = true;
      }
      if (name == "concurrency") k.limits.concurrency = static_cast<int64_t>(v);
    }
    if (!burst_given) k.limits.burst = std::max(1.0, k.limits.rate);
    for (const Key& other : keys) {
      if (other.id == k.id) return absl::InvalidArgumentError(absl::StrCat(at, "key id '", k.id, "' repeated"));
    }
    keys.push_back(std::move(k));
  }
  return keys;
}

absl::StatusOr<ApiKeys::FileStamp> ApiKeys::Stamp() const {
  struct stat st;
  if (stat(path_.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat(path_, ": cannot stat"));
  return FileStamp{static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec,
                   static_cast<int64_t>(st.st_size), static_cast<uint64_t>(st.st_ino)};
}

absl::StatusOr<std::unique_ptr<ApiKeys>> ApiKeys::Load(std::string path, Clock clock) {
  std::unique_ptr<ApiKeys> k(new ApiKeys(std::move(path), std::move(clock)));
  absl::StatusOr<FileStamp> stamp = k->Stamp();
  if (!stamp.ok()) return stamp.status();
  std::ifstream f(k->path_);
  if (!f) return absl::NotFoundError(absl::StrCat(k->path_, ": cannot read"));
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  absl::StatusOr<std::vector<Key>> keys = Parse(k->path_, text);
  if (!keys.ok()) return keys.status();
  absl::MutexLock lock(&k->mu_);
  k->keys_ = *std::move(keys);
  k->stamp_ = *stamp;
  k->next_check_ = k->clock_() + absl::Seconds(1);
  return k;
}

void ApiKeys::ReloadIfChanged() {
  const absl::StatusOr<FileStamp> stamp = Stamp();
  {
    absl::MutexLock lock(&mu_);
    next_check_ = clock_() + absl::Seconds(1);
    if (!stamp.ok() || *stamp == stamp_) return;
  }
  std::ifstream f(path_);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  absl::StatusOr<std::vector<Key>> keys = Parse(path_, text);
  if (!keys.ok()) {
    LogEvent("warning", "api_keys_not_reloaded", {{"file", path_}, {"error", std::string(keys.status().message())}});
    return;
  }
  absl::MutexLock lock(&mu_);
  LogEvent("info", "api_keys_reloaded", {{"file", path_}, {"keys", std::to_string(keys->size())}});
  keys_ = *std::move(keys);
  stamp_ = *stamp;
}

size_t ApiKeys::size() const {
  absl::MutexLock lock(&mu_);
  return keys_.size();
}

absl::StatusOr<std::string> ApiKeys::Check(absl::string_view authorization) {
  bool due = false;
  {
    absl::MutexLock lock(&mu_);
    due = clock_() >= next_check_;
  }
  if (due) ReloadIfChanged();
  absl::string_view key = absl::StripAsciiWhitespace(authorization);
  if (absl::StartsWithIgnoreCase(key, "bearer ")) key = absl::StripLeadingAsciiWhitespace(key.substr(7));
  if (key.empty()) return absl::UnauthenticatedError("no API key (send Authorization: Bearer KEY)");
  absl::MutexLock lock(&mu_);
  absl::StatusOr<const Key*> found = Find(key);
  if (!found.ok()) return found.status();
  return (*found)->id;
}

absl::StatusOr<const ApiKeys::Key*> ApiKeys::Find(absl::string_view key) {
  const std::string digest = Sha256Raw(key);
  // Every key is compared, in constant time per key.
  const Key* found = nullptr;
  for (const Key& k : keys_) {
    if (CRYPTO_memcmp(k.sha256.data(), digest.data(), digest.size()) == 0) found = &k;
  }
  if (found == nullptr) return absl::UnauthenticatedError("invalid API key");
  return found;
}

absl::StatusOr<KeyLease> ApiKeys::Admit(absl::string_view authorization) {
  absl::StatusOr<std::string> id = Check(authorization);
  if (!id.ok()) return id.status();
  KeyLimits limits;
  std::shared_ptr<internal::KeyState> state;
  {
    absl::MutexLock lock(&mu_);
    for (const Key& k : keys_) {
      if (k.id == *id) limits = k.limits;
    }
    std::shared_ptr<internal::KeyState>& s = states_[*id];
    if (s == nullptr) s = std::make_shared<internal::KeyState>();
    state = s;
  }
  auto refuse = [&id](std::string why, double retry_after) {
    absl::Status st = absl::ResourceExhaustedError(absl::StrCat("API key '", *id, "': ", why));
    st.SetPayload(kRetryAfterPayload, absl::Cord(absl::StrCat(retry_after)));
    st.SetPayload(kKeyIdPayload, absl::Cord(*id));
    return st;
  };
  const absl::Time now = clock_();
  absl::MutexLock lock(&state->mu);
  if (limits.concurrency > 0 && state->in_flight >= limits.concurrency) {
    return refuse(absl::StrCat(state->in_flight, " requests in flight, its limit"), 1);
  }
  if (limits.rate > 0) {
    if (state->tokens < 0) {
      state->tokens = limits.burst;
    } else {
      state->tokens = std::min(limits.burst, state->tokens + limits.rate * absl::ToDoubleSeconds(now - state->refilled));
    }
    state->refilled = now;
    if (state->tokens < 1) {
      return refuse(absl::StrCat("over its limit of ", limits.rate, " requests/s"), (1 - state->tokens) / limits.rate);
    }
    state->tokens -= 1;
  }
  ++state->in_flight;
  return KeyLease(*id, state);
}

}  // namespace pdserve::router
