#include "kv_transfer/kv_staging.h"

#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace pdserve::kv {
namespace {

// Slots start on page boundaries (DMA engines and UCX registration work
// in pages).
constexpr int64_t kSlotAlignment = 4096;

const char* DirectionName(CopyDirection d) {
  return d == CopyDirection::kDeviceToHost ? "device-to-host" : "host-to-device";
}

// The ranges' total bytes, or INVALID_ARGUMENT naming the layer when one
// is negative or they exceed a slot.
absl::StatusOr<int64_t> TotalBytes(absl::Span<const DeviceRange> ranges, int64_t slot_bytes,
                                   const engine::RequestId& request, int32_t layer) {
  int64_t total = 0;
  for (const DeviceRange& r : ranges) {
    if (r.bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV staging: request ", request.str(), " layer ", layer, ": a range of ", r.bytes, " bytes"));
    }
    total += r.bytes;
  }
  if (total > slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("KV staging: request ", request.str(), " layer ", layer, " has ",
                                                   total, " bytes, more than a slot's ", slot_bytes));
  }
  return total;
}

}  // namespace

std::string KvStagingStats::ToString() const {
  return absl::StrCat("layers_staged=", layers_staged, " bytes_staged=", bytes_staged,
                      " layers_delivered=", layers_delivered, " layers_abandoned=", layers_abandoned,
                      " copy_failures=", copy_failures, " slot_waits=", slot_waits, " slot_timeouts=", slot_timeouts,
                      " slot_wait=", absl::FormatDuration(slot_wait_time),
                      " copy_wait=", absl::FormatDuration(copy_wait_time),
                      " copy_latency=", absl::FormatDuration(copy_latency), " free_slots=", free_slots);
}

absl::StatusOr<std::unique_ptr<KvStagingRing>> KvStagingRing::Create(const KvStagingOptions& options,
                                                                     DeviceCopier* copier,
                                                                     KvRegionAllocator* allocator) {
  if (copier == nullptr || allocator == nullptr) {
    return absl::InvalidArgumentError("KV staging: a ring needs a device copier and an allocator");
  }
  if (options.num_slots < 1 || options.slot_bytes < 1 || options.slot_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("KV staging: ", options.num_slots, " slots of ", options.slot_bytes,
                                                   " bytes, slot timeout ",
                                                   absl::FormatDuration(options.slot_timeout)));
  }
  const int64_t stride = (options.slot_bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  const int64_t bytes = stride * options.num_slots;
  absl::StatusOr<std::unique_ptr<KvRegion>> region = allocator->Allocate(static_cast<size_t>(bytes));
  if (!region.ok()) return region.status();
  if ((*region)->size() < static_cast<size_t>(bytes)) {
    return absl::InternalError("KV staging: allocator returned a region smaller than asked");
  }
  return std::unique_ptr<KvStagingRing>(new KvStagingRing(options, copier, *std::move(region), stride));
}

KvStagingRing::KvStagingRing(const KvStagingOptions& options, DeviceCopier* copier, std::unique_ptr<KvRegion> region,
                             int64_t slot_stride)
    : options_(options),
      copier_(copier),
      region_(std::move(region)),
      base_(static_cast<char*>(region_->data())),
      slot_stride_(slot_stride),
      slots_(options.num_slots) {
  free_.reserve(options.num_slots);
  for (int32_t i = options.num_slots - 1; i >= 0; --i) free_.push_back(i);
}

KvStagingRing::~KvStagingRing() {
  std::vector<CopyTicket> in_flight;
  {
    absl::MutexLock lock(&mu_);
    for (const Slot& s : slots_) {
      if (s.state == SlotState::kCopying || s.state == SlotState::kDraining) in_flight.push_back(s.ticket);
    }
  }
  // The copies write (or read) the region freed next.
  for (CopyTicket t : in_flight) (void)copier_->Wait(t);
}

bool KvStagingRing::RefusedLocked(const engine::RequestId& request) const {
  return !closed_.ok() || !failed_.ok() || abandoned_.contains(request);
}

