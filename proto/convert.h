// Conversions between the wire messages and the engine's types, shared by
// the router and both workers so that all three read a request alike.
#ifndef PDSERVE_PROTO_CONVERT_H_
#define PDSERVE_PROTO_CONVERT_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"

#include "kv/block_hash.h"
#include "engine/generation.h"
#include "kv/kv_events.h"
#include "engine/sampling.h"
#include "grammar/constraint.h"
#include "pdserve/v1/generation.pb.h"
#include "pdserve/v1/worker.pb.h"

namespace pdserve::rpc {

// The engine's request from a resolved WorkRequest (+ the model's EOS ids).
GenerationRequest FromWork(const worker::v1::WorkRequest& w, const std::vector<int32_t>& eos_ids);

// What a worker checks a WorkRequest against: its model's EOS ids and
// vocabulary, and (where the worker holds the whole sequence) its context.
struct WorkLimits {
  std::vector<int32_t> eos_ids;
  int64_t vocab_size = 0;
  int64_t max_positions = 0;  // prompt + max_tokens must fit; 0: not checked
  const tok::Tokenizer* tokenizer = nullptr;
  // Compiles the request's response format; a request with one is refused
  // where this is null.
  grammar::GrammarCache* grammars = nullptr;
};

// A worker's one conversion and validation of a WorkRequest: the request
// converted (FromWork), its prompt non-empty and inside the vocabulary, its
// sampling parameters valid, prompt + max_tokens within max_positions, and
// its generated_ids (a migrated request) inside the vocabulary and replayed,
// ready to sample the next token. Errors: INVALID_ARGUMENT naming the field.
absl::StatusOr<std::unique_ptr<Generation>> AcceptWork(const worker::v1::WorkRequest& w, const WorkLimits& limits);

// The resolved WorkRequest for `params` (seed set) and prompt ids.
void ToWork(const GenerationRequest& r, worker::v1::WorkRequest* w);

v1::FinishReason ToProto(FinishReason f);
FinishReason FromProto(v1::FinishReason f);

// Appends one token (id, text, logprobs when `with_logprobs`) to a chunk.
void AppendToken(const TokenEvent& e, bool with_logprobs, v1::TokenChunk* chunk);

// A worker's Status answer: its KV events when `req` asks for them, and how
// it hashes blocks.
void FillKvEvents(const KvEventLog& log, const worker::v1::WorkerStatusRequest& req, worker::v1::WorkerInfo* out);
void FillPrefixHash(const ModelIdentity& model, DType kv_dtype, int32_t block_size, worker::v1::WorkerInfo* out);
BlockHash HashFromProto(uint64_t lo, uint64_t hi);

}  // namespace pdserve::rpc

#endif  // PDSERVE_PROTO_CONVERT_H_
