// The KV staging ring with a fake device copier (memcpy on its own thread,
// with a delay, a pause and an injected failure): bytes arrive intact and in
// order, backpressure and its timeout, readiness only after the copy,
// copy failures, abandoned requests, the receive direction, and both
// directions chained under concurrency. No assertion depends on timing;
// timeouts are only there to turn a deadlock into a failure.
#include "kv_transfer/kv_staging.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/kv_cache.h"
#include "gtest/gtest.h"

namespace pdserve::kv {
namespace {

using engine::RequestId;

// Long enough never to fire unless something is stuck.
constexpr absl::Duration kDeadlock = absl::Seconds(60);

// Copies in enqueue order on its own thread, like one CUDA stream.
class FakeDeviceCopier final : public DeviceCopier {
 public:
  explicit FakeDeviceCopier(absl::Duration delay_per_range = absl::ZeroDuration())
      : delay_(delay_per_range), worker_([this] { Run(); }) {}
  ~FakeDeviceCopier() override {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      paused_ = false;
    }
    worker_.join();
  }

  // The nth enqueued copy (from 1) and every later one fail with `why`.
  void FailFrom(uint64_t nth, absl::Status why) {
    absl::MutexLock lock(&mu_);
    fail_from_ = nth;
    failure_ = std::move(why);
  }
  // Copies enqueued while paused wait until Resume.
  void Pause() {
    absl::MutexLock lock(&mu_);
    paused_ = true;
  }
  void Resume() {
    absl::MutexLock lock(&mu_);
    paused_ = false;
  }
  int64_t copies_finished() {
    absl::MutexLock lock(&mu_);
    return finished_ok_;
  }
  int64_t enqueued(CopyDirection d) {
    absl::MutexLock lock(&mu_);
    return d == CopyDirection::kDeviceToHost ? to_host_ : to_device_;
  }

  CopyTicket Enqueue(CopyDirection direction, absl::Span<const CopyRange> ranges) override {
    absl::MutexLock lock(&mu_);
    ++(direction == CopyDirection::kDeviceToHost ? to_host_ : to_device_);
    jobs_.push_back({++last_ticket_, std::vector<CopyRange>(ranges.begin(), ranges.end())});
    return {last_ticket_};
  }
  bool Done(CopyTicket ticket) override {
    absl::MutexLock lock(&mu_);
    return ticket.value <= completed_;
  }
  absl::Status Wait(CopyTicket ticket) override {
    absl::MutexLock lock(&mu_);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ticket.value <= completed_; };
    mu_.Await(absl::Condition(&done));
    return ResultLocked(ticket.value);
  }

 private:
  struct Job {
    uint64_t ticket;
    std::vector<CopyRange> ranges;
  };

  absl::Status ResultLocked(uint64_t ticket) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return fail_from_ != 0 && ticket >= fail_from_ ? failure_ : absl::OkStatus();
  }

  void Run() {
    while (true) {
      Job job;
      bool fails;
      {
        absl::MutexLock lock(&mu_);
        auto work = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || (!paused_ && !jobs_.empty()); };
        mu_.Await(absl::Condition(&work));
        if (jobs_.empty()) return;  // Stopping.
        job = std::move(jobs_.front());
        jobs_.pop_front();
        fails = !ResultLocked(job.ticket).ok();
      }
      if (!fails) {
        for (const CopyRange& r : job.ranges) {
          if (delay_ > absl::ZeroDuration()) absl::SleepFor(delay_);  // The copy's duration.
          std::memcpy(r.dst, r.src, static_cast<size_t>(r.bytes));
        }
      }
      absl::MutexLock lock(&mu_);
      completed_ = job.ticket;
      if (!fails) ++finished_ok_;
    }
  }

  const absl::Duration delay_;
  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  uint64_t last_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t finished_ok_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t to_host_ ABSL_GUARDED_BY(mu_) = 0, to_device_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t fail_from_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;  // Last: starts once the rest is built.
};

RequestId Req(int i) { return RequestId(absl::StrCat("req-", i)); }

