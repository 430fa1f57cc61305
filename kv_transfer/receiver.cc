#include "kv_transfer/receiver.h"

#include <algorithm>
#include <utility>

#include <openssl/rand.h>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "kv/block_hash.h"

namespace pdserve::kv {

absl::StatusOr<std::unique_ptr<KvReceiver>> KvReceiver::Create(Transport* transport, KvManager* kv,
                                                                ReceiverOptions options,
                                                                CommittedCallback on_committed) {
  std::unique_ptr<KvManager> landing;
  std::unique_ptr<kernels::BackendUploader> uploader;
  if (options.pool_backend != nullptr) {
    if (kv->spec().request_ranks > 1 || options.landing_blocks < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "KV receiver: a device pool needs landing blocks (", options.landing_blocks,
          ") and a head-sharded layout"));
    }
    KvCacheSpec spec = kv->spec();
    spec.num_blocks = options.landing_blocks;
    absl::StatusOr<std::unique_ptr<KvManager>> m = KvManager::Create(spec, &transport->region_allocator());
    if (!m.ok()) return m.status();
    landing = *std::move(m);
    absl::StatusOr<std::unique_ptr<kernels::BackendUploader>> u = options.pool_backend->NewUploader();
    if (!u.ok()) return u.status();
    uploader = *std::move(u);
  }
  absl::StatusOr<std::string> region = transport->PackRegion(landing ? landing->region() : kv->region());
  if (!region.ok()) return region.status();
  std::unique_ptr<KvReceiver> r(new KvReceiver(transport, kv, std::move(options),
                                               std::move(on_committed), *std::move(region)));
  r->landing_ = std::move(landing);
  r->uploader_ = std::move(uploader);
  KvReceiver* self = r.get();
  r->free_listeners_[kPoolRoom] = kv->AddFreeListener([self] { self->Freed(kPoolRoom); });
  if (r->landing_ != nullptr) {
    r->free_listeners_[kLandingRoom] = r->landing_->AddFreeListener([self] { self->Freed(kLandingRoom); });
  }
  return r;
}

KvReceiver::KvReceiver(Transport* transport, KvManager* kv, ReceiverOptions options,
                       CommittedCallback on_committed, std::string region)
    : transport_(transport),
      kv_(kv),
      options_(std::move(options)),
      on_committed_(std::move(on_committed)),
      layout_(KvLayoutDescriptor::FromSpec(kv->spec(), options_.model)),
      region_(std::move(region)) {}

KvReceiver::~KvReceiver() {
  // Waits for a listener call in progress: none runs after this.
  if (free_listeners_[kPoolRoom] >= 0) kv_->RemoveFreeListener(free_listeners_[kPoolRoom]);
  if (free_listeners_[kLandingRoom] >= 0) landing_->RemoveFreeListener(free_listeners_[kLandingRoom]);
  transport_->Detach(this);
  transport_->loop().RunSync([this] {
    *alive_ = false;
    absl::MutexLock lock(&mu_);
    handoffs_.clear();  // Their blocks go back to the manager.
  });
}

absl::StatusOr<int> KvReceiver::Listen(const std::string& host, int port) {
  return transport_->Listen(host, port, this);
}

void KvReceiver::Freed(Room room) {
  frees_[room].fetch_add(1);
  // One post per round of waiters: WantRoom sets the flag again for the
  // next one.
  if (!room_wanted_[room].exchange(false)) return;
  std::weak_ptr<bool> alive = alive_;
  transport_->loop().Post([this, alive, room] {
    if (auto a = alive.lock(); a && *a) NotifyRoom(room);
  });
}

void KvReceiver::WantRoom(Connection& c, Room room, uint64_t frees_before) {
  {
    absl::MutexLock lock(&mu_);
    wants_room_[room].insert(&c);
  }
  room_wanted_[room].store(true);
  if (frees_[room].load() != frees_before) NotifyRoom(room);
}

void KvReceiver::NotifyRoom(Room room) {
  absl::flat_hash_set<Connection*> waiting;
  {
    absl::MutexLock lock(&mu_);
    waiting.swap(wants_room_[room]);
  }
  for (Connection* c : waiting) c->Send(Encode(RoomFreed{}));
}

