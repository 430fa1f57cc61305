#include "kv_transfer/sender.h"

#include <future>
#include <numeric>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kv/kv_checksum.h"
#include "kv_transfer/layout_copy.h"

namespace pdserve::kv {

// Loop-thread state of one handoff; `mu` guards what callers read.
struct Handoff::State {
  Connection* conn = nullptr;
  HandoffId id;
  KvLayoutDescriptor receiver;
  KvCacheSpec dst_spec;  // The receiver's pool.
  std::vector<int32_t> dst_table;
  int32_t held_positions = 0;
  int32_t num_positions = 0;
  std::shared_ptr<RemoteRegion> remote;
  std::unique_ptr<KvRegion> staging;  // Receiver-layout packing, when layouts differ or the pool is a device's.
  int64_t packed_layer_bytes = 0;
  // A device pool: one layer of the request's blocks copied to the host,
  // as a pool of their own (mirror_spec: one layer, block i = the
  // request's i-th block), packed from there. Compute thread only.
  KvCacheSpec mirror_spec;
  std::vector<char> mirror;
  std::vector<int32_t> mirror_table;  // 0, 1, ...: the mirror's blocks in the request's order.
  absl::Time start;
  absl::Duration lease;
  // The receiver verifies this handoff: each layer's LayerChecksum
  // (kv/kv_checksum.h) of what SendLayer wrote, for the commit. Compute
  // thread only.
  bool verify = false;
  std::vector<uint64_t> layer_checksums;
  // Loop thread only.
  absl::Time last_renewal;
  bool sending = false;  // A layer's writes were issued (they renew the lease from then on).
  std::shared_ptr<std::promise<absl::Status>> commit_done, abort_done;
  bool finished = false;  // Committed or aborted (by either side).