// A byte of (request, layer) at `offset` that differs between layers,
// requests and offsets, so stale or misplaced bytes show.
char Pattern(int request, int layer, int64_t offset) {
  return static_cast<char>((request * 131 + layer * 31 + offset * 7 + (offset >> 8)) & 0xff);
}

// One layer's KV in "device" memory, split into ranges like scattered blocks.
struct DeviceLayer {
  std::vector<std::vector<char>> blocks;
  int64_t bytes = 0;

  DeviceLayer(int request, int layer, const std::vector<int64_t>& sizes) {
    int64_t offset = 0;
    for (int64_t n : sizes) {
      std::vector<char>& b = blocks.emplace_back(n);
      for (int64_t i = 0; i < n; ++i) b[i] = Pattern(request, layer, offset + i);
      offset += n;
    }
    bytes = offset;
  }
  std::vector<DeviceRange> Ranges() {
    std::vector<DeviceRange> r;
    for (auto& b : blocks) r.push_back({b.data(), static_cast<int64_t>(b.size())});
    return r;
  }
};

// Layers 0..n-1 of `request`, each split into `sizes`.
std::vector<std::unique_ptr<DeviceLayer>> Layers(int request, int n, const std::vector<int64_t>& sizes) {
  std::vector<std::unique_ptr<DeviceLayer>> layers;
  layers.reserve(n);
  for (int l = 0; l < n; ++l) layers.push_back(std::make_unique<DeviceLayer>(request, l, sizes));
  return layers;
}

// Whether `host` holds the (request, layer) pattern for `bytes`.
bool HoldsLayer(const char* host, int64_t bytes, int request, int layer) {
  for (int64_t i = 0; i < bytes; ++i) {
    if (host[i] != Pattern(request, layer, i)) return false;
  }
  return true;
}

template <typename P>
bool Eventually(P pred) {
  const absl::Time end = absl::Now() + kDeadlock;
  while (absl::Now() < end) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return pred();
}

std::unique_ptr<KvStagingRing> MakeRing(DeviceCopier* copier, int32_t slots, int64_t slot_bytes,
                                        CopyDirection direction = CopyDirection::kDeviceToHost,
                                        absl::Duration slot_timeout = kDeadlock) {
  static HostKvRegionAllocator allocator;
  absl::StatusOr<std::unique_ptr<KvStagingRing>> ring = KvStagingRing::Create(
      {.direction = direction, .num_slots = slots, .slot_bytes = slot_bytes, .slot_timeout = slot_timeout}, copier,
      &allocator);
  EXPECT_TRUE(ring.ok()) << ring.status();
  return ring.ok() ? *std::move(ring) : nullptr;
}

TEST(KvStagingRingTest, RefusesABadShape) {
  FakeDeviceCopier copier;
  HostKvRegionAllocator allocator;
  EXPECT_EQ(KvStagingRing::Create({.num_slots = 0, .slot_bytes = 64}, &copier, &allocator).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvStagingRing::Create({.num_slots = 2, .slot_bytes = 0}, &copier, &allocator).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<char> big(65);
  std::vector<DeviceRange> too_big = {{big.data(), 65}};
  auto ring = MakeRing(&copier, 1, 64);
  absl::Status s = ring->StageLayer(Req(0), 0, too_big);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("req-0"), std::string::npos) << s;
  EXPECT_EQ(ring->stats().free_slots, 1);
}

class KvStagingRoundTripTest : public testing::TestWithParam<int32_t> {};

