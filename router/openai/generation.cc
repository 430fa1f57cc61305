#include "router/openai/generation.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "router/openai/response.h"

namespace pdserve::router::openai {

Generations::Generations(const HttpServerOptions& options, const HttpBackend& backend,
                         std::function<void(const CallPtr&)> wake)
    : options_(options), backend_(backend), wake_(std::move(wake)) {
  std::random_device rd;
  id_base_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

void Generations::Reply(const CallPtr& call, int status, std::string body,
                        std::vector<std::pair<std::string, std::string>> headers) {
  {
    absl::MutexLock lock(&call->mu);
    call->status = status;
    call->body = std::move(body);
    call->headers = std::move(headers);
    call->done = true;
  }
  wake_(call);
}

void Generations::ReplyError(const CallPtr& call, const absl::Status& st) {
  const HttpError e = ErrorFor(st);
  Reply(call, e.status, e.body, ErrorHeaders(e));
}

void Generations::Stream(const CallPtr& call, std::string events, bool done) {
  {
    absl::MutexLock lock(&call->mu);
    call->sse = true;
    if (call->out.empty()) call->out_since = absl::Now();
    call->out += events;
    call->done = done;
  }
  wake_(call);
}

void Generations::Run(const CallPtr& call, Endpoint endpoint, const std::string& body,
                      const std::string& authorization, const std::string& peer, const std::string& client_id) {
  const RelayContext& rc = *backend_.relay;
  const absl::Time received = rc.options.clock();  // TTFT counts decoding and tokenizing too
  KeyLease lease;  // held to the end of the generation
  if (backend_.admit) {
    absl::StatusOr<KeyLease> l = backend_.admit(authorization, peer);
    if (!l.ok()) return ReplyError(call, l.status());
    lease = *std::move(l);
  }
  DecodeLimits limits;
  limits.max_body_bytes = options_.max_body_bytes;
  limits.max_reply_entries = options_.max_reply_entries;
  limits.context_length = backend_.resolver->config().max_position_embeddings;
  limits.default_completion_tokens = options_.default_completion_tokens;
  absl::StatusOr<OpenAiRequest> request = DecodeRequest(endpoint, body, limits);
  if (!request.ok()) {
    rc.metrics->CountOutcome("invalid");
    return ReplyError(call, request.status());
  }
  const bool chat = endpoint == Endpoint::kChatCompletions;
  if (!chat && request->generate.max_tokens() == 0) {
    request->generate.set_max_tokens(options_.default_completion_tokens);
  }
  absl::StatusOr<GenerationRequest> resolved = backend_.resolver->Resolve(
      request->generate, chat ? RequestResolver::MaxTokens::kToContext : RequestResolver::MaxTokens::kRequired);
  if (!resolved.ok()) {
    rc.metrics->CountOutcome("invalid");
    return ReplyError(call, resolved.status());
  }
  if (backend_.cache_salt) resolved->cache_salt = backend_.cache_salt(lease.id());
  const uint64_t n = next_id_.fetch_add(1);
  const std::string id = absl::StrCat(chat ? "chatcmpl-" : "cmpl-", absl::Hex(id_base_ + n, absl::kZeroPad16));
  ResponseWriter writer(*request, id, absl::ToUnixSeconds(absl::Now()), backend_.resolver->model_name(),
                        &backend_.resolver->tokenizer(), backend_.resolver->tool_syntax());
  Relay relay(rc, *std::move(resolved), client_id.empty() ? id : client_id, std::nullopt, received);
  relay.set_queue_key(lease.id());
  call->gone.Attach(&relay);
  const bool stream = request->stream;
  v1::GenerateFinal final;
  const absl::Status st = relay.Run([&](const v1::GenerateResponse& m) {
    if (call->gone.cancelled()) return false;
    if (m.has_chunk()) {
      if (stream) {
        Stream(call, writer.ChunkEvents(m.chunk()), false);
      } else {
        writer.Add(m.chunk());
      }
    } else if (m.has_final()) {
      final = m.final();
    }
    return true;
  });
  call->gone.Detach();
  bool streaming;
  {
    absl::MutexLock lock(&call->mu);
    streaming = call->sse;
  }
  if (st.ok()) {
    if (stream) return Stream(call, writer.FinalEvents(final), true);
    // A whole reply has nowhere to put an error after the first token: a
    // request that failed or was cancelled mid-way is an error reply, not
    // a 200 whose text stops short.
    if (final.finish_reason() == v1::FINISH_REASON_ERROR) {
      return ReplyError(call, absl::InternalError(absl::StrCat(
                                  final.error(), " (after ", final.usage().completion_tokens(), " tokens)")));
    }
    if (final.finish_reason() == v1::FINISH_REASON_CANCELLED) {
      return ReplyError(call, absl::UnavailableError(absl::StrCat("the request was cancelled after ",
                                                                   final.usage().completion_tokens(), " tokens")));
    }
    return Reply(call, 200, writer.Body(final));
  }
  if (streaming) {
    // The stream began: the error goes in it.
    v1::GenerateFinal failed;
    failed.set_error(std::string(st.message()));
    return Stream(call, writer.FinalEvents(failed), true);
  }
  ReplyError(call, st);
}


}  // namespace pdserve::router::openai