  absl::Mutex mu;
  absl::Status error ABSL_GUARDED_BY(mu);
  absl::Status Error() {
    absl::MutexLock lock(&mu);
    return error;
  }
  void SetError(absl::Status s) {
    absl::MutexLock lock(&mu);
    if (error.ok()) error = std::move(s);
  }
};

struct KvSender::PendingReserve {
  Connection* conn = nullptr;
  std::promise<absl::StatusOr<ReserveReply>> reply;
};

namespace {

void Resolve(std::shared_ptr<std::promise<absl::Status>>& p, absl::Status s) {
  if (p == nullptr) return;
  p->set_value(std::move(s));
  p.reset();
}

// Runs `then` once every Put issued so far on `conn` will have landed before
// the peer handles a message sent next: at once on a connection that keeps
// that order itself, else after a Flush (a round trip).
void AfterPuts(Connection* conn, DoneCallback then) {
  if (conn->MessagesFollowPuts()) return then(absl::OkStatus());
  conn->Flush(std::move(then));
}

// A receiver that did not answer in time is treated as gone: its
// connection is failed, so the writes still outstanding on it end (instead
// of keeping the loop polling) and the next handoff to it reconnects.
void FailSilent(Transport* transport, Connection* conn, const absl::Status& why) {
  transport->loop().Post([conn, why] { conn->Fail(why); });
}

template <typename T>
absl::StatusOr<T> Wait(std::future<T>& f, absl::Duration timeout, absl::string_view what, const Connection& conn) {
  if (f.wait_for(absl::ToChronoNanoseconds(timeout)) != std::future_status::ready) {
    return absl::DeadlineExceededError(absl::StrCat("KV handoff: receiver ", conn.name(), " gave no answer to ", what,
                                                    " within ", absl::FormatDuration(timeout)));
  }
  return f.get();
}

}  // namespace

KvSender::KvSender(Transport* transport, const KvStorage& storage, SenderOptions options)
    : transport_(transport),
      storage_(storage),
      options_(std::move(options)),
      layout_(KvLayoutDescriptor::FromSpec(storage.spec, options_.model)) {}

KvSender::~KvSender() {
  transport_->Detach(this);
  transport_->loop().RunSync([this] {
    *alive_ = false;  // Renewals still queued on the loop do nothing.
    for (auto& [tag, r] : reserves_) r->reply.set_value(absl::CancelledError("KV sender shut down"));
    reserves_.clear();
    for (auto& [key, st] : handoffs_) {
      Resolve(st->commit_done, absl::CancelledError("KV sender shut down"));
      Resolve(st->abort_done, absl::CancelledError("KV sender shut down"));
    }
    handoffs_.clear();
    remotes_.clear();
  });
}

absl::StatusOr<Connection*> KvSender::Connect(const std::string& host, int port) {
  absl::StatusOr<Connection*> c = transport_->Connect(host, port, this);
  if (c.ok()) {
    // A new connection may take the address of one that ended.
    absl::MutexLock lock(&closed_mu_);
    closed_.erase(*c);
  }
  return c;
}

bool KvSender::Usable(const Connection* conn) const {
  if (conn->failed()) return false;
  absl::MutexLock lock(&closed_mu_);
  return !closed_.contains(conn);
}

absl::StatusOr<std::unique_ptr<Handoff>> KvSender::Reserve(Connection* conn, ReserveArgs args) {
  auto pending = std::make_shared<PendingReserve>();
  pending->conn = conn;
  auto future = pending->reply.get_future();
  ReserveRequest req;
  req.sender = layout_;
  req.num_positions = args.num_positions;
  req.margin_positions = args.margin_positions;
  req.prompt_tokens = std::move(args.prompt_tokens);
  req.grant = std::move(args.grant);
  req.cache_salt = args.cache_salt;
  const absl::Time start = absl::Now();
  transport_->loop().Post([this, conn, pending, req = std::move(req)]() mutable {
    if (!Usable(conn)) {
      pending->reply.set_value(absl::UnavailableError(absl::StrCat("KV handoff: ", conn->name(), " is down")));
      return;
    }
    req.tag = next_tag_++;
    reserves_[req.tag] = pending;
    conn->Send(Encode(req));
  });
  // The loop polls instead of sleeping while the answer is due: over
  // loopback the answer comes back faster than two wake-ups.
  transport_->loop().AddBusy(1);
  absl::StatusOr<absl::StatusOr<ReserveReply>> waited = Wait(future, options_.timeout, "reserve", *conn);
  transport_->loop().AddBusy(-1);
  if (!waited.ok()) {
    FailSilent(transport_, conn, waited.status());
    return waited.status();
  }
  if (!waited->ok()) return waited->status();
  ReserveReply& reply = **waited;
  if (reply.code != 0) {
    // A pool momentarily full is waited out by the caller, not a failure of
    // the handoff; every other refusal is.
    if (reply.code != static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) metrics_.RecordFailure();
    return StatusFromWire(reply.code, reply.message);
  }
  auto st = std::make_shared<Handoff::State>();
  st->conn = conn;
  st->id = reply.id;
  st->receiver = reply.receiver;
  st->dst_spec = reply.receiver.ToSpec(reply.num_blocks);
  st->dst_table = std::move(reply.blocks);
  st->held_positions = reply.held_positions;
  st->verify = reply.verify != 0;
  if (st->verify) st->layer_checksums.assign(static_cast<size_t>(storage_.spec.num_layers), 0);
  st->num_positions = args.num_positions;
  st->start = start;
  st->lease = absl::Milliseconds(reply.lease_ms);
  st->last_renewal = start;
  absl::Status setup = CheckCompatible(layout_, reply.receiver);
  if (setup.ok() && (st->dst_spec.Validate().ok() == false ||
                     static_cast<int64_t>(st->dst_table.size()) * st->dst_spec.block_size < args.num_positions ||
                     st->held_positions % st->dst_spec.block_size != 0)) {
    setup = absl::InternalError("KV handoff: the receiver's reservation does not cover the request");
  }
  if (setup.ok() && (!SameBlockLayout(st->receiver, layout_) || options_.pool_backend != nullptr)) {
    st->packed_layer_bytes = PackedLayerBytes(st->dst_spec, st->held_positions, st->num_positions);
    absl::StatusOr<std::unique_ptr<KvRegion>> staging =
        transport_->region_allocator().Allocate(st->packed_layer_bytes * layout_.num_layers);
    if (staging.ok()) {
      st->staging = *std::move(staging);
    } else {
      setup = staging.status();
    }
  }
  if (setup.ok()) {
    setup = transport_->loop().RunSync([&]() -> absl::Status {
      // One import per receiver region: unpacking an rkey can map the
      // peer's segment, which costs page faults over the whole pool.
      auto& cached = remotes_[{conn, reply.region}];
      if (cached == nullptr) {
        absl::StatusOr<std::shared_ptr<RemoteRegion>> remote = conn->ImportRegion(reply.region);
        if (!remote.ok()) return remote.status();
        cached = *std::move(remote);
      }
      st->remote = cached;
      handoffs_[{conn, st->id.value}] = st;
      // The receiver's pages this handoff will write, readied while the
      // prompt's forward runs (where the transport writes through a
      // mapping of its own: Connection::PrepareWrites). Whole blocks of
      // the reservation: PlanPacked's destinations, every layer.
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (int32_t l = 0; l < layout_.num_layers; ++l) {
        for (const CopyRun& r : PlanPacked(st->dst_spec, st->dst_table, l, st->held_positions, st->num_positions, 0)) {
          if (!ranges.empty() && ranges.back().first + ranges.back().second == r.dst_offset) {
            ranges.back().second += r.bytes;
          } else {
            ranges.push_back({r.dst_offset, r.bytes});
          }
        }
      }
      conn->PrepareWrites(st->remote, ranges);
      KeepLeased(st);
      return absl::OkStatus();
    });
  }
  std::unique_ptr<Handoff> h(new Handoff(this, st));
  if (!setup.ok()) {
    (void)h->Abort(setup);
    return setup;
  }
  return h;
}

void KvSender::KeepLeased(const std::shared_ptr<Handoff::State>& st) {
  if (st->lease <= absl::ZeroDuration()) return;
  // Weak: a renewal still queued must not keep the handoff's state (its
  // staging region, the peer's imported region) past the handoff's end.
  transport_->loop().PostAt(absl::Now() + st->lease / 3, [this, alive = alive_, weak = std::weak_ptr(st)] {
    const std::shared_ptr<Handoff::State> st = weak.lock();
    if (st == nullptr || !*alive || st->sending || st->finished || !st->Error().ok() || st->conn->failed()) return;
    if (const absl::Time now = absl::Now(); now - st->last_renewal >= st->lease / 4) {
      st->last_renewal = now;
      st->conn->Send(Encode(LayerSent{st->id, -1}));
    }
    KeepLeased(st);
  });
}

void KvSender::Fail(const std::shared_ptr<Handoff::State>& st, absl::Status why) {
  st->SetError(why);
  Resolve(st->commit_done, why);
  Resolve(st->abort_done, absl::OkStatus());  // Nothing left to free over a dead link.
}

void KvSender::SetRoomListener(std::function<void(Connection&)> fn) {
  absl::MutexLock lock(&room_mu_);
  room_listener_ = std::move(fn);
}

void KvSender::RoomFor(Connection& c) {
  absl::MutexLock lock(&room_mu_);
  if (room_listener_) room_listener_(c);
}

void KvSender::OnMessage(Connection& c, std::string message) {
  absl::StatusOr<Message> m = Decode(message);
  if (!m.ok()) return;
  if (std::holds_alternative<RoomFreed>(*m)) return RoomFor(c);
  if (auto* r = std::get_if<ReserveReply>(&*m)) {
    auto it = reserves_.find(r->tag);
    if (it == reserves_.end()) return;
    it->second->reply.set_value(std::move(*r));
    reserves_.erase(it);
    return;
  }
  HandoffId id;
  std::visit([&](const auto& msg) {
    if constexpr (requires { msg.id; }) id = msg.id;
  }, *m);
  auto it = handoffs_.find({&c, id.value});
  if (it == handoffs_.end()) {
    if (std::holds_alternative<Abort>(*m)) c.Send(Encode(AbortAck{id}));
    return;
  }
  std::shared_ptr<Handoff::State> st = it->second;
  if (auto* cr = std::get_if<CommitReply>(&*m)) {
    st->finished = true;
    handoffs_.erase(it);
    absl::Status s = StatusFromWire(cr->code, cr->message);
    if (s.ok()) {
      metrics_.RecordTransfer(absl::Now() - st->start);
    } else {
      metrics_.RecordFailure();
      st->SetError(s);
    }
    Resolve(st->commit_done, s);
  } else if (auto* a = std::get_if<Abort>(&*m)) {
    // The receiver gave up (lease expired): stop, flush, acknowledge.
    metrics_.RecordAbort();
    if (a->code == static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded)) metrics_.RecordLeaseExpired();
    st->SetError(absl::AbortedError(absl::StrCat("KV handoff ", id.value, " aborted by ", c.name(), ": ", a->message)));
    st->finished = true;
    AfterPuts(st->conn, [this, st, id](absl::Status) {
      st->conn->Send(Encode(AbortAck{id}));
      handoffs_.erase({st->conn, id.value});
      Resolve(st->commit_done, st->Error());
      Resolve(st->abort_done, absl::OkStatus());
    });
  } else if (std::holds_alternative<AbortAck>(*m)) {
    handoffs_.erase(it);
    Resolve(st->abort_done, absl::OkStatus());
  }
}

