// The router's queue for decode KV room and its ledger: the queue's order
// (first come first served per key, keys in turn), its bounds (full, wait,
// the client's deadline, a cancel) on synthetic room; the ledger's
// arithmetic against fake workers' reports; and relays through both over
// fake workers: a burst past the decode pool waits and completes exactly,
// the excess past the bound is refused before any prefill, a request
// larger than any pool is refused naming max_tokens.
#include "router/request_queue.h"

#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "router/api_keys.h"
#include "router/decode_room.h"
#include "tests/router/in_process_router.h"

namespace pdserve::router::testing {
namespace {

// Room for `free` requests, taken one each; Give adds some and pokes.
class Room {
 public:
  explicit Room(RequestQueue* queue) : queue_(queue) {}
  PlaceOutcome Take(const std::string& who) {
    absl::MutexLock lock(&mu_);
    if (free_ == 0) return PlaceOutcome::kNoRoom;
    --free_;
    order_.push_back(who);
    return PlaceOutcome::kPlaced;
  }
  void Give(int n) {
    {
      absl::MutexLock lock(&mu_);
      free_ += n;
    }
    queue_->Poke();
  }
  std::vector<std::string> order() {
    absl::MutexLock lock(&mu_);
    return order_;
  }

 private:
  RequestQueue* queue_;
  absl::Mutex mu_;
  int free_ = 0;
  std::vector<std::string> order_;
};

// Waits (real time, test only) until `pred` holds.
void Until(const std::function<bool()>& pred) {
  for (int i = 0; i < 5000 && !pred(); ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_TRUE(pred());
}

struct Waiting {
  std::thread thread;
  absl::Status status;
  absl::Duration waited;
  std::atomic<bool> cancelled{false};
  RequestQueue::Entry entry;
};

std::unique_ptr<Waiting> Enter(RequestQueue& q, Room& room, const std::string& key, const std::string& who,
                               std::optional<absl::Time> deadline = std::nullopt) {
  auto w = std::make_unique<Waiting>();
  w->entry.key = key;
  w->entry.deadline = deadline;
  w->entry.cancelled = &w->cancelled;
  w->entry.place = [&room, who] { return room.Take(who); };
  Waiting* raw = w.get();
  const int64_t before = q.Stats().waiting + q.Stats().placed;
  w->thread = std::thread([&q, raw] { raw->status = q.Wait(raw->entry, &raw->waited); });
  // Each enters in the order the test gives.
  Until([&] { return q.Stats().waiting + q.Stats().placed > before; });
  return w;
}

TEST(RequestQueueTest, ARequestThatFindsRoomAndNobodyWaitingGoesOnAtOnce) {
  RequestQueue q({});
  Room room(&q);
  room.Give(1);
  RequestQueue::Entry e;
  e.place = [&room] { return room.Take("a"); };
  absl::Duration waited = absl::Seconds(1);
  QueueEnd end = QueueEnd::kCancelled;
  EXPECT_TRUE(q.Wait(e, &waited, &end).ok());
  EXPECT_EQ(waited, absl::ZeroDuration());
  EXPECT_EQ(end, QueueEnd::kPlaced);
  EXPECT_EQ(q.Stats().placed, 1);
  EXPECT_EQ(q.Stats().placed_waited, 0);
}

TEST(RequestQueueTest, OneKeysRequestsGoInArrivalOrderAndKeysTakeTurns) {
  RequestQueue q({});
  Room room(&q);
  std::vector<std::unique_ptr<Waiting>> w;
  for (const char* who : {"a1", "a2", "a3", "a4"}) w.push_back(Enter(q, room, "A", who));
  for (const char* who : {"b1", "b2"}) w.push_back(Enter(q, room, "B", who));
  EXPECT_EQ(q.Stats().waiting, 6);
  // One place at a time: the keys alternate while both wait.
  for (int i = 0; i < 6; ++i) {
    room.Give(1);
    Until([&] { return static_cast<int>(room.order().size()) == i + 1; });
  }
  for (auto& x : w) x->thread.join();
  EXPECT_EQ(room.order(), (std::vector<std::string>{"a1", "b1", "a2", "b2", "a3", "a4"}));
  for (auto& x : w) EXPECT_TRUE(x->status.ok()) << x->status;
  EXPECT_EQ(q.Stats().placed_waited, 6);
  EXPECT_EQ(q.Stats().waiting, 0);
}

TEST(RequestQueueTest, NobodyOvertakesTheRequestWhoseTurnItIs) {
  RequestQueue q({});
  RequestQueue::Entry big;
  std::atomic<bool> big_fits{false};
  big.place = [&] { return big_fits.load() ? PlaceOutcome::kPlaced : PlaceOutcome::kNoRoom; };
  absl::Status big_status;
  std::thread t([&] { big_status = q.Wait(big, nullptr); });
  Until([&] { return q.Stats().waiting == 1; });
  Room room(&q);
  room.Give(5);  // room for small ones, not for the big one
  auto small = Enter(q, room, "", "small");
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(room.order().empty());
  EXPECT_EQ(q.Stats().waiting, 2);
  big_fits = true;
  q.Poke();
  t.join();
  small->thread.join();
  EXPECT_TRUE(big_status.ok());
  EXPECT_EQ(room.order(), std::vector<std::string>{"small"});
}

TEST(RequestQueueTest, AFullQueueRefusesAtOnceWithARetryAfter) {
  RequestQueue q({.max_queued = 2});
  Room room(&q);
  auto a = Enter(q, room, "", "a");
  auto b = Enter(q, room, "", "b");
  RequestQueue::Entry c;
  bool tried = false;
  c.place = [&] {
    tried = true;
    return PlaceOutcome::kPlaced;
  };
  c.before_queue = absl::Milliseconds(3);
  QueueEnd end = QueueEnd::kPlaced;
  const absl::Status st = q.Wait(c, nullptr, &end);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_EQ(end, QueueEnd::kFull);
  EXPECT_GE(q.Stats().refused_full_seconds, 0.003) << "the router's time before the queue counts";
  EXPECT_EQ(q.Stats().refused_full_max_seconds, q.Stats().refused_full_seconds);
  EXPECT_EQ(st.message(), "the router's queue is full: 2 requests waiting (--max_queued_requests)");
  EXPECT_TRUE(st.GetPayload(kRetryAfterPayload).has_value());
  EXPECT_FALSE(tried) << "a refused request is never placed";
  EXPECT_EQ(q.Stats().refused_full, 1);
  room.Give(2);
  a->thread.join();
  b->thread.join();
}

TEST(RequestQueueTest, NoQueueAtAllRefusesWhatFindsNoRoom) {
  RequestQueue q({.max_queued = 0});
  Room room(&q);
  RequestQueue::Entry e;
  e.place = [&room] { return room.Take("x"); };
  EXPECT_TRUE(absl::IsResourceExhausted(q.Wait(e, nullptr)));
  room.Give(1);
  EXPECT_TRUE(q.Wait(e, nullptr).ok());
}

TEST(RequestQueueTest, AWaitPastTheBoundIsRefusedWithARetryAfterAndTheNextGoesOn) {
  RequestQueue q({.max_wait = absl::Milliseconds(50)});
  RequestQueue::Entry e;
  e.place = [] { return PlaceOutcome::kNoRoom; };
  absl::Duration waited;
  QueueEnd end = QueueEnd::kPlaced;
  const absl::Status st = q.Wait(e, &waited, &end);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_EQ(end, QueueEnd::kWaitedTooLong);
  EXPECT_TRUE(absl::StrContains(st.message(), "in the router's queue for decode KV room (--max_queue_wait_s)")) << st;
  EXPECT_TRUE(st.GetPayload(kRetryAfterPayload).has_value());
  EXPECT_GE(waited, absl::Milliseconds(50));
  EXPECT_EQ(q.Stats().refused_wait, 1);
  EXPECT_EQ(q.Stats().waiting, 0);
}

TEST(RequestQueueTest, TheClientsDeadlineEndsTheWaitWithDeadlineExceeded) {
  RequestQueue q({});
  RequestQueue::Entry e;
  e.place = [] { return PlaceOutcome::kNoRoom; };
  e.deadline = absl::Now() + absl::Milliseconds(30);
  QueueEnd end = QueueEnd::kPlaced;
  const absl::Status st = q.Wait(e, nullptr, &end);
  EXPECT_TRUE(absl::IsDeadlineExceeded(st)) << st;
  EXPECT_EQ(end, QueueEnd::kDeadline);
  EXPECT_EQ(q.Stats().deadline, 1);
  EXPECT_EQ(q.Stats().refused_wait, 0);
}

TEST(RequestQueueTest, ACancelEndsTheWaitAndTheRequestBehindItGoesOn) {
  RequestQueue q({});
  Room room(&q);
  auto first = Enter(q, room, "", "first");
  auto second = Enter(q, room, "", "second");
  first->cancelled = true;
  q.WakeCancelled();
  first->thread.join();
  EXPECT_TRUE(absl::IsCancelled(first->status)) << first->status;
  room.Give(1);
  second->thread.join();
  EXPECT_TRUE(second->status.ok());
  EXPECT_EQ(room.order(), std::vector<std::string>{"second"});
  EXPECT_EQ(q.Stats().cancelled, 1);
}

// The ledger against a fake decode worker's reports.
TEST(DecodeRoomTest, RoomIsThePoolLessWhatIsPlacedLessWhatTheWorkerHoldsBeyondIt) {
  InProcessRouter rig({.queue = RequestQueueOptions{}});
  FakeWorker& f = rig.AddWorker(Role::kDecode, "d0");
  WorkerPtr d = rig.Find(Role::kDecode, "d0");
  EXPECT_FALSE(rig.room.Free(*d).has_value()) << "no report yet";
  f.kv_blocks_total = 10;
  f.kv_blocks_free = 10;
  rig.ProbeAll();
  EXPECT_EQ(rig.room.Free(*d), 160);
  RoomLease a = rig.room.Take(d, 20);  // two blocks of 16
  EXPECT_EQ(a.positions(), 32);
  EXPECT_EQ(rig.room.Free(*d), 128);
  // The worker holds 6 blocks: the lease's 2 and 4 the router did not place.
  f.kv_blocks_free = 4;
  rig.ProbeAll();
  EXPECT_EQ(rig.room.Free(*d), 160 - 32 - 64);
  a.Release();
  EXPECT_EQ(rig.room.Free(*d), 160 - 64) << "the other holder's blocks count until a report shows them gone";
  f.kv_blocks_free = 10;
  rig.ProbeAll();
  EXPECT_EQ(rig.room.Free(*d), 160);
  EXPECT_EQ(rig.room.Placed(*d), 0);
}

class QueuedRelayTest : public ::testing::Test {
 protected:
  // One prefill and one decode worker whose pool holds `blocks` blocks of
  // 16 positions; each request takes one (a prompt of 8 + max_tokens 8).
  void Cluster(RequestQueueOptions qo, int32_t blocks) {
    rig_ = std::make_unique<InProcessRouter>(RigOptions{.queue = qo});
    rig_->AddWorker(Role::kPrefill, "p0");
    FakeWorker& d = rig_->AddWorker(Role::kDecode, "d0");
    d.kv_blocks_total = blocks;
    d.kv_blocks_free = blocks;
    d.decode_permits = permits_;
    rig_->ProbeAll();
  }
  static GenerationRequest Request(uint64_t seed) { return InProcessRouter::Request(8, seed, 8); }

  std::shared_ptr<std::atomic<int>> permits_ = std::make_shared<std::atomic<int>>(0);
  std::unique_ptr<InProcessRouter> rig_;
};

TEST_F(QueuedRelayTest, ABurstOfFourTimesTheDecodePoolWaitsAndEveryStreamCompletesExactly) {
  constexpr int kBlocks = 6;
  constexpr int kRequests = 4 * kBlocks;
  Cluster({}, kBlocks);
  std::vector<Relayed> out(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([this, i, &out] { out[i] = rig_->Run(Request(100 + i)); });
  }
  FakeWorker& p = rig_->workers.at("p0");
  FakeWorker& d = rig_->workers.at("d0");
  // The pool's worth goes on; the rest wait in the router, before prefill.
  Until([&] { return rig_->queue->Stats().waiting == kRequests - kBlocks; });
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(rig_->queue->Stats().waiting, kRequests - kBlocks);
  EXPECT_EQ(rig_->room.Placed(*rig_->Find(Role::kDecode, "d0")), kBlocks * 16);
  // Let the streams run; each that ends makes room for the next.
  *permits_ = 1 << 20;
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(out[i].status.ok()) << out[i].status;
    EXPECT_EQ(out[i].tokens, InProcessRouter::Expected(Request(100 + i))) << i;
    ASSERT_TRUE(out[i].final.has_value());
    EXPECT_EQ(out[i].final->finish_reason(), v1::FINISH_REASON_LENGTH);
  }
  EXPECT_EQ(p.prefills.size(), static_cast<size_t>(kRequests)) << "every request prefilled once";
  EXPECT_EQ(d.decodes.size(), static_cast<size_t>(kRequests)) << "no handoff refused, no migration";
  EXPECT_EQ(rig_->queue->Stats().placed, kRequests);
  EXPECT_GE(rig_->queue->Stats().placed_waited, kRequests - kBlocks);
  EXPECT_EQ(rig_->room.Placed(*rig_->Find(Role::kDecode, "d0")), 0);
  EXPECT_EQ(rig_->Count("pdserve_migrations_total"), 0);
}

TEST_F(QueuedRelayTest, TheExcessPastTheQueueBoundIsRefusedBeforeAnyPrefill) {
  Cluster({.max_queued = 2}, 1);
  std::vector<Relayed> out(3);
  std::vector<std::thread> threads;
  threads.emplace_back([this, &out] { out[0] = rig_->Run(Request(1)); });  // holds the pool
  Until([&] { return rig_->workers.at("d0").decodes.size() == 1; });
  for (int i = 1; i < 3; ++i) threads.emplace_back([this, i, &out] { out[i] = rig_->Run(Request(1 + i)); });
  Until([&] { return rig_->queue->Stats().waiting == 2; });
  const Relayed refused = rig_->Run(Request(9));
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status)) << refused.status;
  EXPECT_TRUE(refused.status.GetPayload(kRetryAfterPayload).has_value());
  EXPECT_EQ(rig_->workers.at("p0").prefills.size(), 1u) << "only the placed request reached the prefill worker";
  EXPECT_EQ(rig_->Count("pdserve_requests_total", "outcome=\"queue_full\""), 1);
  *permits_ = 1 << 20;
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(out[i].tokens, InProcessRouter::Expected(Request(1 + i))) << i;
}

