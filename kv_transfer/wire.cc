#include "kv_transfer/wire.h"

#include <cstring>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace pdserve::kv {
namespace {

static_assert(std::endian::native == std::endian::little, "the wire encoding assumes little-endian");

class Writer {
 public:
  template <typename T>
  void Pod(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void Str(absl::string_view s) {
    Pod(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  template <typename T>
  void Vec(const std::vector<T>& v) {
    Pod(static_cast<uint32_t>(v.size()));
    for (const T& x : v) Pod(x);
  }
  void Desc(const KvLayoutDescriptor& d) {
    Pod(d.protocol_version);
    Pod(d.model.lo);
    Pod(d.model.hi);
    Pod(d.num_layers);
    Pod(d.num_kv_heads);
    Pod(d.head_dim);
    Pod(static_cast<uint8_t>(d.dtype));
    Pod(d.block_size);
    Pod(static_cast<uint8_t>(d.layout));
    if (d.protocol_version >= 3) {  // As Decode reads it.
      Pod(d.tp);
      Pod(d.kv_heads_per_rank);
    }
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  template <typename T>
  bool Pod(T& v) {
    if (in_.size() < sizeof(T)) return Fail();
    std::memcpy(&v, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return true;
  }
  bool Str(std::string& s) {
    uint32_t n;
    if (!Pod(n) || in_.size() < n) return Fail();
    s.assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  template <typename T>
  bool Vec(std::vector<T>& v) {
    uint32_t n;
    if (!Pod(n) || in_.size() / sizeof(T) < n) return Fail();
    v.resize(n);
    if (n > 0) std::memcpy(v.data(), in_.data(), n * sizeof(T));
    in_.remove_prefix(n * sizeof(T));
    return true;
  }
  bool Desc(KvLayoutDescriptor& d) {
    uint8_t dtype = 0, layout = 0;
    Pod(d.protocol_version) && Pod(d.model.lo) && Pod(d.model.hi) && Pod(d.num_layers) &&
        Pod(d.num_kv_heads) && Pod(d.head_dim) && Pod(dtype) && Pod(d.block_size) && Pod(layout);
    // Version 3 added the tensor-parallel layout; an older peer's
    // descriptor still decodes, to be refused by its version.
    if (ok_ && d.protocol_version >= 3) Pod(d.tp) && Pod(d.kv_heads_per_rank);
    d.dtype = static_cast<DType>(dtype);
    d.layout = static_cast<KvLayout>(layout);
    return ok_;
  }
  bool Fail() {
    ok_ = false;
    return false;
  }
  bool ok() const { return ok_ && in_.empty(); }

 private:
  absl::string_view in_;
  bool ok_ = true;
};

void Put(Writer& w, const SamplingParams& p) {
  w.Pod(p.temperature);
  w.Pod(p.top_k);
  w.Pod(p.top_p);
  w.Pod(p.min_p);
  w.Pod(p.repetition_penalty);
  w.Pod(p.presence_penalty);
  w.Pod(p.frequency_penalty);
  w.Pod(static_cast<uint8_t>(p.seed.has_value()));
  w.Pod(p.seed.value_or(0));
  w.Vec(p.stop_token_ids);
  w.Pod(static_cast<uint8_t>(p.ignore_eos));
  w.Pod(p.max_tokens);
  w.Pod(p.logprobs);
}

bool Get(Reader& r, SamplingParams& p) {
  uint8_t has_seed = 0, ignore_eos = 0;
  uint64_t seed = 0;
  const bool ok = r.Pod(p.temperature) && r.Pod(p.top_k) && r.Pod(p.top_p) && r.Pod(p.min_p) &&
                  r.Pod(p.repetition_penalty) && r.Pod(p.presence_penalty) && r.Pod(p.frequency_penalty) && r.Pod(has_seed) &&
                  r.Pod(seed) && r.Vec(p.stop_token_ids) && r.Pod(ignore_eos) &&
                  r.Pod(p.max_tokens) && r.Pod(p.logprobs);
  if (has_seed) p.seed = seed;
  p.ignore_eos = ignore_eos != 0;
  return ok;
}

struct EncodeVisitor {
  Writer& w;
  void operator()(const ReserveRequest& m) {
    w.Pod(m.tag);
    w.Desc(m.sender);
    w.Pod(m.num_positions);
    w.Pod(m.margin_positions);
    w.Vec(m.prompt_tokens);
    if (m.sender.protocol_version >= 4) w.Str(m.grant);  // As Decode reads it.
    if (m.sender.protocol_version >= 5) {
      w.Pod(m.cache_salt.lo);
      w.Pod(m.cache_salt.hi);
    }
  }
  void operator()(const ReserveReply& m) {
    w.Pod(m.tag);
    w.Pod(m.code);
    w.Str(m.message);
    w.Pod(m.id.value);
    w.Desc(m.receiver);
    w.Pod(m.held_positions);
    w.Pod(m.num_blocks);
    w.Vec(m.blocks);
    w.Str(m.region);
    w.Pod(m.lease_ms);
    if (m.receiver.protocol_version >= 7) w.Pod(m.verify);  // As Decode reads it.
  }
  void operator()(const LayerSent& m) {
    w.Pod(m.id.value);
    w.Pod(m.layer);
  }
  void operator()(const Commit& m) {
    w.Pod(m.id.value);
    w.Str(m.request_id);
    w.Pod(m.num_positions);
    w.Vec(m.tokens);
    w.Pod(m.first_token);
    w.Pod(m.first_logprob);
    w.Pod(static_cast<uint32_t>(m.top_logprobs.size()));
    for (const auto& [t, lp] : m.top_logprobs) {
      w.Pod(t);
      w.Pod(lp);
    }
    Put(w, m.sampling);
    w.Pod(m.seed);
    w.Pod(m.generated);
    w.Pod(m.finish_reason);
    w.Pod(m.cache_salt.lo);
    w.Pod(m.cache_salt.hi);
    w.Vec(m.layer_checksums);
    w.Pod(m.grammar_hash);
    w.Pod(m.grammar_digest);
  }
  void operator()(const CommitReply& m) {
    w.Pod(m.id.value);
    w.Pod(m.code);
    w.Str(m.message);
  }
  void operator()(const Abort& m) {
    w.Pod(m.id.value);
    w.Pod(m.code);
    w.Str(m.message);
  }
  void operator()(const AbortAck& m) { w.Pod(m.id.value); }
  void operator()(const RoomFreed&) {}
};

bool DecodeInto(Reader& r, ReserveRequest& m) {
  return r.Pod(m.tag) && r.Desc(m.sender) && r.Pod(m.num_positions) && r.Pod(m.margin_positions) &&
         r.Vec(m.prompt_tokens) && (m.sender.protocol_version < 4 || r.Str(m.grant)) &&
         (m.sender.protocol_version < 5 || (r.Pod(m.cache_salt.lo) && r.Pod(m.cache_salt.hi)));
}
bool DecodeInto(Reader& r, ReserveReply& m) {
  return r.Pod(m.tag) && r.Pod(m.code) && r.Str(m.message) && r.Pod(m.id.value) && r.Desc(m.receiver) &&
         r.Pod(m.held_positions) && r.Pod(m.num_blocks) && r.Vec(m.blocks) && r.Str(m.region) &&
         r.Pod(m.lease_ms) && (m.receiver.protocol_version < 7 || r.Pod(m.verify));
}
bool DecodeInto(Reader& r, LayerSent& m) { return r.Pod(m.id.value) && r.Pod(m.layer); }
bool DecodeInto(Reader& r, Commit& m) {
  uint32_t n = 0;
  if (!(r.Pod(m.id.value) && r.Str(m.request_id) && r.Pod(m.num_positions) && r.Vec(m.tokens) && r.Pod(m.first_token) &&
        r.Pod(m.first_logprob) && r.Pod(n))) {
    return false;
  }
  if (n > 1024) return r.Fail();
  for (uint32_t i = 0; i < n; ++i) {
    std::pair<int32_t, float> p;
    if (!(r.Pod(p.first) && r.Pod(p.second))) return false;
    m.top_logprobs.push_back(p);
  }
  return Get(r, m.sampling) && r.Pod(m.seed) && r.Pod(m.generated) && r.Pod(m.finish_reason) &&
         r.Pod(m.cache_salt.lo) && r.Pod(m.cache_salt.hi) && r.Vec(m.layer_checksums) && r.Pod(m.grammar_hash) &&
         r.Pod(m.grammar_digest);
}
bool DecodeInto(Reader& r, CommitReply& m) { return r.Pod(m.id.value) && r.Pod(m.code) && r.Str(m.message); }
bool DecodeInto(Reader& r, Abort& m) { return r.Pod(m.id.value) && r.Pod(m.code) && r.Str(m.message); }
bool DecodeInto(Reader& r, AbortAck& m) { return r.Pod(m.id.value); }
bool DecodeInto(Reader&, RoomFreed&) { return true; }

template <size_t I = 0>
bool DecodeAlt(uint8_t type, Reader& r, Message& out) {
  if constexpr (I < std::variant_size_v<Message>) {
    if (type == I) {
      std::variant_alternative_t<I, Message> m;
      if (!DecodeInto(r, m)) return false;
      out = std::move(m);
      return true;
    }
    return DecodeAlt<I + 1>(type, r, out);
  } else {
    return r.Fail();
  }
}

}  // namespace

std::string Encode(const Message& m) {
  Writer w;
  w.Pod(static_cast<uint8_t>(m.index()));
  std::visit(EncodeVisitor{w}, m);
  return w.Take();
}

absl::StatusOr<Message> Decode(absl::string_view bytes) {
  Reader r(bytes);
  uint8_t type = 0;
  Message out;
  if (!r.Pod(type) || !DecodeAlt(type, r, out) || !r.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV handoff: malformed control message (type ", type, ", ", bytes.size(), " bytes)"));
  }
  return out;
}

}  // namespace pdserve::kv