// Many requests' layers, interleaved as a batched forward produces them,
// go out in staging order with their bytes intact, whatever K.
TEST_P(KvStagingRoundTripTest, BytesArriveIntactAndInOrder) {
  const int32_t slots = GetParam();
  constexpr int kRequests = 6, kLayers = 12;
  FakeDeviceCopier copier(absl::Microseconds(20));
  std::vector<std::unique_ptr<DeviceLayer>> layers;  // [layer][request]
  int64_t total_bytes = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (int r = 0; r < kRequests; ++r) {
      layers.push_back(std::make_unique<DeviceLayer>(r, l, std::vector<int64_t>{512, 100 + 37 * r, 64 * l + 1}));
      total_bytes += layers.back()->bytes;
    }
  }
  auto ring = MakeRing(&copier, slots, 4096);
  std::thread consumer([&] {
    for (int l = 0; l < kLayers; ++l) {
      for (int r = 0; r < kRequests; ++r) {
        absl::StatusOr<StagedLayer> s = ring->NextReady(kDeadlock);
        ASSERT_TRUE(s.ok()) << s.status();
        EXPECT_EQ(s->request, Req(r));
        EXPECT_EQ(s->layer, l);
        EXPECT_EQ(s->bytes, layers[l * kRequests + r]->bytes);
        EXPECT_TRUE(HoldsLayer(s->host, s->bytes, r, l)) << "request " << r << " layer " << l;
        ASSERT_TRUE(ring->Release(s->slot).ok());
      }
    }
  });
  for (int l = 0; l < kLayers; ++l) {
    for (int r = 0; r < kRequests; ++r) {
      ASSERT_TRUE(ring->StageLayer(Req(r), l, layers[l * kRequests + r]->Ranges()).ok());
    }
  }
  consumer.join();
  const KvStagingStats stats = ring->stats();
  EXPECT_EQ(stats.layers_staged, kRequests * kLayers);
  EXPECT_EQ(stats.layers_delivered, kRequests * kLayers);
  EXPECT_EQ(stats.bytes_staged, total_bytes);
  EXPECT_EQ(stats.free_slots, slots);
  EXPECT_EQ(copier.enqueued(CopyDirection::kHostToDevice), 0);
}

INSTANTIATE_TEST_SUITE_P(Slots, KvStagingRoundTripTest, testing::Values(1, 2, 4),
                         [](const testing::TestParamInfo<int32_t>& info) { return absl::StrCat("K", info.param); });

TEST(KvStagingRingTest, StageLayerWaitsForAFreeSlotUntilARelease) {
  FakeDeviceCopier copier;
  DeviceLayer a(0, 0, {256}), b(0, 1, {256}), c(0, 2, {256});
  auto ring = MakeRing(&copier, 2, 256);
  ASSERT_TRUE(ring->StageLayer(Req(0), 0, a.Ranges()).ok());
  ASSERT_TRUE(ring->StageLayer(Req(0), 1, b.Ranges()).ok());
  std::atomic<bool> staged{false};
  absl::Status third;
  std::thread producer([&] {
    third = ring->StageLayer(Req(0), 2, c.Ranges());
    staged = true;
  });
  ASSERT_TRUE(Eventually([&] { return ring->stats().waiting_for_slot == 1; }));
  // Both slots are staged or ready, none released: the third must wait.
  absl::StatusOr<StagedLayer> first = ring->NextReady(kDeadlock);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(staged);
  ASSERT_TRUE(ring->Release(first->slot).ok());
  producer.join();
  EXPECT_TRUE(third.ok()) << third;
  EXPECT_EQ(ring->stats().slot_waits, 1);
  for (int layer = 1; layer <= 2; ++layer) {
    absl::StatusOr<StagedLayer> s = ring->NextReady(kDeadlock);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->layer, layer);
    EXPECT_TRUE(HoldsLayer(s->host, s->bytes, 0, layer));
    ASSERT_TRUE(ring->Release(s->slot).ok());
  }
}

TEST(KvStagingRingTest, StageLayerTimesOutWithAClearErrorWhenNoSlotIsReleased) {
  FakeDeviceCopier copier;
  DeviceLayer a(7, 0, {128}), b(7, 1, {128});
  auto ring = MakeRing(&copier, 1, 128, CopyDirection::kDeviceToHost, absl::Milliseconds(20));
  ASSERT_TRUE(ring->StageLayer(Req(7), 0, a.Ranges()).ok());
  absl::Status s = ring->StageLayer(Req(7), 1, b.Ranges());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("no free slot for request req-7 layer 1"), std::string::npos) << s;
  EXPECT_EQ(ring->stats().slot_timeouts, 1);
  // The ring goes on once the consumer releases.
  absl::StatusOr<StagedLayer> first = ring->NextReady(kDeadlock);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(ring->Release(first->slot).ok());
  EXPECT_TRUE(ring->StageLayer(Req(7), 1, b.Ranges()).ok());
}

