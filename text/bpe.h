// The BPE model of a tokenizer.json: vocabulary, ranked merges, unknown
// token, byte fallback (<0xXX> tokens for characters outside the
// vocabulary), fuse_unk and ignore_merges.
//
// Thread safety: Tokenize may be called concurrently (its word cache is
// mutex-protected).
#ifndef PDSERVE_TEXT_BPE_H_
#define PDSERVE_TEXT_BPE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json_fwd.hpp"

namespace pdserve::tok {

class Bpe {
 public:
  // Parses tokenizer.json's "model" object (type BPE). Refuses dropout,
  // continuing_subword_prefix and end_of_word_suffix (by name).
  static absl::StatusOr<std::unique_ptr<Bpe>> FromJson(const nlohmann::json& model);

  // Appends the ids of one pre-token.
  void Tokenize(const std::string& word, std::vector<int32_t>& out) const;

  std::optional<int32_t> TokenToId(const std::string& token) const;
  // nullptr for ids outside the model's vocabulary.
  const std::string* IdToToken(int32_t id) const;
  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  void TokenizeUncached(const std::string& word, std::vector<int32_t>& out) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  absl::flat_hash_map<uint64_t, Merge> merges_;  // Key: left id << 32 | right id.
  std::optional<int32_t> unk_id_;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  int32_t byte_ids_[256];

  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::tok

#endif  // PDSERVE_TEXT_BPE_H_