void KvReceiver::Abort(HandoffId id, absl::Status why) {
  transport_->loop().Post([this, id, why] { Quarantine(id, why); });
}

void KvReceiver::CheckLeases() {
  transport_->loop().RunSync([this] { ExpireLeases(); });
}

KvReceiver::Stats KvReceiver::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  for (const auto& [id, h] : handoffs_) {
    if (h.state == State::kActive) {
      ++s.active;
    } else {
      ++s.quarantined;
      s.quarantined_blocks += static_cast<int32_t>(h.kv.block_table().size());
    }
  }
  if (landing_ != nullptr) s.landing_blocks_used = landing_->Counts().used;
  return s;
}

void KvReceiver::OnMessage(Connection& c, std::string message) {
  absl::StatusOr<Message> m = Decode(message);
  if (!m.ok()) return;  // A malformed message changes nothing; the lease bounds the damage.
  if (auto* r = std::get_if<ReserveRequest>(&*m)) {
    HandleReserve(c, *r);
  } else if (auto* l = std::get_if<LayerSent>(&*m)) {
    absl::MutexLock lock(&mu_);
    auto it = handoffs_.find(l->id);
    if (it != handoffs_.end() && it->second.state == State::kActive) {
      if (it->second.conn != &c) {
        Refused(GrantRefusal::kLeaseOtherConnection);
      } else {
        it->second.deadline = std::min(options_.clock() + options_.lease, it->second.grant_expires);
      }
    }
  } else if (auto* cm = std::get_if<Commit>(&*m)) {
    HandleCommit(c, *cm);
  } else if (auto* a = std::get_if<kv::Abort>(&*m)) {
    HandleAbort(c, *a);
  } else if (auto* ack = std::get_if<AbortAck>(&*m)) {
    bool quarantined = false;
    {
      absl::MutexLock lock(&mu_);
      auto it = handoffs_.find(ack->id);
      quarantined = it != handoffs_.end() && it->second.state == State::kQuarantined && it->second.conn == &c;
    }
    if (quarantined) Free(ack->id);
  }
}

void KvReceiver::SetAddress(std::string address) {
  absl::MutexLock lock(&mu_);
  address_ = std::move(address);
}

absl::StatusOr<Grant> KvReceiver::CheckGrant(Connection& c, const ReserveRequest& m) {
  if (m.grant.empty()) {
    Refused(GrantRefusal::kMissing);
    return absl::PermissionDeniedError("KV handoff: reservation refused: no grant (the router's grant for this "
                                       "attempt must come with it)");
  }
  absl::StatusOr<Grant> g = DecodeGrant(m.grant);
  if (!g.ok()) {
    Refused(GrantRefusal::kMalformed);
    return absl::PermissionDeniedError(absl::StrCat("KV handoff: reservation refused: ", g.status().message()));
  }
  std::string address;
  {
    absl::MutexLock lock(&mu_);
    address = address_;
  }
  const absl::Time now = options_.clock();
  GrantRefusal why = GrantRefusal::kNone;
  if (absl::Status s = VerifyGrant(*options_.grant_key, *g, address, now, &why); !s.ok()) {
    Refused(why);
    return absl::PermissionDeniedError(absl::StrCat("KV handoff: reservation refused: ", s.message()));
  }
  if (!SenderMatches(g->sender, c.peer_host())) {
    Refused(GrantRefusal::kWrongSender);
    return absl::PermissionDeniedError(absl::StrCat("KV handoff: reservation refused: the grant is for sender ",
                                                    g->sender, ", the connection comes from ", c.peer_host()));
  }
  const int64_t total = static_cast<int64_t>(m.num_positions) + m.margin_positions;
  if (total > g->positions) {
    Refused(GrantRefusal::kTooManyPositions);
    return absl::PermissionDeniedError(absl::StrCat("KV handoff: reservation refused: ", total,
                                                    " positions asked, the grant for request ", g->request_id,
                                                    " allows ", g->positions));
  }
  if (static_cast<int64_t>(m.prompt_tokens.size()) != m.num_positions ||
      DigestTokens(m.prompt_tokens, m.cache_salt) != g->tokens_digest) {
    Refused(GrantRefusal::kTokensMismatch);
    return absl::PermissionDeniedError(absl::StrCat("KV handoff: reservation refused: its ", m.prompt_tokens.size(),
                                                    " token ids are not the context the grant for request ",
                                                    g->request_id, " names"));
  }
  absl::MutexLock lock(&mu_);
  // Forget grants past their expiry (they cannot verify again anyway),
  // at most once a second.
  const int64_t now_ms = absl::ToUnixMillis(now);
  if (now_ms >= next_grant_prune_ms_) {
    absl::erase_if(used_grants_, [now_ms](const auto& e) { return e.second <= now_ms; });
    next_grant_prune_ms_ = now_ms + 1000;
  }
  if (!used_grants_.emplace(std::make_pair(g->request_id, g->attempt), g->expires_unix_ms).second) {
    Refused(GrantRefusal::kReused);
    return absl::PermissionDeniedError(absl::StrCat("KV handoff: reservation refused: the grant for request ",
                                                    g->request_id, " attempt ", g->attempt, " was used before"));
  }
  return *std::move(g);
}

