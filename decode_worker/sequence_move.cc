#include "decode_worker/sequence_move.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pdserve::decode {

absl::StatusOr<SentSequence> SendSequence(kv::ReceiverConnections& connections, const KvCacheSpec& spec,
                                          const engine::Request& r, const worker::v1::MoveSequenceRequest& req) {
  const auto start = std::chrono::steady_clock::now();
  const Generation& gen = *r.gen;
  const GenerationRequest& q = gen.request();
  const int32_t generated = static_cast<int32_t>(gen.generated().size());
  if (req.generated() != generated || generated < 1) {
    return absl::FailedPreconditionError(absl::StrCat("the router relayed ", req.generated(),
                                                      " tokens of this sequence; it generated ", generated));
  }
  std::vector<int32_t> context = gen.AllTokens();
  context.pop_back();  // The last sampled token: not fed yet, it has no KV.
  const int32_t positions = static_cast<int32_t>(context.size());
  if (r.kv.num_positions() != positions) {
    return absl::FailedPreconditionError(
        absl::StrCat("the sequence holds KV for ", r.kv.num_positions(), " positions, not its context's ", positions));
  }
  kv::ReserveArgs args;
  args.num_positions = positions;
  args.margin_positions =
      std::max<int32_t>(0, static_cast<int32_t>(q.prompt.size()) + q.params.max_tokens - positions);
  args.prompt_tokens = context;
  args.grant = req.kv_grant();
  args.cache_salt = q.cache_salt;
  absl::StatusOr<std::unique_ptr<kv::Handoff>> reserved = connections.Reserve(req.target_kv_address(), args);
  if (!reserved.ok()) return reserved.status();
  std::unique_ptr<kv::Handoff> handoff = *std::move(reserved);
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    if (absl::Status s = handoff->SendLayer(l, r.kv.block_table()); !s.ok()) return s;
  }
  kv::Commit c;
  c.request_id = req.target_request_id();
  c.num_positions = positions;
  c.tokens = std::move(context);
  c.first_token = gen.generated().back();
  c.sampling = q.params;
  c.seed = gen.seed();
  c.generated = generated;
  c.cache_salt = q.cache_salt;
  c.grammar_hash = q.constraint != nullptr ? q.constraint->spec.hash : 0;
  c.grammar_digest = gen.grammar_digest();
  const int32_t held = handoff->held_positions();
  if (absl::Status s = handoff->Commit(std::move(c)); !s.ok()) return s;
  SentSequence out;
  out.positions = positions;
  out.sent_positions = positions - held;
  out.bytes = static_cast<int64_t>(positions - held) * spec.BytesPerPosition() * spec.num_ranks;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace pdserve::decode