void KvSender::OnDisconnected(Connection& c, absl::Status why) {
  {
    absl::MutexLock lock(&closed_mu_);
    closed_.insert(&c);
  }
  const absl::Status gone = absl::UnavailableError(
      absl::StrCat("KV handoff: receiver ", c.name(), " is gone", why.ok() ? "" : ": ", why.message()));
  for (auto it = reserves_.begin(); it != reserves_.end();) {
    auto cur = it++;
    if (cur->second->conn == &c) {
      cur->second->reply.set_value(gone);
      reserves_.erase(cur);
    }
  }
  for (auto it = remotes_.begin(); it != remotes_.end();) {
    auto cur = it++;
    if (cur->first.first == &c) remotes_.erase(cur);
  }
  for (auto it = handoffs_.begin(); it != handoffs_.end();) {
    auto cur = it++;
    if (cur->first.first != &c) continue;
    std::shared_ptr<Handoff::State> st = cur->second;
    handoffs_.erase(cur);
    if (!st->finished) metrics_.RecordFailure();
    Fail(st, gone);
  }
  RoomFor(c);
}

Handoff::~Handoff() {
  bool finished = sender_->transport_->loop().RunSync([st = state_] { return st->finished; });
  if (!finished) (void)Abort(absl::CancelledError("KV handoff dropped before commit"));
}