absl::Status KvStagingRing::RefusalLocked(const engine::RequestId& request) const {
  if (!closed_.ok()) return closed_;
  if (!failed_.ok()) return failed_;
  if (auto it = abandoned_.find(request); it != abandoned_.end()) {
    return absl::AbortedError(
        absl::StrCat("KV staging: request ", request.str(), " was abandoned: ", it->second.ToString()));
  }
  return absl::OkStatus();
}

bool KvStagingRing::IsLocked(StagingSlot slot, SlotState state) const {
  return slot.index >= 0 && slot.index < options_.num_slots && slots_[slot.index].use == slot.use &&
         slots_[slot.index].state == state;
}

absl::StatusOr<int32_t> KvStagingRing::AcquireLocked(const engine::RequestId& request, int32_t layer) {
  if (RefusedLocked(request)) return RefusalLocked(request);
  if (free_.empty()) {
    ++stats_.slot_waits;
    ++waiting_for_slot_;
    const absl::Time start = absl::Now();
    auto can_go = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !free_.empty() || RefusedLocked(request); };
    mu_.AwaitWithDeadline(absl::Condition(&can_go), start + options_.slot_timeout);
    --waiting_for_slot_;
    stats_.slot_wait_time += absl::Now() - start;
    if (RefusedLocked(request)) return RefusalLocked(request);
    if (free_.empty()) {
      ++stats_.slot_timeouts;
      int32_t copying = 0, held = 0;
      for (const Slot& s : slots_) {
        if (s.state == SlotState::kCopying || s.state == SlotState::kDraining) ++copying;
        if (s.state == SlotState::kHeld || s.state == SlotState::kFilling) ++held;
      }
      return absl::DeadlineExceededError(
          absl::StrCat("KV staging: no free slot for request ", request.str(), " layer ", layer, " within ",
                       absl::FormatDuration(options_.slot_timeout), ": all ", options_.num_slots, " slots taken (",
                       copying, " copying or waiting for the consumer, ", held, " held and not released)"));
    }
  }
  const int32_t index = free_.back();
  free_.pop_back();
  Slot& s = slots_[index];
  ++s.use;
  s.request = request;
  s.layer = layer;
  s.bytes = 0;
  s.abandoned = false;
  return index;
}

void KvStagingRing::EnqueueLocked(int32_t index, absl::Span<const CopyRange> copies) {
  Slot& s = slots_[index];
  s.ticket = copier_->Enqueue(options_.direction, copies);
  s.state = SlotState::kCopying;
  s.enqueued = absl::Now();
  queue_.push_back(index);
  ++stats_.layers_staged;
  stats_.bytes_staged += s.bytes;
}

void KvStagingRing::FreeLocked(int32_t index) {
  Slot& s = slots_[index];
  s.state = SlotState::kFree;
  s.request = engine::RequestId();
  s.abandoned = false;
  free_.push_back(index);
}

absl::Status KvStagingRing::CopyFailedLocked(const absl::Status& copy, const engine::RequestId& request,
                                             int32_t layer) {
  ++stats_.copy_failures;
  absl::Status error(copy.code(), absl::StrCat("KV staging: ", DirectionName(options_.direction), " copy of request ",
                                               request.str(), " layer ", layer, " failed: ", copy.message()));
  if (failed_.ok()) failed_ = error;
  return error;
}

absl::Status KvStagingRing::StageLayer(const engine::RequestId& request, int32_t layer,
                                       absl::Span<const DeviceRange> sources) {
  if (options_.direction != CopyDirection::kDeviceToHost) {
    ABSL_RAW_LOG(FATAL, "KvStagingRing::StageLayer on a receiving ring");
  }
  if (layer < 0) return absl::InvalidArgumentError(absl::StrCat("KV staging: layer ", layer));
  absl::StatusOr<int64_t> total = TotalBytes(sources, options_.slot_bytes, request, layer);
  if (!total.ok()) return total.status();

  absl::MutexLock lock(&mu_);
  absl::StatusOr<int32_t> index = AcquireLocked(request, layer);
  if (!index.ok()) return index.status();
  std::vector<CopyRange> copies;
  copies.reserve(sources.size());
  char* dst = SlotData(*index);
  for (const DeviceRange& r : sources) {
    copies.push_back({r.address, dst, r.bytes});
    dst += r.bytes;
  }
  slots_[*index].bytes = *total;
  EnqueueLocked(*index, copies);
  return absl::OkStatus();
}