namespace {

// A handoff id no peer can guess: 64 bits from the system's CSPRNG.
HandoffId RandomHandoffId() {
  uint64_t v = 0;
  while (v == 0) {
    if (RAND_bytes(reinterpret_cast<unsigned char*>(&v), sizeof(v)) != 1) v = absl::Uniform<uint64_t>(absl::BitGen());
  }
  return HandoffId{v};
}

}  // namespace

void KvReceiver::HandleReserve(Connection& c, const ReserveRequest& m) {
  ReserveReply reply;
  reply.tag = m.tag;
  reply.receiver = layout_;
  auto refuse = [&](const absl::Status& s) {
    reply.code = static_cast<int32_t>(s.code());
    reply.message = std::string(s.message());
    c.Send(Encode(reply));
  };
  if (!accepting_.load()) {
    return refuse(absl::UnavailableError("KV handoff: reservation refused: the decode worker is draining"));
  }
  std::optional<Grant> grant;
  if (options_.grant_key != nullptr) {
    absl::StatusOr<Grant> granted = CheckGrant(c, m);
    if (!granted.ok()) return refuse(granted.status());
    grant = *std::move(granted);
  }
  if (absl::Status s = CheckCompatible(m.sender, layout_); !s.ok()) return refuse(s);
  if (m.num_positions <= 0 || m.margin_positions < 0 ||
      static_cast<int32_t>(m.prompt_tokens.size()) > m.num_positions) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "KV handoff: bad reservation (", m.num_positions, " positions, margin ", m.margin_positions,
        ", ", m.prompt_tokens.size(), " prompt tokens)")));
  }
  const int32_t bs = layout_.block_size;
  const int64_t total_positions = static_cast<int64_t>(m.num_positions) + m.margin_positions;
  const int64_t need = (total_positions + bs - 1) / bs;
  // A grant is spent by the reservation it buys. A reservation refused for
  // room bought nothing: its sender may ask again with the same grant once
  // room frees (the prefill worker waits for room rather than fail).
  auto unspend_grant = [&] {
    if (!grant.has_value()) return;
    absl::MutexLock lock(&mu_);
    used_grants_.erase(std::make_pair(grant->request_id, grant->attempt));
  };
  // One that could never fit is refused as such: waiting would not help.
  if (const int64_t pool = kv_->Counts().total; need > pool) {
    metrics_.RecordFailure();
    unspend_grant();
    return refuse(absl::OutOfRangeError(absl::StrCat("KV handoff: reservation of ", need, " blocks (",
                                                     total_positions, " positions) can never fit: the pool holds ",
                                                     pool, " blocks")));
  }
  // Full prompt blocks only; the last position is always sent so that
  // the sender never skips a partial block.
  const BlockHasher hasher(layout_.model, layout_.dtype, bs);
  const int32_t hashable = std::min<int32_t>(static_cast<int32_t>(m.prompt_tokens.size()), m.num_positions - 1);
  const std::vector<BlockHash> hashes =
      hasher.FullBlockHashes(absl::MakeConstSpan(m.prompt_tokens).subspan(0, std::max(0, hashable)), m.cache_salt);
  // The manager's lock covers this bookkeeping only: a reservation never
  // waits for a forward.
  // A request-sharded pool: the request lives on the rank with the most room.
  const uint64_t pool_frees = frees_[kPoolRoom].load();
  absl::StatusOr<SequenceKv> reserved =
      kv_->Reserve(hashes, static_cast<int32_t>(need * bs), kv_->PickRank());
  if (!reserved.ok()) {
    unspend_grant();
    refuse(absl::ResourceExhaustedError(absl::StrCat("KV handoff: reservation of ", need, " blocks (",
                                                     total_positions, " positions) refused: ",
                                                     reserved.status().message())));
    return WantRoom(c, kPoolRoom, pool_frees);
  }
  std::vector<int32_t> blocks = reserved->block_table();
  reply.held_positions = reserved->num_positions();
  SequenceKv landing;
  if (landing_ != nullptr) {
    // The sender writes into landing blocks, one per pool block (those of
    // held positions stay unwritten).
    landing = landing_->NewSequence();
    const uint64_t landing_frees = frees_[kLandingRoom].load();
    if (absl::Status s = landing_->Grow(landing, static_cast<int32_t>(need * bs)); !s.ok()) {
      // The pool blocks go back before the sender hears of the refusal: a
      // sender that retries (or a test that counts) must find them free.
      reserved->Release();
      landing.Release();
      unspend_grant();
      refuse(absl::ResourceExhaustedError(absl::StrCat(
          "KV handoff: reservation of ", need, " landing blocks refused (handoffs into GPU memory land in ",
          landing_->spec().num_blocks, " host blocks): ", s.message())));
      return WantRoom(c, kLandingRoom, landing_frees);
    }
    blocks = landing.block_table();
  }
  Handoff h;
  h.landing = std::move(landing);
  h.conn = &c;
  h.kv = *std::move(reserved);
  h.held_positions = reply.held_positions;
  h.reserved_positions = static_cast<int32_t>(total_positions);
  h.start = options_.clock();
  h.cache_salt = m.cache_salt;
  h.verify = landing_ == nullptr && options_.verify_fraction > 0 &&
             (options_.verify_fraction >= 1 || absl::Bernoulli(bitgen_, options_.verify_fraction));
  reply.verify = h.verify ? 1 : 0;
  if (grant.has_value()) {
    h.request_id = std::move(grant->request_id);
    h.tokens_digest = grant->tokens_digest;
    h.grant_expires = absl::FromUnixMillis(grant->expires_unix_ms);
  }
  h.deadline = std::min(h.start + options_.lease, h.grant_expires);
  ArmDeadline(h.deadline);
  {
    absl::MutexLock lock(&mu_);
    do {
      reply.id = RandomHandoffId();
    } while (handoffs_.contains(reply.id));
    handoffs_.emplace(reply.id, std::move(h));
    for (size_t b = static_cast<size_t>(reply.held_positions / bs); b < blocks.size(); ++b) {
      writable_[blocks[b]] = reply.id;
    }
  }
  reply.num_blocks = landing_ != nullptr ? landing_->spec().num_blocks : kv_->spec().num_blocks;
  reply.blocks = std::move(blocks);
  // The remote key only to a peer that writes one-sidedly (same machine,
  // shared memory): any other gets the base address alone, so it cannot
  // read or write the pool around the receiver's checks.
  reply.region = c.PeerMayMapMemory() ? region_ : transport_->WithoutRemoteKey(region_);
  reply.lease_ms = static_cast<int32_t>(absl::ToInt64Milliseconds(options_.lease));
  c.Send(Encode(reply));
}