HandoffId Handoff::id() const { return state_->id; }
int32_t Handoff::held_positions() const { return state_->held_positions; }
const KvLayoutDescriptor& Handoff::receiver_layout() const { return state_->receiver; }
const std::vector<int32_t>& Handoff::receiver_blocks() const { return state_->dst_table; }

absl::Status Handoff::SendLayer(int32_t layer, absl::Span<const int32_t> table) {
  if (absl::Status s = state_->Error(); !s.ok()) return s;
  State& st = *state_;
  const KvCacheSpec& src = sender_->storage_.spec;
  if (layer < 0 || layer >= src.num_layers ||
      static_cast<int64_t>(table.size()) * src.block_size < st.num_positions) {
    return absl::InvalidArgumentError(absl::StrCat("KV handoff: layer ", layer, " or a table of ",
                                                   table.size(), " blocks does not fit the request"));
  }
  std::vector<CopyRun> runs;
  const char* local_base;
  if (st.staging != nullptr && sender_->options_.pool_backend != nullptr) {
    // The request's blocks of this layer, every rank, through the backend.
    if (st.mirror.empty()) {
      st.mirror_spec = src;
      st.mirror_spec.num_layers = 1;
      st.mirror_spec.num_blocks = static_cast<int32_t>(table.size());
      st.mirror.resize(static_cast<size_t>(st.mirror_spec.TotalBytes()));
      st.mirror_table.resize(table.size());
      std::iota(st.mirror_table.begin(), st.mirror_table.end(), 0);
    }
    if (static_cast<int64_t>(table.size()) > st.mirror_spec.num_blocks) {
      return absl::InvalidArgumentError("KV handoff: the block table grew between layers");
    }
    const int64_t block_bytes = src.LayerBlockBytes();
    // Blocks holding positions [held_positions, num_positions) (from the
    // start of the receiver block the packing begins with).
    const int32_t first = (st.held_positions / st.dst_spec.block_size * st.dst_spec.block_size) / src.block_size;
    const int32_t last = (st.num_positions - 1) / src.block_size;
    for (int32_t i = first; i <= last; ++i) {
      for (int32_t r = 0; r < src.num_ranks; ++r) {
        sender_->options_.pool_backend->CopyToHost(st.mirror.data() + LayerBlockOffset(st.mirror_spec, 0, i, r),
                                                   sender_->storage_.base + LayerBlockOffset(src, layer, table[i], r),
                                                   block_bytes);
      }
    }
    if (absl::Status s = sender_->options_.pool_backend->status(); !s.ok()) return s;
    const int64_t at = st.packed_layer_bytes * layer;
    char* staging = static_cast<char*>(st.staging->data());
    PackLayer(st.mirror_spec, st.mirror.data(), st.mirror_table, st.dst_spec, 0, st.held_positions,
              st.num_positions, staging + at);
    runs = PlanPacked(st.dst_spec, st.dst_table, layer, st.held_positions, st.num_positions, at);
    local_base = staging;
    if (st.verify) st.layer_checksums[layer] = BytesChecksum(staging + at, st.packed_layer_bytes);
  } else if (st.staging != nullptr) {
    const int64_t at = st.packed_layer_bytes * layer;
    char* staging = static_cast<char*>(st.staging->data());
    PackLayer(src, sender_->storage_.base, table, st.dst_spec, layer,
              st.held_positions, st.num_positions, staging + at);
    runs = PlanPacked(st.dst_spec, st.dst_table, layer, st.held_positions, st.num_positions, at);
    local_base = staging;
    // The packed layer is the receiver's blocks, rank after rank.
    if (st.verify) st.layer_checksums[layer] = BytesChecksum(staging + at, st.packed_layer_bytes);
  } else {
    runs = PlanSameLayout(src, table, st.dst_spec, st.dst_table, layer, st.held_positions, st.num_positions);
    local_base = sender_->storage_.base;
    // Same layout: the sender's blocks hold the receiver's bytes.
    if (st.verify) {
      st.layer_checksums[layer] = LayerChecksum(sender_->storage_, layer, table, st.held_positions / src.block_size,
                                                (st.num_positions + src.block_size - 1) / src.block_size);
    }
  }
  KvSender* sender = sender_;
  sender->transport_->loop().Post([sender, st = state_, runs = std::move(runs), local_base, layer] {
    if (st->finished || !st->Error().ok()) return;
    st->sending = true;
    // No completion per put: the flush before commit (or abort ack)
    // covers them all, and a dead receiver shows on the connection.
    for (const CopyRun& r : runs) {
      st->conn->Put(local_base + r.src_offset, r.bytes, *st->remote, r.dst_offset, nullptr);
      sender->metrics_.AddBytes(r.bytes);
    }
    // Renew the lease when a quarter of it has passed (not per layer: each
    // message costs the control channel a send).
    if (const absl::Time now = absl::Now(); now - st->last_renewal > st->lease / 4) {
      st->last_renewal = now;
      st->conn->Send(Encode(LayerSent{st->id, layer}));
    }
  });
  return absl::OkStatus();
}

