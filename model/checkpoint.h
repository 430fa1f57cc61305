// A Hugging Face checkpoint directory's tensors: model.safetensors, or the
// shards listed by model.safetensors.index.json. Tensors are taken by name
// with their expected shape; afterwards, any tensor nobody took is an error
// (a checkpoint that does not match the config must not load silently).
//
// Thread safety: not thread-safe (Take records usage).
#ifndef PDSERVE_MODEL_CHECKPOINT_H_
#define PDSERVE_MODEL_CHECKPOINT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/safetensors.h"

namespace pdserve {

class Checkpoint {
 public:
  // Errors name the directory, file and tensor: NOT_FOUND when neither
  // model.safetensors nor model.safetensors.index.json exists, or when the
  // index names a shard file that does not exist; INVALID_ARGUMENT for
  // malformed files, an index listing a tensor its shard lacks, or a tensor
  // present in two files.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& model_dir);

  // The tensor `name` with exactly `shape`. Errors: missing tensor, wrong
  // shape (both shapes printed).
  absl::StatusOr<const TensorView*> Take(const std::string& name,
                                         const std::vector<int64_t>& shape);
  bool Has(const std::string& name) const { return tensors_.contains(name); }
  // Marks a tensor as deliberately unused (e.g. a tied lm_head copy).
  void Ignore(const std::string& name) { taken_.insert(name); }

  // INVALID_ARGUMENT naming the first tensor that was never taken.
  absl::Status CheckAllTaken() const;

  const std::string& dir() const { return dir_; }

  // A stable description of the weights: every tensor's name, dtype, shape
  // and the XXH3-64 of its first and last 4 KiB, in name order.
  std::string Fingerprint() const;

 private:
  struct Entry {
    const TensorView* view;
    const SafetensorsFile* file;
  };
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  absl::flat_hash_map<std::string, Entry> tensors_;
  absl::flat_hash_set<std::string> taken_;
};

}  // namespace pdserve

#endif  // PDSERVE_MODEL_CHECKPOINT_H_
