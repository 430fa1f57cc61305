#include "model/checkpoint.h"

#include <xxhash.h>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/model_config.h"
#include "nlohmann/json.hpp"

namespace pdserve {

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& model_dir) {
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  ckpt->dir_ = model_dir;
  const std::string single = model_dir + "/model.safetensors";
  const std::string index_path = model_dir + "/model.safetensors.index.json";

  std::vector<std::string> shard_names;
  absl::flat_hash_map<std::string, std::string> weight_map;
  absl::StatusOr<std::string> index_text = ReadFileToString(index_path);
  if (index_text.ok()) {
    nlohmann::json j = nlohmann::json::parse(index_text->begin(), index_text->end(), nullptr,
                                             /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a valid JSON object"));
    }
    auto wm = j.find("weight_map");
    if (wm == j.end() || !wm->is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": missing 'weight_map' object"));
    }
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": weight_map entry for '", it.key(), "' is not a file name"));
      }
      const std::string& file = it.value().get_ref<const std::string&>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": weight_map entry for '", it.key(), "' names an invalid file '", file,
            "'"));
      }
      weight_map[it.key()] = file;
      if (std::find(shard_names.begin(), shard_names.end(), file) == shard_names.end()) {
        shard_names.push_back(file);
      }
    }
    std::sort(shard_names.begin(), shard_names.end());
  } else if (absl::IsNotFound(index_text.status())) {
    shard_names.push_back("model.safetensors");
  } else {
    return index_text.status();
  }

  for (const std::string& name : shard_names) {
    const std::string path = model_dir + "/" + name;
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    if (!file.ok()) {
      if (absl::IsNotFound(file.status()) && shard_names.size() == 1 && weight_map.empty()) {
        return absl::NotFoundError(absl::StrCat(
            model_dir, ": no model.safetensors or model.safetensors.index.json"));
      }
      return file.status();
    }
    for (const TensorView& t : (*file)->tensors()) {
      auto [it, inserted] = ckpt->tensors_.emplace(t.name, Entry{&t, file->get()});
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' is in both ",
                                                       it->second.file->path(), " and ", path));
      }
      if (!weight_map.empty()) {
        auto wm = weight_map.find(t.name);
        if (wm == weight_map.end()) {
          return absl::InvalidArgumentError(absl::StrCat(
              path, ": tensor '", t.name, "' is not listed in ", index_path));
        }
        if (wm->second != name) {
          return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor '", t.name,
                                                         "' is listed in ", wm->second,
                                                         " but found in ", name));
        }
      }
    }
    ckpt->files_.push_back(*std::move(file));
  }
  for (const auto& [tensor, file] : weight_map) {
    if (!ckpt->tensors_.contains(tensor)) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor '", tensor,
                                                     "' is listed but missing from ", model_dir,
                                                     "/", file));
    }
  }
  return ckpt;
}

absl::StatusOr<const TensorView*> Checkpoint::Take(const std::string& name,
                                                   const std::vector<int64_t>& shape) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir_, ": missing tensor '", name, "' (expected shape [",
                     absl::StrJoin(shape, ", "), "])"));
  }
  const TensorView* t = it->second.view;
  if (t->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        it->second.file->path(), ": tensor '", name, "' has shape [", absl::StrJoin(t->shape, ", "),
        "], expected [", absl::StrJoin(shape, ", "), "]"));
  }
  taken_.insert(name);
  return t;
}

std::string Checkpoint::Fingerprint() const {
  std::vector<std::string> names;
  for (const auto& [name, entry] : tensors_) names.push_back(name);
  std::sort(names.begin(), names.end());
  std::string out;
  for (const std::string& name : names) {
    const TensorView& t = *tensors_.at(name).view;
    const size_t edge = std::min<size_t>(4096, t.num_bytes);
    const char* data = static_cast<const char*>(t.data);
    absl::StrAppend(&out, name, " ", static_cast<int>(t.dtype), " [", absl::StrJoin(t.shape, ","),
                    "] ", XXH3_64bits(data, edge), " ",
                    XXH3_64bits(data + t.num_bytes - edge, edge), "\n");
  }
  return out;
}

absl::Status Checkpoint::CheckAllTaken() const {
  std::vector<std::string> extra;
  for (const auto& [name, entry] : tensors_) {
    if (!taken_.contains(name)) extra.push_back(name);
  }
  if (extra.empty()) return absl::OkStatus();
  std::sort(extra.begin(), extra.end());
  return absl::InvalidArgumentError(absl::StrCat(
      tensors_.at(extra[0]).file->path(), ": unexpected tensor '", extra[0],
      "' (not used by the model config", extra.size() > 1 ? absl::StrCat("; ", extra.size() - 1, " more") : "",
      ")"));
}

}  // namespace pdserve