bool KvReceiver::MayWrite(Connection& c, const void* dst, size_t bytes) {
  if (options_.writes_outside_reservations) return true;
  const KvManager& pool = landing_ != nullptr ? *landing_ : *kv_;
  const KvCacheSpec& spec = pool.spec();
  // Unsigned and checked without wrap-around: an address or a length near
  // 2^64 must not pass for a small offset.
  const auto base = reinterpret_cast<uintptr_t>(pool.storage().base);
  const auto at = reinterpret_cast<uintptr_t>(dst);
  const auto rank_bytes = static_cast<uint64_t>(spec.RankBytes());
  const uint64_t total = rank_bytes * static_cast<uint64_t>(spec.num_ranks);
  bool ok = bytes > 0 && at >= base && at - base <= total && bytes <= total - (at - base);
  if (ok) {
    const uint64_t off = at - base;
    const uint64_t end = off + bytes - 1;  // No wrap: bytes <= total - off.
    const auto lbb = static_cast<uint64_t>(spec.LayerBlockBytes());
    // A write across two ranks' pools is not one of ours.
    ok = off / rank_bytes == end / rank_bytes;
    const uint64_t first = (off % rank_bytes) / lbb;
    const uint64_t last = (end % rank_bytes) / lbb;
    absl::MutexLock lock(&mu_);
    // Every block it covers belongs to one active reservation of this
    // connection.
    Handoff* owner = nullptr;
    HandoffId owner_id;
    for (uint64_t lb = first; ok && lb <= last; ++lb) {
      const auto block = static_cast<int32_t>(lb % static_cast<uint64_t>(spec.num_blocks));
      auto w = writable_.find(block);
      auto h = w == writable_.end() ? handoffs_.end() : handoffs_.find(w->second);
      ok = h != handoffs_.end() && h->second.state == State::kActive && h->second.conn == &c &&
           (owner == nullptr || &h->second == owner);
      if (ok) {
        owner = &h->second;
        owner_id = h->first;
      }
    }
    if (ok) {
      ++owner->writes_landing;
      auto& landing = landing_writes_[{&c, at}];
      landing.first = owner_id;
      ++landing.second;
    }
  }
  if (!ok) Refused(GrantRefusal::kPutOutsideReservation);
  return ok;
}

