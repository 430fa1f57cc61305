#include "router/attempt.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/convert.h"

namespace pdserve::router {

std::string HostOfAddress(const std::string& address) {
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find(']');
    return close == std::string::npos ? address : address.substr(1, close - 1);
  }
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

Attempt::Attempt(const GenerationRequest& request, std::string request_id, absl::Span<const int32_t> streamed)
    : positions_(static_cast<int32_t>(request.prompt.size()) + request.params.max_tokens), salt_(request.cache_salt) {
  rpc::ToWork(request, &work_);
  work_.set_request_id(std::move(request_id));
  work_.mutable_generated_ids()->Assign(streamed.begin(), streamed.end());
  context_ = request.prompt;
  context_.insert(context_.end(), streamed.begin(), streamed.end());
}

worker::v1::DecodeRequest Attempt::DecodeRequest(bool prefill_here) const {
  worker::v1::DecodeRequest r;
  *r.mutable_request() = work_;
  r.set_prefill_here(prefill_here);
  return r;
}

worker::v1::PrefillRequest Attempt::PrefillRequest(const Worker& prefill, const Worker& decode,
                                                   const kv::GrantKey* key, absl::Time now, absl::Duration ttl) {
  worker::v1::PrefillRequest r;
  *r.mutable_request() = work_;
  r.set_decode_kv_address(decode.report().kv_address);
  if (key == nullptr) return r;
  r.set_kv_grant(HandoffGrant(prefill.address(), decode, *key, now, ttl));
  return r;
}

std::string Attempt::HandoffGrant(const std::string& sender, const Worker& receiver, const kv::GrantKey& key,
                                  absl::Time now, absl::Duration ttl) {
  // It binds the context (prompt and tokens already streamed), so the
  // decode worker publishes the KV only under these ids, and the room the
  // reservation may take (the context plus what is left to decode).
  absl::StatusOr<kv::Grant> g = kv::MintGrant(key, {.request_id = work_.request_id(),
                                                    .attempt = ++handoff_attempts_,
                                                    .sender = HostOfAddress(sender),
                                                    .receiver = receiver.report().kv_address,
                                                    .expires = now + ttl,
                                                    .positions = positions_,
                                                    .tokens_digest = kv::DigestTokens(context_, salt_)});
  return g.ok() ? kv::EncodeGrant(*g) : std::string();
}

worker::v1::MoveSequenceRequest Attempt::MoveRequest(const Worker& source, const std::string& source_request_id,
                                                     int32_t generated, const Worker& target, const kv::GrantKey* key,
                                                     absl::Time now, absl::Duration ttl) {
  worker::v1::MoveSequenceRequest r;
  r.set_request_id(source_request_id);
  r.set_target_request_id(work_.request_id());
  r.set_target_kv_address(target.report().kv_address);
  r.set_generated(generated);
  if (key != nullptr) r.set_kv_grant(HandoffGrant(source.address(), target, *key, now, ttl));
  return r;
}

worker::v1::PushPrefixRequest Attempt::PullRequest(const Worker& from, const Worker& to, int64_t positions,
                                                   const kv::GrantKey* key, absl::Time now, absl::Duration ttl) {
  worker::v1::PushPrefixRequest r;
  const int64_t n = std::clamp<int64_t>(positions, 0, static_cast<int64_t>(context_.size()));
  r.mutable_tokens()->Assign(context_.begin(), context_.begin() + n);
  r.set_cache_salt_lo(salt_.lo);
  r.set_cache_salt_hi(salt_.hi);
  r.set_receiver_kv_address(to.report().kv_address);
  r.set_request_id(absl::StrCat(work_.request_id(), "/pull"));
  if (key == nullptr) return r;
  absl::StatusOr<kv::Grant> g = kv::MintGrant(
      *key, {.request_id = r.request_id(),
             .attempt = ++pulls_,
             .sender = HostOfAddress(from.address()),
             .receiver = to.report().kv_address,
             .expires = now + ttl,
             .positions = static_cast<int32_t>(n),
             .tokens_digest = kv::DigestTokens(absl::MakeConstSpan(context_).first(static_cast<size_t>(n)), salt_)});
  if (g.ok()) r.set_kv_grant(kv::EncodeGrant(*g));
  return r;
}

}  // namespace pdserve::router
