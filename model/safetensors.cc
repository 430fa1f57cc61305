#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

// Headers past this size are refused (real ones are a few hundred KiB).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

absl::StatusOr<DType> DTypeFromSafetensors(absl::string_view s) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat(
      "unsupported dtype '", s, "' (supported: F32, F16, BF16)"));
}

absl::string_view SafetensorsName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI8:
      return "I8";
  }
  return "?";
}

}  // namespace

int64_t TensorView::NumElements() const {
  // Parse guarantees the product fits unless a dimension is zero.
  for (int64_t d : shape) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot stat: ", std::strerror(err)));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* mapping = nullptr;
  if (size > 0) {
    mapping = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, ": mmap failed: ", std::strerror(err)));
    }
  }
  ::close(fd);
  auto parsed = Parse(absl::string_view(static_cast<const char*>(mapping), size), path);
  if (!parsed.ok()) {
    if (mapping != nullptr) munmap(mapping, size);
    return parsed.status();
  }
  (*parsed)->mapping_ = mapping;
  (*parsed)->mapping_size_ = size;
  return parsed;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Parse(absl::string_view bytes,
                                                                        std::string display_name) {
  auto fail = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(display_name, ": ", parts...));
  };
  if (bytes.size() < 8) {
    return fail("truncated: ", bytes.size(), " bytes, shorter than the 8-byte header length");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > bytes.size() - 8) {
    return fail("header length ", header_len, " runs past the end of the file (",
                bytes.size(), " bytes)");
  }
  if (header_len > kMaxHeaderBytes) {
    return fail("header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes);
  }
  const absl::string_view header = bytes.substr(8, header_len);
  const absl::string_view data = bytes.substr(8 + header_len);

  nlohmann::json j = nlohmann::json::parse(header.begin(), header.end(), nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded()) return fail("header is not valid JSON");
  if (!j.is_object()) return fail("header is not a JSON object");

  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = display_name;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") continue;
    const nlohmann::json& e = it.value();
    auto bad = [&](auto&&... parts) {
      return absl::InvalidArgumentError(
          absl::StrCat(file->path_, ": tensor '", name, "': ", parts...));
    };
    if (!e.is_object()) return bad("header entry is not an object");
    auto dt = e.find("dtype");
    auto sh = e.find("shape");
    auto off = e.find("data_offsets");
    if (dt == e.end() || !dt->is_string()) return bad("missing or non-string 'dtype'");
    if (sh == e.end() || !sh->is_array()) return bad("missing or non-array 'shape'");
    if (off == e.end() || !off->is_array() || off->size() != 2) {
      return bad("'data_offsets' must be an array of two integers");
    }
    absl::StatusOr<DType> dtype = DTypeFromSafetensors(dt->get_ref<const std::string&>());
    if (!dtype.ok()) return bad(dtype.status().message());

    TensorView view;
    view.name = name;
    view.dtype = *dtype;
    // numel * elem_size must not overflow; every dim is bounded by the data size.
    unsigned __int128 numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) return bad("shape entries must be non-negative integers");
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return bad("shape dimension too large");
      }
      view.shape.push_back(static_cast<int64_t>(dim));
      numel *= dim;
      if (numel > data.size()) numel = static_cast<unsigned __int128>(data.size()) + 1;
    }
    const auto& b = (*off)[0];
    const auto& en = (*off)[1];
    if (!b.is_number_unsigned() || !en.is_number_unsigned()) {
      return bad("'data_offsets' must be non-negative integers");
    }
    const uint64_t begin = b.get<uint64_t>();
    const uint64_t end = en.get<uint64_t>();
    if (begin > end) return bad("data_offsets begin ", begin, " > end ", end);
    if (end > data.size()) {
      return bad("data_offsets end ", end, " past the data section (", data.size(),
                 " bytes): file truncated?");
    }
    const unsigned __int128 want = numel * DTypeSize(view.dtype);
    if (want != end - begin) {
      return bad("shape [", absl::StrJoin(view.shape, ", "), "] of ", SafetensorsName(view.dtype),
                 " needs ", static_cast<uint64_t>(std::min<unsigned __int128>(want, ~0ull)),
                 " bytes but data_offsets span ", end - begin);
    }
    view.data = data.data() + begin;
    view.num_bytes = end - begin;
    file->tensors_.push_back(std::move(view));
  }
  std::sort(file->tensors_.begin(), file->tensors_.end(),
            [](const TensorView& a, const TensorView& b) {
              return a.data < b.data || (a.data == b.data && a.num_bytes < b.num_bytes);
            });
  for (size_t i = 1; i < file->tensors_.size(); ++i) {
    const TensorView& prev = file->tensors_[i - 1];
    const TensorView& cur = file->tensors_[i];
    if (static_cast<const char*>(prev.data) + prev.num_bytes > cur.data) {
      return fail("tensors '", prev.name, "' and '", cur.name, "' overlap");
    }
  }
  for (size_t i = 0; i < file->tensors_.size(); ++i) {
    file->index_.emplace(file->tensors_[i].name, i);
  }
  return file;
}

const TensorView* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::string SerializeSafetensors(absl::Span<const TensorToWrite> tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    header[t.name] = {{"dtype", SafetensorsName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  std::string out;
  out.reserve(8 + h.size() + offset);
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += h;
  for (const TensorToWrite& t : tensors) out.append(t.data.data(), t.data.size());
  return out;
}

absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot create"));
  const std::string bytes = SerializeSafetensors(tensors);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) return absl::InternalError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace pdserve