TEST(KvStagingRingTest, CloseWakesAProducerWaitingForASlot) {
  FakeDeviceCopier copier;
  DeviceLayer a(0, 0, {64}), b(0, 1, {64});
  auto ring = MakeRing(&copier, 1, 64);
  ASSERT_TRUE(ring->StageLayer(Req(0), 0, a.Ranges()).ok());
  absl::Status blocked;
  std::thread producer([&] { blocked = ring->StageLayer(Req(0), 1, b.Ranges()); });
  ASSERT_TRUE(Eventually([&] { return ring->stats().waiting_for_slot == 1; }));
  ring->Close(absl::UnavailableError("worker shutting down"));
  producer.join();
  EXPECT_EQ(blocked.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(ring->NextReady(kDeadlock).status().code(), absl::StatusCode::kUnavailable);
}

TEST(KvStagingRingTest, ALayerIsNotReadyBeforeItsCopyFinished) {
  FakeDeviceCopier copier;
  DeviceLayer a(3, 0, {1000});
  auto ring = MakeRing(&copier, 2, 1024);
  copier.Pause();
  ASSERT_TRUE(ring->StageLayer(Req(3), 0, a.Ranges()).ok());
  absl::StatusOr<std::optional<StagedLayer>> polled = ring->PollReady();
  ASSERT_TRUE(polled.ok()) << polled.status();
  EXPECT_FALSE(polled->has_value());
  std::atomic<bool> handed_out{false};
  std::thread consumer([&] {
    absl::StatusOr<StagedLayer> s = ring->NextReady(kDeadlock);
    handed_out = true;
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(HoldsLayer(s->host, s->bytes, 3, 0));
    EXPECT_TRUE(ring->Release(s->slot).ok());
  });
  polled = ring->PollReady();
  ASSERT_TRUE(polled.ok()) << polled.status();
  EXPECT_FALSE(polled->has_value());
  EXPECT_FALSE(handed_out);  // The copy cannot have run: the copier is paused.
  copier.Resume();
  consumer.join();
}

// With slow copies of many ranges, the consumer, always waiting, would see
// a layer the moment it were reported early.
TEST(KvStagingRingTest, EveryLayerHandedOutHasItsCopyFinished) {
  constexpr int kLayers = 40;
  FakeDeviceCopier copier(absl::Microseconds(200));
  const auto layers = Layers(1, kLayers, std::vector<int64_t>(8, 128));
  auto ring = MakeRing(&copier, 3, int64_t{8} * 128);
  std::thread consumer([&] {
    for (int l = 0; l < kLayers; ++l) {
      absl::StatusOr<StagedLayer> s = ring->NextReady(kDeadlock);
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_GE(copier.copies_finished(), l + 1);
      EXPECT_EQ(s->layer, l);
      EXPECT_TRUE(HoldsLayer(s->host, s->bytes, 1, l)) << "layer " << l;
      ASSERT_TRUE(ring->Release(s->slot).ok());
    }
  });
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(ring->StageLayer(Req(1), l, layers[l]->Ranges()).ok());
  consumer.join();
}

TEST(KvStagingRingTest, ACopyFailureFailsThatLayerAndEveryLaterOne) {
  FakeDeviceCopier copier;
  copier.FailFrom(3, absl::DataLossError("injected DMA fault"));
  const auto layers = Layers(2, 5, {64});
  auto ring = MakeRing(&copier, 4, 64);
  for (int l = 0; l < 4; ++l) ASSERT_TRUE(ring->StageLayer(Req(2), l, layers[l]->Ranges()).ok());
  for (int l = 0; l < 2; ++l) {
    absl::StatusOr<StagedLayer> s = ring->NextReady(kDeadlock);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->layer, l);
    EXPECT_TRUE(HoldsLayer(s->host, s->bytes, 2, l));
    ASSERT_TRUE(ring->Release(s->slot).ok());
  }
  for (int l = 2; l < 4; ++l) {
    absl::StatusOr<StagedLayer> s = ring->NextReady(kDeadlock);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(s.status().message().find(absl::StrCat("request req-2 layer ", l)), std::string::npos) << s.status();
    EXPECT_NE(s.status().message().find("injected DMA fault"), std::string::npos) << s.status();
  }
  // Nothing more will come: every call fails at once instead of waiting.
  EXPECT_EQ(ring->NextReady(kDeadlock).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ring->PollReady().status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ring->StageLayer(Req(2), 4, layers[4]->Ranges()).code(), absl::StatusCode::kDataLoss);
  const KvStagingStats stats = ring->stats();
  EXPECT_EQ(stats.copy_failures, 2);
  EXPECT_EQ(stats.free_slots, 4);
}

