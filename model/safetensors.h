// Reading (and, for tests and tools, writing) the safetensors format:
//   [u64 little-endian header length N][N bytes of JSON header][data]
// The header maps tensor names to {dtype, shape, data_offsets=[begin, end)}
// relative to the start of the data section; "__metadata__" is free-form.
//
// SafetensorsFile memory-maps the file read-only; tensor views point into the
// mapping and stay valid as long as the SafetensorsFile lives.
//
// Every malformed input is an error naming the file (and the tensor), never a
// crash: the parser is fuzzed (tests/fuzz/safetensors_fuzz.cc).
//
// Thread safety: a constructed SafetensorsFile is immutable and may be read
// from any number of threads.
#ifndef PDSERVE_MODEL_SAFETENSORS_H_
#define PDSERVE_MODEL_SAFETENSORS_H_

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"

namespace pdserve {

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // Not necessarily aligned to the element size.
  size_t num_bytes = 0;

  int64_t NumElements() const;
};

class SafetensorsFile {
 public:
  // Opens and validates `path`. Errors: NOT_FOUND (no file), INVALID_ARGUMENT
  // (any malformed content, unsupported dtype), each message naming `path`.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  // Parses an in-memory image (the bytes are NOT copied; `bytes` must outlive
  // the result). `display_name` is used in error messages. This is the entry
  // point for the fuzz target.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Parse(
      absl::string_view bytes, std::string display_name);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors in the order of their data offsets.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorView* Find(absl::string_view name) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  std::vector<TensorView> tensors_;
  absl::flat_hash_map<std::string, size_t> index_;
};

// A tensor to write: `data` holds NumElements() * DTypeSize(dtype) bytes.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  absl::string_view data;
};

// Serialises tensors (in the given order) into the safetensors format.
std::string SerializeSafetensors(absl::Span<const TensorToWrite> tensors);

// Writes SerializeSafetensors(tensors) to `path`.
absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors);

}  // namespace pdserve

#endif  // PDSERVE_MODEL_SAFETENSORS_H_