void KvReceiver::WriteLanded(Connection& c, const void* dst, size_t bytes) {
  (void)bytes;
  if (options_.writes_outside_reservations) return;
  absl::ReleasableMutexLock lock(&mu_);
  auto w = landing_writes_.find({&c, reinterpret_cast<uintptr_t>(dst)});
  if (w == landing_writes_.end()) return;
  const HandoffId id = w->second.first;
  if (--w->second.second == 0) landing_writes_.erase(w);
  auto it = handoffs_.find(id);
  if (it == handoffs_.end() || --it->second.writes_landing > 0) return;
  if (it->second.state == State::kReleasing) {
    handoffs_.erase(it);  // Its blocks go back to the manager.
    return;
  }
  if (!it->second.pending_commit.has_value()) return;
  Commit commit = *std::move(it->second.pending_commit);
  it->second.pending_commit.reset();
  lock.Release();
  HandleCommit(c, commit);
}

void KvReceiver::HandleCommit(Connection& c, Commit& m) {
  CommitReply reply;
  reply.id = m.id;
  CommittedSequence out;
  Handoff h;
  {
    absl::MutexLock lock(&mu_);
    auto it = handoffs_.find(m.id);
    absl::Status refusal;
    if (it == handoffs_.end() || it->second.conn != &c) {
      if (it != handoffs_.end()) Refused(GrantRefusal::kCommitOtherConnection);
      refusal = absl::NotFoundError(absl::StrCat("KV handoff: commit for unknown handoff id ", m.id.value));
    } else if (options_.grant_key != nullptr && m.request_id != it->second.request_id) {
      Refused(GrantRefusal::kCommitOtherRequest);
      refusal = absl::PermissionDeniedError(absl::StrCat("KV handoff: commit for handoff ", m.id.value,
                                                         " names request ", m.request_id, ", its grant ",
                                                         it->second.request_id));
    } else if ((it->second.tokens_digest.has_value() &&
                DigestTokens(m.tokens, m.cache_salt) != *it->second.tokens_digest) ||
               m.cache_salt != it->second.cache_salt) {
      // Nothing is published from it: the blocks would be keyed by ids (or
      // a cache scope) the router never placed with this sender.
      Refused(GrantRefusal::kTokensMismatch);
      refusal = absl::PermissionDeniedError(absl::StrCat("KV handoff: commit for handoff ", m.id.value, " names ",
                                                         m.tokens.size(),
                                                         " token ids, or a cache scope, that are not its reservation's"));
    } else if (it->second.state != State::kActive) {
      refusal = absl::FailedPreconditionError(
          absl::StrCat("KV handoff: commit for handoff ", m.id.value, " refused: lease expired or aborted"));
    } else if (it->second.writes_landing > 0) {
      // The blocks are used only once every write into them has landed.
      if (it->second.pending_commit.has_value()) {
        refusal = absl::FailedPreconditionError(
            absl::StrCat("KV handoff: a second commit for handoff ", m.id.value, " while the first waits"));
      } else {
        it->second.pending_commit = std::move(m);
        return;
      }
    } else if (m.num_positions <= 0 || m.num_positions > it->second.reserved_positions ||
               static_cast<int32_t>(m.tokens.size()) != m.num_positions) {
      refusal = absl::InvalidArgumentError(absl::StrCat(
          "KV handoff: commit for handoff ", m.id.value, " has ", m.num_positions, " positions and ",
          m.tokens.size(), " tokens for a reservation of ", it->second.reserved_positions));
    } else if (it->second.verify && static_cast<int32_t>(m.layer_checksums.size()) != kv_->spec().num_layers) {
      refusal = absl::InvalidArgumentError(absl::StrCat("KV handoff: commit for handoff ", m.id.value, " carries ",
                                                        m.layer_checksums.size(), " layer checksums; its reservation "
                                                        "asked for ", kv_->spec().num_layers));
    }
    if (!refusal.ok()) {
      reply.code = static_cast<int32_t>(refusal.code());
      reply.message = std::string(refusal.message());
      c.Send(Encode(reply));
      return;
    }
    h = std::move(it->second);
    handoffs_.erase(it);
  }
  if (landing_ != nullptr) {
    // Into the pool before anyone can use the blocks (the decode engine,
    // or a prefix hit once published).
    if (absl::Status s = Land(h, h.held_positions, m.num_positions); !s.ok()) {
      metrics_.RecordFailure();
      reply.code = static_cast<int32_t>(absl::StatusCode::kUnavailable);
      reply.message = absl::StrCat("KV handoff: commit for handoff ", m.id.value, " failed copying into the pool: ",
                                   s.message());
      // h's blocks go back to their managers before the sender hears.
      h.kv.Release();
      h.landing.Release();
      c.Send(Encode(reply));
      return;
    }
  }
  {
    metrics_.RecordTransfer(options_.clock() - h.start);
    metrics_.AddBytes(static_cast<int64_t>(m.num_positions - h.held_positions) *
                      kv_->spec().BytesPerPosition() * kv_->spec().num_ranks);
    if (h.verify) {
      // Published by the consumer once checked: until then no prefix hit
      // may attach these blocks.
      const int32_t bs = kv_->spec().block_size;
      out.verify = true;
      out.first_block = h.held_positions / bs;
      out.end_block = (m.num_positions + bs - 1) / bs;
      out.producer = c.peer_host();
    } else {
      const BlockHasher hasher(layout_.model, layout_.dtype, layout_.block_size);
      kv_->Publish(h.kv, hasher.FullBlockHashes(m.tokens, m.cache_salt));
    }
    out.id = m.id;
    out.kv = std::move(h.kv);
    out.kv.SetNumPositions(m.num_positions);
    h.landing.Release();
  }
  // The consumer has the sequence before the sender learns of the commit:
  // an acknowledged commit is one the decode side already holds.
  out.state = std::move(m);
  on_committed_(std::move(out));
  c.Send(Encode(reply));
}