TEST(KvStagingRingTest, ACopyFailureWakesAProducerWaitingForASlot) {
  FakeDeviceCopier copier;
  copier.FailFrom(1, absl::InternalError("injected"));
  DeviceLayer a(0, 0, {64}), b(0, 1, {64});
  auto ring = MakeRing(&copier, 1, 64);
  ASSERT_TRUE(ring->StageLayer(Req(0), 0, a.Ranges()).ok());
  absl::Status blocked;
  std::thread producer([&] { blocked = ring->StageLayer(Req(0), 1, b.Ranges()); });
  EXPECT_EQ(ring->NextReady(kDeadlock).status().code(), absl::StatusCode::kInternal);
  producer.join();
  EXPECT_EQ(blocked.code(), absl::StatusCode::kInternal);
  EXPECT_NE(blocked.message().find("request req-0 layer 0"), std::string::npos) << blocked;
}

TEST(KvStagingRingTest, AbandonDropsTheRequestsQueuedLayersAndRefusesLaterOnes) {
  FakeDeviceCopier copier;
  const RequestId a = Req(10), b = Req(11);
  DeviceLayer a0(10, 0, {64}), a1(10, 1, {64}), a2(10, 2, {64}), b0(11, 0, {64}), b1(11, 1, {64});
  auto ring = MakeRing(&copier, 4, 64);
  ASSERT_TRUE(ring->StageLayer(a, 0, a0.Ranges()).ok());
  ASSERT_TRUE(ring->StageLayer(b, 0, b0.Ranges()).ok());
  ASSERT_TRUE(ring->StageLayer(a, 1, a1.Ranges()).ok());
  ASSERT_TRUE(ring->StageLayer(b, 1, b1.Ranges()).ok());
  absl::StatusOr<StagedLayer> held = ring->NextReady(kDeadlock);  // a's layer 0, mid-put.
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_EQ(held->request, a);

  ring->Abandon(a, absl::UnavailableError("decode worker gone"));
  std::vector<StagedLayer> rest;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<StagedLayer> s = ring->NextReady(kDeadlock);
    ASSERT_TRUE(s.ok()) << s.status();
    rest.push_back(*s);
  }
  EXPECT_EQ(rest[0].request, b);
  EXPECT_EQ(rest[0].layer, 0);
  EXPECT_EQ(rest[1].request, b);
  EXPECT_EQ(rest[1].layer, 1);
  absl::StatusOr<std::optional<StagedLayer>> none = ring->PollReady();  // Never a's layer 1.
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());

  absl::Status refused = ring->StageLayer(a, 2, a2.Ranges());
  EXPECT_EQ(refused.code(), absl::StatusCode::kAborted);
  EXPECT_NE(refused.message().find("decode worker gone"), std::string::npos) << refused;
  // The slot it held while abandoned is still the consumer's to release.
  EXPECT_TRUE(ring->Release(held->slot).ok());
  for (const StagedLayer& s : rest) EXPECT_TRUE(ring->Release(s.slot).ok());
  KvStagingStats stats = ring->stats();
  EXPECT_EQ(stats.free_slots, 4);
  EXPECT_EQ(stats.layers_abandoned, 1);

  ring->Forget(a);  // A retry of the request stages afresh.
  ASSERT_TRUE(ring->StageLayer(a, 0, a0.Ranges()).ok());
  absl::StatusOr<StagedLayer> again = ring->NextReady(kDeadlock);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->request, a);
  EXPECT_TRUE(HoldsLayer(again->host, again->bytes, 10, 0));
  EXPECT_TRUE(ring->Release(again->slot).ok());
}