absl::Status Handoff::Commit(kv::Commit state) {
  auto done = std::make_shared<std::promise<absl::Status>>();
  auto future = done->get_future();
  state.id = state_->id;
  if (state_->verify) {
    state.layer_checksums = state_->layer_checksums;
    if (sender_->options_.fault_wrong_checksums && !state.layer_checksums.empty()) state.layer_checksums[0] ^= 1;
  }
  KvSender* sender = sender_;
  sender->transport_->loop().Post([sender, st = state_, done, state = std::move(state)]() mutable {
    if (absl::Status e = st->Error(); !e.ok() || st->finished) {
      done->set_value(e.ok() ? absl::FailedPreconditionError("KV handoff already finished") : e);
      return;
    }
    st->commit_done = done;
    AfterPuts(st->conn, [st, state = std::move(state)](absl::Status s) mutable {
      if (!s.ok()) {
        st->SetError(absl::UnavailableError(absl::StrCat("KV handoff: flush failed: ", s.message())));
        return Resolve(st->commit_done, st->Error());
      }
      if (st->commit_done == nullptr) return;  // Failed or aborted meanwhile.
      st->conn->Send(Encode(state));
    });
  });
  sender->transport_->loop().AddBusy(1);
  absl::StatusOr<absl::Status> waited = Wait(future, sender->options_.timeout, "commit", *state_->conn);
  sender->transport_->loop().AddBusy(-1);
  if (!waited.ok()) FailSilent(sender->transport_, state_->conn, waited.status());
  return waited.ok() ? *waited : waited.status();
}

