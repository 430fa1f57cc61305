// The prefill side of the KV handoff: reserve blocks on a decode worker,
// stream each layer's KV into them as soon as it is computed, then commit.
//
//   auto h = sender->Reserve(conn, {.num_positions = n, .prompt_tokens = ids});
//   for each layer l (as the forward finishes it): h->SendLayer(l, table);
//   h->Commit(state);          // flush, then the commit message, then its answer
//
// SendLayer only issues the writes (the forward goes on computing); their
// completion is collected by Commit, which flushes and is answered only
// after the data is visible at the receiver. Positions below
// held_positions() (a prefix the receiver already holds) are not sent.
// Different block sizes: the layer is packed into the receiver's layout in
// a registered staging buffer on the caller's thread, then written
// (layout_copy.h); same block size: blocks are written in place from the
// pool (no copy).
//
// The lease: renewed on the transport's loop every third of it from the
// reservation until the first layer is sent (KeepLeased), then by the
// layers' writes.
//
// Errors: a dead receiver fails pending calls and the next SendLayer with
// UNAVAILABLE; a receiver that aborted (lease expired) makes them return
// ABORTED, and the sender acknowledges the abort once its outstanding
// writes are flushed; an answer that does not come within `timeout` is
// DEADLINE_EXCEEDED.
//
// Thread safety: KvSender methods from any thread; one Handoff is driven
// by one thread at a time. The caller keeps the source blocks unchanged
// and held until Commit or Abort returns. Destroy handoffs, then the
// sender, then the transport.
#ifndef PDSERVE_KV_TRANSFER_SENDER_H_
#define PDSERVE_KV_TRANSFER_SENDER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv/kv_cache.h"
#include "kernels/backend.h"
#include "kv_transfer/descriptor.h"
#include "kv_transfer/metrics.h"
#include "kv_transfer/transport.h"
#include "kv_transfer/wire.h"

namespace pdserve::kv {

struct SenderOptions {
  ModelIdentity model;
  absl::Duration timeout = absl::Seconds(10);
  // Set when the pool is in this backend's memory and not host-addressable
  // (a GPU's): each layer's blocks are copied through it into host memory
  // and packed into the registered staging region before they are put
  // (the transport cannot read device memory). Its copies must see the
  // layer written: SendLayer is called after the forward synchronised.
  kernels::Backend* pool_backend = nullptr;
  // Fault tests only: a commit's checksums (when its receiver asked for
  // them) are wrong by one bit, as if the bytes changed on the way.
  bool fault_wrong_checksums = false;
};

struct ReserveArgs {
  int32_t num_positions = 0;     // Positions whose KV is sent (the prompt).
  int32_t margin_positions = 0;  // Extra room for decode.
  std::vector<int32_t> prompt_tokens = {};  // For the receiver's prefix lookup.
  std::string grant = {};  // The router's grant for this attempt (grant.h), passed on as it came.
  CacheSalt cache_salt = {};  // The request's prefix-cache salt (kv/block_hash.h).
};

class KvSender;

class Handoff {
 public:
  ~Handoff();  // Aborts a handoff neither committed nor aborted.
  HandoffId id() const;
  int32_t held_positions() const;
  const KvLayoutDescriptor& receiver_layout() const;
  const std::vector<int32_t>& receiver_blocks() const;

  // Issues the writes of `layer` for positions [held_positions, n) from
  // the sender's blocks `table` (n = the reserved num_positions).
  absl::Status SendLayer(int32_t layer, absl::Span<const int32_t> table);
  // Waits for the writes, flushes, commits; OK once the receiver accepted.
  absl::Status Commit(kv::Commit state);
  // Stops, flushes and tells the receiver to free the blocks.
  absl::Status Abort(absl::Status why);