absl::Status KvReceiver::Land(const Handoff& h, int32_t from, int32_t to) {
  const KvCacheSpec& spec = kv_->spec();
  const KvStorage pool = kv_->storage(), landed = landing_->storage();
  const int64_t bytes = spec.LayerBlockBytes();
  for (int32_t b = from / spec.block_size; b < (to + spec.block_size - 1) / spec.block_size; ++b) {
    for (int32_t l = 0; l < spec.num_layers; ++l) {
      for (int32_t r = 0; r < spec.num_ranks; ++r) {
        if (absl::Status s = uploader_->Upload(pool.BlockData(l, BlockId{h.kv.block_table()[b]}, r),
                                               landed.BlockData(l, BlockId{h.landing.block_table()[b]}, r), bytes);
            !s.ok()) {
          return s;
        }
      }
    }
  }
  return absl::OkStatus();
}

void KvReceiver::HandleAbort(Connection& c, const kv::Abort& m) {
  bool known = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = handoffs_.find(m.id);
    known = it != handoffs_.end() && it->second.conn == &c;
  }
  // The sender flushed before aborting: nothing more will land.
  if (known) {
    metrics_.RecordAbort();
    metrics_.RecordFailure();
    Free(m.id);
  }
  c.Send(Encode(AbortAck{m.id}));
}

