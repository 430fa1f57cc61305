#include "text/bpe.h"

#include <queue>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "text/unicode_util.h"
#include "nlohmann/json.hpp"

namespace pdserve::tok {
namespace {

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: model: ", what));
}

// An optional boolean field: absent or null gives `def`; other types are errors.
absl::StatusOr<bool> OptionalBool(const nlohmann::json& m, const char* key, bool def) {
  auto it = m.find(key);
  if (it == m.end() || it->is_null()) return def;
  if (!it->is_boolean()) return Bad(absl::StrCat("'", key, "' must be true or false"));
  return it->get<bool>();
}

constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kMaxCacheEntries = 100000;

}  // namespace

absl::StatusOr<std::unique_ptr<Bpe>> Bpe::FromJson(const nlohmann::json& m) {
  if (!m.is_object()) return Bad("must be an object");
  auto type_it = m.find("type");
  if (type_it != m.end() && !type_it->is_string()) return Bad("'type' must be a string");
  const std::string type = type_it == m.end() ? "BPE" : type_it->get<std::string>();
  if (type != "BPE") return Bad(absl::StrCat("model type '", type, "' is not supported (BPE only)"));
  for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(key) && !m[key].is_null() && !(m[key].is_string() && m[key].get<std::string>().empty())) {
      return Bad(absl::StrCat("'", key, "' is not supported"));
    }
  }
  auto bpe = std::unique_ptr<Bpe>(new Bpe());
  const auto vocab = m.find("vocab");
  if (vocab == m.end() || !vocab->is_object()) return Bad("missing 'vocab' object");
  int32_t max_id = -1;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > (1 << 24)) {
      return Bad(absl::StrCat("vocab entry '", it.key(), "' has an invalid id"));
    }
    const int32_t id = it.value().get<int32_t>();
    bpe->vocab_[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  bpe->id_to_token_.resize(max_id + 1);
  for (const auto& [tok, id] : bpe->vocab_) bpe->id_to_token_[id] = tok;

  const auto merges = m.find("merges");
  if (merges == m.end() || !merges->is_array()) return Bad("missing 'merges' list");
  int32_t rank = 0;
  for (const auto& entry : *merges) {
    std::string left, right;
    if (entry.is_string()) {
      const std::string& s = entry.get_ref<const std::string&>();
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) return Bad(absl::StrCat("merge '", s, "' is not 'a b'"));
      left = s.substr(0, sp);
      right = s.substr(sp + 1);
    } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string()) {
      left = entry[0].get<std::string>();
      right = entry[1].get<std::string>();
    } else {
      return Bad("merges must be strings 'a b' or pairs [a, b]");
    }
    auto l = bpe->vocab_.find(left), r = bpe->vocab_.find(right), mm = bpe->vocab_.find(left + right);
    if (l == bpe->vocab_.end() || r == bpe->vocab_.end() || mm == bpe->vocab_.end()) {
      return Bad(absl::StrCat("merge '", left, " ", right, "' uses tokens outside the vocabulary"));
    }
    const uint64_t key = static_cast<uint64_t>(l->second) << 32 | static_cast<uint32_t>(r->second);
    bpe->merges_.try_emplace(key, Merge{rank++, mm->second});
  }
  if (auto unk = m.find("unk_token"); unk != m.end() && unk->is_string()) {
    auto it = bpe->vocab_.find(unk->get<std::string>());
    if (it == bpe->vocab_.end()) return Bad("unk_token is not in the vocabulary");
    bpe->unk_id_ = it->second;
  }
  for (auto [key, field] : {std::pair{"byte_fallback", &bpe->byte_fallback_},
                            std::pair{"fuse_unk", &bpe->fuse_unk_},
                            std::pair{"ignore_merges", &bpe->ignore_merges_}}) {
    absl::StatusOr<bool> v = OptionalBool(m, key, false);
    if (!v.ok()) return v.status();
    *field = *v;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bpe->vocab_.find(absl::StrFormat("<0x%02X>", b));
    bpe->byte_ids_[b] = it == bpe->vocab_.end() ? -1 : it->second;
  }
  return bpe;
}

std::optional<int32_t> Bpe::TokenToId(const std::string& token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* Bpe::IdToToken(int32_t id) const {
  if (id < 0 || id >= static_cast<int32_t>(id_to_token_.size())) return nullptr;
  return &id_to_token_[id];
}

void Bpe::Tokenize(const std::string& word, std::vector<int32_t>& out) const {
  if (word.size() <= kMaxCachedWordBytes) {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  TokenizeUncached(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (word.size() <= kMaxCachedWordBytes) {
    absl::MutexLock lock(&mu_);
    if (cache_.size() < kMaxCacheEntries) cache_.emplace(word, std::move(ids));
  }
}

void Bpe::TokenizeUncached(const std::string& word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // Initial symbols: one per character (or per byte, with byte fallback).
  std::vector<int32_t> sym;
  bool prev_unk = false;
  for (size_t i = 0; i < word.size();) {
    const size_t n = Utf8CharLen(word, i);
    auto it = vocab_.find(absl::string_view(word).substr(i, n));
    if (it != vocab_.end()) {
      sym.push_back(it->second);
      prev_unk = false;
    } else if (byte_fallback_ && [&] {
                 for (size_t k = 0; k < n; ++k) {
                   if (byte_ids_[static_cast<unsigned char>(word[i + k])] < 0) return false;
                 }
                 return true;
               }()) {
      for (size_t k = 0; k < n; ++k) sym.push_back(byte_ids_[static_cast<unsigned char>(word[i + k])]);
      prev_unk = false;
    } else if (unk_id_.has_value()) {
      if (!(fuse_unk_ && prev_unk)) sym.push_back(*unk_id_);
      prev_unk = true;
    }
    i += n;
  }
  const int n = static_cast<int>(sym.size());
  if (n <= 1) {
    out.insert(out.end(), sym.begin(), sym.end());
    return;
  }
  // Linked list over symbols; a heap of candidate merges by (rank, position).
  std::vector<int> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i - 1;
  }
  struct Cand {
    int32_t rank;
    int pos;
    int32_t left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int i) {
    if (i < 0 || next[i] >= n) return;
    const uint64_t key = static_cast<uint64_t>(sym[i]) << 32 | static_cast<uint32_t>(sym[next[i]]);
    auto it = merges_.find(key);
    if (it != merges_.end()) heap.push({it->second.rank, i, sym[i], sym[next[i]]});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int i = c.pos;
    if (!alive[i] || next[i] >= n || sym[i] != c.left || sym[next[i]] != c.right) continue;
    const int j = next[i];
    sym[i] = merges_.at(static_cast<uint64_t>(c.left) << 32 | static_cast<uint32_t>(c.right)).id;
    alive[j] = false;
    next[i] = next[j];
    if (next[j] < n) prev[next[j]] = i;
    push(prev[i]);
    push(i);
  }
  for (int i = 0; i < n; i = next[i]) out.push_back(sym[i]);
}

}  // namespace pdserve::tok
