#include "kv_transfer/receiver.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/block_hash.h"

namespace pdserve::kv {

absl::StatusOr<std::unique_ptr<KvReceiver>> KvReceiver::Create(Transport* transport, BlockPool* pool,
                                                                absl::Mutex* pool_mu, ReceiverOptions options,
                                                                CommittedCallback on_committed) {
  absl::StatusOr<std::string> region = transport->PackRegion(pool->region());
  if (!region.ok()) return region.status();
  std::unique_ptr<KvReceiver> r(new KvReceiver(transport, pool, pool_mu, std::move(options),
                                               std::move(on_committed), *std::move(region)));
  std::weak_ptr<bool> alive = r->alive_;
  KvReceiver* self = r.get();
  transport->loop().AddTicker(r->options_.lease_check_period, [alive, self] {
    if (auto a = alive.lock(); a && *a) self->ExpireLeases();
  });
  return r;
}

KvReceiver::KvReceiver(Transport* transport, BlockPool* pool, absl::Mutex* pool_mu, ReceiverOptions options,
                       CommittedCallback on_committed, std::string region)
    : transport_(transport),
      pool_(pool),
      pool_mu_(pool_mu),
      options_(std::move(options)),
      on_committed_(std::move(on_committed)),
      layout_(KvLayoutDescriptor::FromSpec(pool->spec(), options_.model)),
      region_(std::move(region)) {}

KvReceiver::~KvReceiver() {
  transport_->Detach(this);
  transport_->loop().RunSync([this] {
    *alive_ = false;
    absl::MutexLock lock(&mu_);
    absl::MutexLock pool_lock(pool_mu_);
    for (auto& [id, h] : handoffs_) {
      for (int32_t b : h.blocks) pool_->Release(BlockId{b});
    }
    handoffs_.clear();
  });
}

absl::StatusOr<int> KvReceiver::Listen(const std::string& host, int port) {
  return transport_->Listen(host, port, this);
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
      s.quarantined_blocks += static_cast<int32_t>(h.blocks.size());
    }
  }
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
      it->second.deadline = options_.clock() + options_.lease;
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
  std::vector<int32_t> blocks;
  {
    absl::MutexLock lock(pool_mu_);
    // Full prompt blocks only; the last position is always sent so that
    // the sender never skips a partial block.
    const BlockHasher hasher(layout_.model, layout_.dtype, bs);
    const int32_t hashable = std::min<int32_t>(static_cast<int32_t>(m.prompt_tokens.size()), m.num_positions - 1);
    std::vector<BlockHash> hashes =
        hasher.FullBlockHashes(absl::MakeConstSpan(m.prompt_tokens).subspan(0, std::max(0, hashable)));
    std::vector<BlockId> prefix = pool_->AcquireCachedPrefix(hashes);
    absl::StatusOr<std::vector<BlockId>> fresh = pool_->Allocate(static_cast<int32_t>(need - prefix.size()));
    if (!fresh.ok()) {
      for (BlockId b : prefix) pool_->Release(b);
      metrics_.RecordFailure();
      return refuse(absl::ResourceExhaustedError(absl::StrCat(
          "KV handoff: reservation of ", need, " blocks (", total_positions, " positions) refused: ",
          fresh.status().message())));
    }
    for (BlockId b : prefix) blocks.push_back(b.value);
    // Fresh blocks in ascending order: the pool hands them out LIFO (so a
    // released table comes back reversed), and ascending ids let the sender
    // merge consecutive blocks into one large put per layer.
    std::vector<int32_t> ids;
    for (BlockId b : *fresh) ids.push_back(b.value);
    std::sort(ids.begin(), ids.end());
    blocks.insert(blocks.end(), ids.begin(), ids.end());
    reply.held_positions = static_cast<int32_t>(prefix.size()) * bs;
  }
  Handoff h;
  h.conn = &c;
  h.blocks = blocks;
  h.held_positions = reply.held_positions;
  h.reserved_positions = static_cast<int32_t>(total_positions);
  h.start = options_.clock();
  h.deadline = h.start + options_.lease;
  {
    absl::MutexLock lock(&mu_);
    reply.id = HandoffId{next_id_++};
    handoffs_.emplace(reply.id, std::move(h));
  }
  reply.num_blocks = pool_->spec().num_blocks;
  reply.blocks = std::move(blocks);
  reply.region = region_;
  reply.lease_ms = static_cast<int32_t>(absl::ToInt64Milliseconds(options_.lease));
  c.Send(Encode(reply));
}