absl::StatusOr<StagedLayer> KvStagingRing::TakeSlot(const engine::RequestId& request, int32_t layer) {
  if (options_.direction != CopyDirection::kHostToDevice) {
    ABSL_RAW_LOG(FATAL, "KvStagingRing::TakeSlot on a sending ring");
  }
  if (layer < 0) return absl::InvalidArgumentError(absl::StrCat("KV staging: layer ", layer));
  absl::MutexLock lock(&mu_);
  absl::StatusOr<int32_t> index = AcquireLocked(request, layer);
  if (!index.ok()) return index.status();
  Slot& s = slots_[*index];
  s.state = SlotState::kFilling;
  return StagedLayer{{*index, s.use}, request, layer, SlotData(*index), options_.slot_bytes};
}

absl::Status KvStagingRing::UnstageLayer(StagingSlot slot, absl::Span<const DeviceRange> destinations) {
  if (options_.direction != CopyDirection::kHostToDevice) {
    ABSL_RAW_LOG(FATAL, "KvStagingRing::UnstageLayer on a sending ring");
  }
  absl::MutexLock lock(&mu_);
  if (!IsLocked(slot, SlotState::kFilling)) {
    return absl::FailedPreconditionError(absl::StrCat("KV staging: slot ", slot.index, " (use ", slot.use,
                                                      ") was not taken to receive into, or was given back"));
  }
  Slot& s = slots_[slot.index];
  absl::Status refused;
  if (s.abandoned) {
    refused = abandoned_.contains(s.request)
                  ? RefusalLocked(s.request)
                  : absl::AbortedError(absl::StrCat("KV staging: request ", s.request.str(), " was abandoned"));
  } else if (RefusedLocked(s.request)) {
    refused = RefusalLocked(s.request);
  } else if (absl::StatusOr<int64_t> total = TotalBytes(destinations, options_.slot_bytes, s.request, s.layer);
             !total.ok()) {
    refused = total.status();
  } else {
    s.bytes = *total;
  }
  if (!refused.ok()) {
    FreeLocked(slot.index);
    return refused;
  }
  std::vector<CopyRange> copies;
  copies.reserve(destinations.size());
  const char* src = SlotData(slot.index);
  for (const DeviceRange& r : destinations) {
    copies.push_back({src, r.address, r.bytes});
    src += r.bytes;
  }
  EnqueueLocked(slot.index, copies);
  return absl::OkStatus();
}

absl::StatusOr<StagedLayer> KvStagingRing::PopHeadLocked(const absl::Status& copy) {
  const int32_t index = queue_.front();
  queue_.pop_front();
  Slot& s = slots_[index];
  if (!copy.ok()) {
    absl::Status error = CopyFailedLocked(copy, s.request, s.layer);
    FreeLocked(index);
    return error;
  }
  s.state = SlotState::kHeld;
  ++stats_.layers_delivered;
  stats_.copy_latency += absl::Now() - s.enqueued;
  return StagedLayer{{index, s.use}, s.request, s.layer, SlotData(index), s.bytes};
}

