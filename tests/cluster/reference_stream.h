// The stream a cluster must produce for a request, computed by the
// in-process engine alone (one sequence, no batching, no handoff), and the
// comparison of a cluster's stream with it. The cluster tests load the
// default model once per suite and tell their servers the matrix path the
// reference took (PDSERVE_MATRIX_PATH), so both run the same arithmetic.
#ifndef PDSERVE_TESTS_CLUSTER_REFERENCE_STREAM_H_
#define PDSERVE_TESTS_CLUSTER_REFERENCE_STREAM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/generation.h"
#include "grammar/constraint.h"
#include "kv/kv_manager.h"
#include "model/model.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "gtest/gtest.h"
#include "pdserve/v1/generation.pb.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {

// The in-process engine on the same request: its prompt (token ids, chat or
// text), sampling, stops and max_tokens as the router would resolve them.
inline Output ReferenceStream(Model& model, const tok::Tokenizer& tokenizer, const v1::GenerateRequest& req) {
  GenerationRequest r;
  if (req.has_token_ids()) {
    r.prompt.assign(req.token_ids().ids().begin(), req.token_ids().ids().end());
  } else if (req.has_chat()) {
    std::vector<tok::ChatMessage> messages;
    for (const auto& m : req.chat().messages()) messages.push_back({m.role(), m.content()});
    const std::string text = *tok::RenderChat(*tok::DetectChatFormat(tokenizer.chat_template()), messages, true,
                                              tokenizer.bos_token(), tokenizer.eos_token());
    r.prompt = *tokenizer.Encode(text, false);
  } else {
    r.prompt = *tokenizer.Encode(req.text(), false);
  }
  const v1::SamplingParams& s = req.sampling();
  r.params.temperature = s.has_temperature() ? s.temperature() : 1.0f;
  r.params.top_p = s.has_top_p() ? s.top_p() : 1.0f;
  r.params.top_k = s.top_k();
  r.params.min_p = s.min_p();
  r.params.repetition_penalty = s.has_repetition_penalty() ? s.repetition_penalty() : 1.0f;
  r.params.presence_penalty = s.presence_penalty();
  r.params.frequency_penalty = s.frequency_penalty();
  r.params.seed = s.seed();
  r.params.stop_token_ids.assign(req.stop_token_ids().begin(), req.stop_token_ids().end());
  r.params.ignore_eos = req.ignore_eos();
  r.params.max_tokens = req.max_tokens();
  r.stop_strings.assign(req.stop().begin(), req.stop().end());
  r.eos_ids = model.config().eos_token_ids;
  if (req.has_response_format()) {
    // One cache per tokenizer, as a worker keeps one.
    static auto* caches = new std::map<const tok::Tokenizer*, std::unique_ptr<grammar::GrammarCache>>();
    std::unique_ptr<grammar::GrammarCache>& cache = (*caches)[&tokenizer];
    if (cache == nullptr) {
      cache = std::make_unique<grammar::GrammarCache>(grammar::GrammarOptions{},
                                                      grammar::Vocabulary::FromTokenizer(tokenizer));
    }
    auto c = req.response_format().has_json_object() ? cache->JsonObject()
                                                      : cache->FromSchema(req.response_format().json_schema().schema());
    EXPECT_TRUE(c.ok()) << c.status();
    if (c.ok()) r.constraint = *c;
  }
  auto manager = *KvManager::Create(model.MakeKvSpec(model.weight_dtype(), 16, 64));
  Generation gen(r, &tokenizer);
  SequenceKv kv = manager->NewSequence();
  Output out;
  std::vector<int32_t> feed = r.prompt;
  while (!gen.finished()) {
    ForwardSequence fs{&kv, feed, LogitsMode::kLast};
    auto res = ForwardGrowing(model, *manager, {&fs, 1});
    EXPECT_TRUE(res.ok());
    auto ev = gen.Accept(res->Last(0));
    out.tokens.push_back(ev->token);
    out.text += ev->text;
    out.finish = ev->finish == FinishReason::kStop ? v1::FINISH_REASON_STOP : v1::FINISH_REASON_LENGTH;
    feed.assign(1, ev->token);
  }
  kv.Release();
  return out;
}

// A cluster's stream against the reference: the same tokens, text and
// finish reason; `what` names the case in failures.
inline void ExpectSameStream(const Output& got, const Output& want, const std::string& what) {
  ASSERT_TRUE(got.status.ok()) << what << ": " << got.status.error_message();
  EXPECT_EQ(got.tokens, want.tokens) << what;
  EXPECT_EQ(got.text, want.text) << what;
  EXPECT_EQ(got.finish, want.finish) << what << " " << got.final.error();
}

}  // namespace pdserve

#endif  // PDSERVE_TESTS_CLUSTER_REFERENCE_STREAM_H_