void KvReceiver::Free(HandoffId id) {
  absl::MutexLock lock(&mu_);
  auto it = handoffs_.find(id);
  if (it == handoffs_.end() || it->second.state == State::kReleasing) return;
  if (it->second.state == State::kQuarantined) {
    metrics_.AddQuarantined(-static_cast<int64_t>(it->second.kv.block_table().size()));
  }
  if (it->second.writes_landing > 0) {
    it->second.state = State::kReleasing;
    return;
  }
  handoffs_.erase(it);  // Its blocks go back to the manager.
}

void KvReceiver::Quarantine(HandoffId id, absl::Status why) {
  Connection* conn = nullptr;
  absl::Time deadline;
  {
    absl::MutexLock lock(&mu_);
    auto it = handoffs_.find(id);
    if (it == handoffs_.end() || it->second.state != State::kActive) return;
    it->second.state = State::kQuarantined;
    it->second.deadline = options_.clock() + options_.quarantine_timeout;
    deadline = it->second.deadline;
    metrics_.AddQuarantined(static_cast<int64_t>(it->second.kv.block_table().size()));
    metrics_.RecordFailure();
    metrics_.RecordAbort();
    conn = it->second.conn;
  }
  if (conn->failed()) {
    Free(id);  // Known dead: nothing more can land.
    return;
  }
  conn->Send(Encode(kv::Abort{id, static_cast<int32_t>(why.code()), std::string(why.message())}));
  ArmDeadline(deadline);
}

void KvReceiver::ArmDeadline(absl::Time deadline) {
  if (deadline >= check_at_) return;
  check_at_ = deadline;
  // Just past it: a lease ends once its deadline is behind the clock.
  const absl::Duration in = deadline - options_.clock() + absl::Milliseconds(1);
  std::weak_ptr<bool> alive = alive_;
  transport_->loop().PostAt(absl::Now() + in, [this, alive, deadline] {
    if (auto a = alive.lock(); !a || !*a) return;
    if (check_at_ != deadline) return;  // an earlier check took its place
    check_at_ = absl::InfiniteFuture();
    ExpireLeases();
    ArmNextDeadline();
  });
}

void KvReceiver::ArmNextDeadline() {
  absl::Time next = absl::InfiniteFuture();
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, h] : handoffs_) {
      if (h.state != State::kReleasing) next = std::min(next, h.deadline);
    }
  }
  if (next != absl::InfiniteFuture()) ArmDeadline(next);
}

void KvReceiver::ExpireLeases() {
  std::vector<HandoffId> expired;
  std::vector<Connection*> silent;  // Quarantined past the timeout.
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = options_.clock();
    for (const auto& [id, h] : handoffs_) {
      if (h.deadline >= now) continue;
      if (h.state == State::kActive) {
        expired.push_back(id);
      } else if (std::find(silent.begin(), silent.end(), h.conn) == silent.end()) {
        silent.push_back(h.conn);
      }
    }
  }
  for (Connection* c : silent) {
    c->Fail(absl::DeadlineExceededError("the sender neither acknowledged an abort nor disconnected"));
  }
  for (HandoffId id : expired) {
    metrics_.RecordLeaseExpired();
    Quarantine(id, absl::DeadlineExceededError(absl::StrCat("KV handoff ", id.value, ": lease expired")));
  }
}

void KvReceiver::OnDisconnected(Connection& c, absl::Status why) {
  std::vector<HandoffId> gone;
  {
    absl::MutexLock lock(&mu_);
    for (auto& waiting : wants_room_) waiting.erase(&c);
    for (const auto& [id, h] : handoffs_) {
      if (h.conn == &c) {
        gone.push_back(id);
        if (h.state == State::kActive) metrics_.RecordFailure();
      }
    }
  }
  for (HandoffId id : gone) Free(id);
}

}  // namespace pdserve::kv