absl::Status Handoff::Abort(absl::Status why) {
  auto done = std::make_shared<std::promise<absl::Status>>();
  auto future = done->get_future();
  KvSender* sender = sender_;
  sender->transport_->loop().Post([sender, st = state_, done, why] {
    if (st->finished || st->conn->failed()) {
      st->finished = true;
      done->set_value(absl::OkStatus());
      return;
    }
    st->finished = true;
    st->SetError(absl::AbortedError(absl::StrCat("KV handoff aborted: ", why.message())));
    sender->metrics_.RecordAbort();
    sender->metrics_.RecordFailure();
    st->abort_done = done;
    AfterPuts(st->conn, [st, why](absl::Status) {
      st->conn->Send(Encode(kv::Abort{st->id, static_cast<int32_t>(why.code()), std::string(why.message())}));
    });
  });
  absl::StatusOr<absl::Status> waited = Wait(future, sender->options_.timeout, "abort", *state_->conn);
  if (!waited.ok()) FailSilent(sender->transport_, state_->conn, waited.status());
  return waited.ok() ? *waited : waited.status();
}

absl::StatusOr<Connection*> ReceiverConnections::Get(const std::string& address) {
  auto it = connections_.find(address);
  if (it != connections_.end() && sender_->Usable(it->second)) return it->second;
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(absl::StrCat("KV receiver address '", address, "' is not host:port"));
  }
  absl::StatusOr<Connection*> c = sender_->Connect(address.substr(0, colon), port);
  if (!c.ok()) return c.status();
  connections_[address] = *c;
  return *c;
}

absl::StatusOr<std::unique_ptr<Handoff>> ReceiverConnections::Reserve(const std::string& address,
                                                                      const ReserveArgs& args) {
  for (int attempt = 0;; ++attempt) {
    const bool kept = connections_.contains(address);
    absl::StatusOr<Connection*> conn = Get(address);
    if (!conn.ok()) return conn.status();
    absl::StatusOr<std::unique_ptr<Handoff>> h = sender_->Reserve(*conn, args);
    if (h.ok() || attempt > 0 || !kept || !absl::IsUnavailable(h.status()) ||
        absl::StrContains(h.status().message(), "draining")) {
      return h;
    }
    connections_.erase(address);
  }
}

const Connection* ReceiverConnections::Find(const std::string& address) const {
  auto it = connections_.find(address);
  return it != connections_.end() ? it->second : nullptr;
}

}  // namespace pdserve::kv