TEST_F(QueuedRelayTest, AWaitPastTheBoundIsRefusedBeforeAnyPrefill) {
  Cluster({.max_wait = absl::Milliseconds(50)}, 1);
  std::thread holder([this] { (void)rig_->Run(Request(1)); });
  Until([&] { return rig_->workers.at("d0").decodes.size() == 1; });
  const Relayed late = rig_->Run(Request(2));
  EXPECT_TRUE(absl::IsResourceExhausted(late.status)) << late.status;
  EXPECT_TRUE(absl::StrContains(late.status.message(), "--max_queue_wait_s")) << late.status;
  EXPECT_EQ(rig_->workers.at("p0").prefills.size(), 1u);
  EXPECT_EQ(rig_->Count("pdserve_requests_total", "outcome=\"queue_wait\""), 1);
  *permits_ = 1 << 20;
  holder.join();
}

TEST_F(QueuedRelayTest, ARequestLargerThanAnyDecodePoolIsRefusedNamingMaxTokens) {
  Cluster({}, 2);  // 32 positions
  const Relayed r = rig_->Run(InProcessRouter::Request(40, 1, 8));
  EXPECT_TRUE(absl::IsInvalidArgument(r.status)) << r.status;
  EXPECT_TRUE(absl::StartsWith(r.status.message(), "max_tokens: the request needs 48 positions")) << r.status;
  EXPECT_TRUE(rig_->workers.at("p0").prefills.empty());
}

TEST_F(QueuedRelayTest, ACancelWhileQueuedEndsTheRequestCancelledWithNoWorkerCalled) {
  Cluster({}, 1);
  std::thread holder([this] { (void)rig_->Run(Request(1)); });
  Until([&] { return rig_->workers.at("d0").decodes.size() == 1; });
  Relay* queued = nullptr;
  absl::Mutex mu;
  Relayed r;
  std::thread t([&] {
    r = rig_->Run(
        Request(2),
        [&](Relay& relay) {
          absl::MutexLock lock(&mu);
          queued = &relay;
        },
        [&] {
          absl::MutexLock lock(&mu);
          queued = nullptr;
        });
  });
  Until([&] { return rig_->queue->Stats().waiting == 1; });
  {
    absl::MutexLock lock(&mu);
    queued->Cancel();
  }
  t.join();
  EXPECT_TRUE(absl::IsCancelled(r.status)) << r.status;
  EXPECT_EQ(rig_->workers.at("p0").prefills.size(), 1u);
  EXPECT_EQ(rig_->workers.at("d0").decodes.size(), 1u);
  *permits_ = 1 << 20;
  holder.join();
}

}  // namespace
}  // namespace pdserve::router::testing
