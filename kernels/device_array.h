// An array in a backend's memory (Backend::Allocate), freed with it.
#ifndef PDSERVE_KERNELS_DEVICE_ARRAY_H_
#define PDSERVE_KERNELS_DEVICE_ARRAY_H_

#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"

namespace pdserve::kernels {

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(Backend* backend) : backend_(backend) {}
  ~DeviceArray() { Reset(); }
  DeviceArray(DeviceArray&& o) noexcept
      : backend_(o.backend_), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      Reset();
      backend_ = o.backend_;
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  // At least n elements; a grown array's contents are undefined (scratch).
  absl::Status Grow(size_t n) {
    if (n <= size_) return absl::OkStatus();
    Reset();
    absl::StatusOr<void*> p = backend_->Allocate(n * sizeof(T));
    if (!p.ok()) return p.status();
    data_ = static_cast<T*>(*p);
    size_ = n;
    return absl::OkStatus();
  }
  // Exactly the host elements `v`, copied in.
  absl::Status Assign(absl::Span<const T> v) {
    if (v.size() > size_) {
      if (absl::Status s = Grow(v.size()); !s.ok()) return s;
    }
    backend_->CopyToDevice(data_, v.data(), v.size() * sizeof(T));
    return absl::OkStatus();
  }
  void Reset() {
    if (data_ != nullptr) backend_->Free(data_);
    data_ = nullptr;
    size_ = 0;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  Backend* backend_ = nullptr;
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace pdserve::kernels

#endif  // PDSERVE_KERNELS_DEVICE_ARRAY_H_