 private:
  friend class KvSender;
  struct State;
  Handoff(KvSender* sender, std::shared_ptr<State> state) : sender_(sender), state_(std::move(state)) {}
  KvSender* sender_;
  std::shared_ptr<State> state_;
};

class KvSender final : public ConnectionHandler {
 public:
  // Reads the blocks it sends from `storage` (their holder keeps them until
  // the handoff ends); it never allocates or frees a block.
  // REQUIRES: the region was allocated from transport->region_allocator().
  KvSender(Transport* transport, const KvStorage& storage, SenderOptions options);
  ~KvSender() override;

  absl::StatusOr<Connection*> Connect(const std::string& host, int port);
  // Whether `conn` can still carry a reservation: not failed, and not
  // closed by its receiver (a receiver that goes away gracefully says Bye:
  // its connection ends without failing, and a message sent on it then
  // would never be answered).
  bool Usable(const Connection* conn) const;
  absl::StatusOr<std::unique_ptr<Handoff>> Reserve(Connection* conn, ReserveArgs args);
  KvTransferStats metrics() const { return metrics_.Snapshot(); }
  // `fn` runs on the transport's loop thread when a receiver that refused
  // a reservation of ours for lack of room has freed KV since (RoomFreed),
  // and when a connection fails (a wait for its room is over either way).
  // Null: none. Returns once no call of the previous one is running.
  void SetRoomListener(std::function<void(Connection&)> fn);

  void OnMessage(Connection& c, std::string message) override;
  void OnDisconnected(Connection& c, absl::Status why) override;

 private:
  friend class Handoff;
  struct PendingReserve;
  void Fail(const std::shared_ptr<Handoff::State>& st, absl::Status why);
  // Loop thread: renews the handoff's lease every third of it until the
  // first layer is sent, so a reservation made ahead of the forward (the
  // request queued behind others' compute, a prompt of many chunks)
  // outlives that wait while this side lives and means to send. Once
  // layers go, their writes renew it, and a sender stuck in them lets it
  // lapse. A receiver still bounds it by the grant's expiry, and this
  // side's bound on a request's life ends the handoff.
  void KeepLeased(const std::shared_ptr<Handoff::State>& st);

  Transport* transport_;
  const KvStorage storage_;
  SenderOptions options_;
  KvLayoutDescriptor layout_;
  KvTransferMetrics metrics_;
  absl::Mutex room_mu_;
  std::function<void(Connection&)> room_listener_ ABSL_GUARDED_BY(room_mu_);
  mutable absl::Mutex closed_mu_;
  absl::flat_hash_set<const Connection*> closed_ ABSL_GUARDED_BY(closed_mu_);  // Ended, either way.
  void RoomFor(Connection& c);
  // Loop thread only.
  uint64_t next_tag_ = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<PendingReserve>> reserves_;
  absl::flat_hash_map<std::pair<Connection*, uint64_t>, std::shared_ptr<Handoff::State>> handoffs_;
  absl::flat_hash_map<std::pair<Connection*, std::string>, std::shared_ptr<RemoteRegion>> remotes_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // False once destroyed (loop thread).
};

// One sender's connections, kept per receiver address ("host:port"), and
// a reservation that connects again once when a kept connection's receiver
// went away (and perhaps came back at the same address: the first use of
// the old connection fails). Not thread-safe: one caller at a time.
class ReceiverConnections {
 public:
  explicit ReceiverConnections(KvSender* sender) : sender_(sender) {}
  // The kept live connection to `address`, or a new one. INVALID_ARGUMENT
  // when `address` is not host:port; the connection's own errors.
  absl::StatusOr<Connection*> Get(const std::string& address);
  // KvSender::Reserve on `address`'s receiver, connecting again once when
  // a kept connection fails UNAVAILABLE for any reason but a draining
  // receiver.
  absl::StatusOr<std::unique_ptr<Handoff>> Reserve(const std::string& address, const ReserveArgs& args);
  // The kept connection to `address` (null: none); never connects.
  const Connection* Find(const std::string& address) const;

 private:
  KvSender* const sender_;
  absl::flat_hash_map<std::string, Connection*> connections_;
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_SENDER_H_