void KvReceiver::HandleCommit(Connection& c, Commit& m) {
  CommitReply reply;
  reply.id = m.id;
  CommittedSequence out;
  {
    absl::MutexLock lock(&mu_);
    auto it = handoffs_.find(m.id);
    absl::Status refusal;
    if (it == handoffs_.end() || it->second.conn != &c) {
      refusal = absl::NotFoundError(absl::StrCat("KV handoff: commit for unknown handoff id ", m.id.value));
    } else if (it->second.state != State::kActive) {
      refusal = absl::FailedPreconditionError(
          absl::StrCat("KV handoff: commit for handoff ", m.id.value, " refused: lease expired or aborted"));
    } else if (m.num_positions <= 0 || m.num_positions > it->second.reserved_positions ||
               static_cast<int32_t>(m.tokens.size()) != m.num_positions) {
      refusal = absl::InvalidArgumentError(absl::StrCat(
          "KV handoff: commit for handoff ", m.id.value, " has ", m.num_positions, " positions and ",
          m.tokens.size(), " tokens for a reservation of ", it->second.reserved_positions));
    }
    if (!refusal.ok()) {
      reply.code = static_cast<int32_t>(refusal.code());
      reply.message = std::string(refusal.message());
      c.Send(Encode(reply));
      return;
    }
    Handoff h = std::move(it->second);
    handoffs_.erase(it);
    metrics_.RecordTransfer(options_.clock() - h.start);
    metrics_.AddBytes(static_cast<int64_t>(m.num_positions - h.held_positions) *
                      pool_->spec().BytesPerPosition());
    {
      absl::MutexLock pool_lock(pool_mu_);
      const BlockHasher hasher(layout_.model, layout_.dtype, layout_.block_size);
      std::vector<BlockHash> hashes = hasher.FullBlockHashes(m.tokens);
      for (size_t i = 0; i < hashes.size(); ++i) {
        pool_->MarkCached(BlockId{h.blocks[i]}, hashes[i], i > 0 ? hashes[i - 1] : BlockHash{});
      }
    }
    out.id = m.id;
    out.kv.mutable_block_table() = std::move(h.blocks);
    out.kv.SetNumPositions(m.num_positions);
  }
  c.Send(Encode(reply));
  out.state = std::move(m);
  on_committed_(std::move(out));
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
  if (it == handoffs_.end()) return;
  if (it->second.state == State::kQuarantined) {
    metrics_.AddQuarantined(-static_cast<int64_t>(it->second.blocks.size()));
  }
  {
    absl::MutexLock pool_lock(pool_mu_);
    for (int32_t b : it->second.blocks) pool_->Release(BlockId{b});
  }
  handoffs_.erase(it);
}

void KvReceiver::Quarantine(HandoffId id, absl::Status why) {
  Connection* conn = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = handoffs_.find(id);
    if (it == handoffs_.end() || it->second.state != State::kActive) return;
    it->second.state = State::kQuarantined;
    it->second.deadline = options_.clock() + options_.quarantine_timeout;
    metrics_.AddQuarantined(static_cast<int64_t>(it->second.blocks.size()));
    metrics_.RecordFailure();
    metrics_.RecordAbort();
    conn = it->second.conn;
  }
  if (conn->failed()) {
    Free(id);  // Known dead: nothing more can land.
    return;
  }
  conn->Send(Encode(kv::Abort{id, static_cast<int32_t>(why.code()), std::string(why.message())}));
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