// Abandon returns only once the request's copies stopped touching its
// blocks; a producer waiting for a slot for it gives up at once, and a
// consumer waiting on its copy does not get it.
TEST(KvStagingRingTest, AbandonWaitsForCopiesInFlightAndWakesItsWaiters) {
  FakeDeviceCopier copier;
  const RequestId a = Req(20);
  DeviceLayer a0(20, 0, {64}), a1(20, 1, {64});
  auto ring = MakeRing(&copier, 1, 64);
  copier.Pause();
  ASSERT_TRUE(ring->StageLayer(a, 0, a0.Ranges()).ok());
  absl::Status producer_status;
  std::thread producer([&] { producer_status = ring->StageLayer(a, 1, a1.Ranges()); });
  absl::Status consumer_status;
  std::thread consumer([&] { consumer_status = ring->NextReady(absl::Milliseconds(100)).status(); });
  ASSERT_TRUE(Eventually([&] { return ring->stats().waiting_for_slot == 1; }));
  std::atomic<bool> abandoned{false};
  std::thread abandoner([&] {
    ring->Abandon(a, absl::CancelledError("client went away"));
    abandoned = true;
  });
  producer.join();
  EXPECT_EQ(producer_status.code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(abandoned);  // Its copy is still paused.
  copier.Resume();
  abandoner.join();
  consumer.join();
  EXPECT_EQ(consumer_status.code(), absl::StatusCode::kDeadlineExceeded) << consumer_status;
  EXPECT_EQ(copier.copies_finished(), 1);
  EXPECT_EQ(ring->stats().free_slots, 1);
  absl::StatusOr<std::optional<StagedLayer>> none = ring->PollReady();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
}

TEST(KvStagingRingTest, ReleaseInAnyOrderAndRefuseASlotNotHeld) {
  FakeDeviceCopier copier;
  const auto layers = Layers(0, 4, {64});
  auto ring = MakeRing(&copier, 3, 64);
  std::vector<StagedLayer> held;
  for (int l = 0; l < 3; ++l) {
    ASSERT_TRUE(ring->StageLayer(Req(0), l, layers[l]->Ranges()).ok());
    absl::StatusOr<StagedLayer> s = ring->NextReady(kDeadlock);
    ASSERT_TRUE(s.ok()) << s.status();
    held.push_back(*s);
  }
  EXPECT_TRUE(ring->Release(held[2].slot).ok());
  EXPECT_TRUE(ring->Release(held[0].slot).ok());
  EXPECT_EQ(ring->Release(held[0].slot).code(), absl::StatusCode::kFailedPrecondition);  // Twice.
  // held[0]'s slot is taken again: its old handle must not free the new use.
  ASSERT_TRUE(ring->StageLayer(Req(0), 3, layers[3]->Ranges()).ok());
  absl::StatusOr<StagedLayer> next = ring->NextReady(kDeadlock);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(ring->Release(held[0].slot).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ring->Release(held[2].slot).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ring->Release({.index = 99, .use = 1}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HoldsLayer(next->host, next->bytes, 0, 3));
  EXPECT_TRUE(ring->Release(held[1].slot).ok());
  EXPECT_TRUE(ring->Release(next->slot).ok());
  EXPECT_EQ(ring->stats().free_slots, 3);
}

// Receiving: a layer lands in a slot, is copied into scattered pool
// blocks, and is complete only once that copy finished.
TEST(KvStagingRingTest, AReceivedLayerIsCompleteOnlyAfterItsCopyToTheDevice) {
  FakeDeviceCopier copier;
  std::vector<char> pool(4096, 0);
  auto ring = MakeRing(&copier, 2, 1024, CopyDirection::kHostToDevice);
  copier.Pause();
  absl::StatusOr<StagedLayer> slot = ring->TakeSlot(Req(5), 0);
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_EQ(slot->bytes, 1024);
  for (int64_t i = 0; i < 768; ++i) slot->host[i] = Pattern(5, 0, i);  // What the network wrote.
  const std::vector<DeviceRange> blocks = {{pool.data() + 3072, 256}, {pool.data(), 256}, {pool.data() + 1024, 256}};
  ASSERT_TRUE(ring->UnstageLayer(slot->slot, blocks).ok());
  EXPECT_EQ(ring->UnstageLayer(slot->slot, blocks).code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::optional<StagedLayer>> polled = ring->PollReady();
  ASSERT_TRUE(polled.ok()) << polled.status();
  EXPECT_FALSE(polled->has_value());
  EXPECT_EQ(pool[3072], 0);
  copier.Resume();
  absl::StatusOr<StagedLayer> done = ring->NextReady(kDeadlock);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->request, Req(5));
  EXPECT_EQ(done->layer, 0);
  EXPECT_EQ(done->bytes, 768);
  EXPECT_TRUE(ring->Release(done->slot).ok());
  for (int64_t i = 0; i < 256; ++i) {
    ASSERT_EQ(pool[3072 + i], Pattern(5, 0, i));
    ASSERT_EQ(pool[i], Pattern(5, 0, 256 + i));
    ASSERT_EQ(pool[1024 + i], Pattern(5, 0, 512 + i));
  }
  EXPECT_EQ(copier.enqueued(CopyDirection::kHostToDevice), 1);
  EXPECT_EQ(copier.enqueued(CopyDirection::kDeviceToHost), 0);
}

TEST(KvStagingRingTest, AbandonGivesBackReceivingSlots) {
  FakeDeviceCopier copier;
  std::vector<char> pool(64);
  auto ring = MakeRing(&copier, 2, 64, CopyDirection::kHostToDevice);
  absl::StatusOr<StagedLayer> landing = ring->TakeSlot(Req(1), 0);
  absl::StatusOr<StagedLayer> unused = ring->TakeSlot(Req(2), 0);
  ASSERT_TRUE(landing.ok() && unused.ok());
  ring->Abandon(Req(1), absl::DeadlineExceededError("lease expired"));
  const std::vector<DeviceRange> block = {{pool.data(), 64}};
  absl::Status s = ring->UnstageLayer(landing->slot, block);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_NE(s.message().find("lease expired"), std::string::npos) << s;
  EXPECT_EQ(ring->TakeSlot(Req(1), 1).status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(ring->Release(unused->slot).ok());  // Taken, then not needed.
  EXPECT_EQ(ring->stats().free_slots, 2);
  absl::StatusOr<std::optional<StagedLayer>> none = ring->PollReady();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
}

// Both directions chained as a handoff would be, on separate threads:
// prefill compute stages each layer of each request from its pool blocks,
// the "sender" moves staged layers into receive slots (the put) and
// releases out of order, the "receiver" unstages them into the decode
// pool's blocks, and the decode side sees every layer, in order, complete.
TEST(KvStagingRingTest, ThousandsOfLayersThroughBothDirectionsConcurrently) {
  constexpr int kRequests = 80;
  constexpr int kBlocksPerRequest = 4;
  const KvCacheSpec spec = {.num_layers = 32,
                            .num_kv_heads = 2,
                            .head_dim = 8,
                            .block_size = 4,
                            .dtype = DType::kF32,
                            .num_blocks = kRequests * kBlocksPerRequest};
  auto prefill = BlockPool::Create(spec);
  auto decode = BlockPool::Create(spec);
  ASSERT_TRUE(prefill.ok() && decode.ok());
  std::mt19937_64 rng(42);
  {
    auto* p = static_cast<uint64_t*>((*prefill)->region().data());
    for (size_t i = 0; i < (*prefill)->region().size() / 8; ++i) p[i] = rng();
  }
  std::vector<std::vector<BlockId>> src_tables, dst_tables;
  for (int r = 0; r < kRequests; ++r) {
    auto s = (*prefill)->Allocate(kBlocksPerRequest);
    auto d = (*decode)->Allocate(kBlocksPerRequest);
    ASSERT_TRUE(s.ok() && d.ok());
    src_tables.push_back(*s);
    dst_tables.push_back(*d);
  }
  const int64_t layer_block = spec.LayerBlockBytes();
  auto ranges = [&](const KvStorage& kv, const std::vector<BlockId>& table, int32_t layer) {
    std::vector<DeviceRange> r;
    r.reserve(table.size());
    for (BlockId b : table) r.push_back({kv.BlockData(layer, b), layer_block});
    return r;
  };

  FakeDeviceCopier to_host, to_device;
  auto send = MakeRing(&to_host, 2, kBlocksPerRequest * layer_block);
  auto recv = MakeRing(&to_device, 3, kBlocksPerRequest * layer_block, CopyDirection::kHostToDevice);
  const int total = kRequests * spec.num_layers;

  std::thread compute([&] {
    const KvStorage kv = (*prefill)->storage();
    for (int r = 0; r < kRequests; ++r) {
      for (int32_t l = 0; l < spec.num_layers; ++l) {
        ASSERT_TRUE(send->StageLayer(Req(r), l, ranges(kv, src_tables[r], l)).ok());
      }
    }
  });
  std::thread sender([&] {
    std::vector<StagingSlot> done_puts;  // Released two at a time, newest first.
    for (int i = 0; i < total; ++i) {
      absl::StatusOr<StagedLayer> s = i % 2 == 0 ? send->NextReady(kDeadlock) : [&]() -> absl::StatusOr<StagedLayer> {
        while (true) {  // The polling consumer's path.
          absl::StatusOr<std::optional<StagedLayer>> p = send->PollReady();
          if (!p.ok()) return p.status();
          if (p->has_value()) return **p;
          std::this_thread::yield();
        }
      }();
      ASSERT_TRUE(s.ok()) << s.status();
      absl::StatusOr<StagedLayer> landing = recv->TakeSlot(s->request, s->layer);
      ASSERT_TRUE(landing.ok()) << landing.status();
      std::memcpy(landing->host, s->host, s->bytes);
      const int r = std::stoi(s->request.str().substr(4));
      ASSERT_TRUE(recv->UnstageLayer(landing->slot, ranges((*decode)->storage(), dst_tables[r], s->layer)).ok());
      done_puts.push_back(s->slot);
      if (done_puts.size() == 2 || i == total - 1) {
        for (auto it = done_puts.rbegin(); it != done_puts.rend(); ++it) ASSERT_TRUE(send->Release(*it).ok());
        done_puts.clear();
      }
    }
  });
  std::thread decoder([&] {
    const KvStorage kv = (*decode)->storage();
    for (int i = 0; i < total; ++i) {
      absl::StatusOr<StagedLayer> s = recv->NextReady(kDeadlock);
      ASSERT_TRUE(s.ok()) << s.status();
      const int r = i / spec.num_layers;
      const int32_t l = i % spec.num_layers;
      ASSERT_EQ(s->request, Req(r));
      ASSERT_EQ(s->layer, l);
      ASSERT_TRUE(recv->Release(s->slot).ok());
      // Complete now: the layer's blocks in the decode pool hold its KV.
      const KvStorage src = (*prefill)->storage();
      for (int b = 0; b < kBlocksPerRequest; ++b) {
        ASSERT_EQ(std::memcmp(kv.BlockData(l, dst_tables[r][b]), src.BlockData(l, src_tables[r][b]), layer_block), 0)
            << "request " << r << " layer " << l << " block " << b;
      }
    }
  });
  compute.join();
  sender.join();
  decoder.join();
  EXPECT_EQ(send->stats().layers_delivered, total);
  EXPECT_EQ(recv->stats().layers_delivered, total);
  EXPECT_EQ(send->stats().bytes_staged, int64_t{total} * kBlocksPerRequest * layer_block);
  EXPECT_EQ(send->stats().free_slots, 2);
  EXPECT_EQ(recv->stats().free_slots, 3);
}

}  // namespace
}  // namespace pdserve::kv