absl::StatusOr<StagedLayer> KvStagingRing::NextReady(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  auto staged = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty() || !failed_.ok() || !closed_.ok();  // Or nothing will be.
  };
  while (true) {
    if (!closed_.ok()) return closed_;
    if (queue_.empty()) {
      if (!failed_.ok()) return failed_;
      if (!mu_.AwaitWithDeadline(absl::Condition(&staged), deadline)) {
        return absl::DeadlineExceededError(
            absl::StrCat("KV staging: no layer staged within ", absl::FormatDuration(timeout)));
      }
      continue;
    }
    const int32_t index = queue_.front();
    const uint64_t use = slots_[index].use;
    const CopyTicket ticket = slots_[index].ticket;
    if (copier_->Done(ticket)) return PopHeadLocked(copier_->Wait(ticket));
    // Wait without the lock: producers keep staging, Release and Abandon
    // go on meanwhile.
    const absl::Time start = absl::Now();
    mu_.Unlock();
    const absl::Status copy = copier_->Wait(ticket);
    mu_.Lock();
    stats_.copy_wait_time += absl::Now() - start;
    if (!closed_.ok()) return closed_;
    // Abandoned while we waited: Abandon waits for the copy and frees it.
    if (queue_.empty() || queue_.front() != index || slots_[index].use != use) continue;
    return PopHeadLocked(copy);
  }
}

absl::StatusOr<std::optional<StagedLayer>> KvStagingRing::PollReady() {
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return closed_;
  if (queue_.empty()) {
    if (!failed_.ok()) return failed_;
    return std::nullopt;
  }
  const CopyTicket ticket = slots_[queue_.front()].ticket;
  if (!copier_->Done(ticket)) return std::nullopt;
  absl::StatusOr<StagedLayer> layer = PopHeadLocked(copier_->Wait(ticket));
  if (!layer.ok()) return layer.status();
  return *std::move(layer);
}

absl::Status KvStagingRing::Release(StagingSlot slot) {
  absl::MutexLock lock(&mu_);
  if (!IsLocked(slot, SlotState::kHeld) && !IsLocked(slot, SlotState::kFilling)) {
    return absl::FailedPreconditionError(absl::StrCat("KV staging: release of slot ", slot.index, " (use ", slot.use,
                                                      "), which is not held (released twice, or a "
                                                      "stale handle)"));
  }
  FreeLocked(slot.index);
  return absl::OkStatus();
}

void KvStagingRing::Abandon(const engine::RequestId& request, const absl::Status& why) {
  std::vector<std::pair<int32_t, CopyTicket>> draining;
  {
    absl::MutexLock lock(&mu_);
    abandoned_.insert_or_assign(request, why);
    std::deque<int32_t> kept;
    for (int32_t index : queue_) {
      Slot& s = slots_[index];
      if (s.request == request) {
        s.state = SlotState::kDraining;
        draining.emplace_back(index, s.ticket);
      } else {
        kept.push_back(index);
      }
    }
    queue_ = std::move(kept);
    stats_.layers_abandoned += static_cast<int64_t>(draining.size());
    // Held slots stay the consumer's until Release; slots being filled are
    // refused at UnstageLayer.
    for (Slot& s : slots_) {
      if (s.state == SlotState::kFilling && s.request == request) s.abandoned = true;
    }
  }
  // The copies still read (or write) the request's device blocks and the
  // slots: the slots are free, and the caller may free the blocks, only
  // after them.
  std::vector<absl::Status> results;
  results.reserve(draining.size());
  for (const auto& [index, ticket] : draining) results.push_back(copier_->Wait(ticket));
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < draining.size(); ++i) {
    const int32_t index = draining[i].first;
    if (!results[i].ok()) (void)CopyFailedLocked(results[i], slots_[index].request, slots_[index].layer);
    FreeLocked(index);
  }
}

void KvStagingRing::Forget(const engine::RequestId& request) {
  absl::MutexLock lock(&mu_);
  abandoned_.erase(request);
}

void KvStagingRing::Close(absl::Status why) {
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return;
  closed_ = why.ok() ? absl::CancelledError("KV staging: ring closed") : std::move(why);
}

KvStagingStats KvStagingRing::stats() const {
  absl::MutexLock lock(&mu_);
  KvStagingStats s = stats_;
  s.free_slots = static_cast<int32_t>(free_.size());
  s.waiting_for_slot = waiting_for_slot_;
  return s;
}

}  // namespace pdserve::kv
