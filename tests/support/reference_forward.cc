#include "tests/support/reference_forward.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "model/checkpoint.h"
#include "model/rope.h"

namespace pdserve::testing {
namespace {

using Mat = std::vector<double>;  // Row-major.

absl::StatusOr<Mat> Get(Checkpoint& c, const std::string& name, std::vector<int64_t> shape) {
  absl::StatusOr<const TensorView*> t = c.Take(name, shape);
  if (!t.ok()) return t.status();
  std::vector<float> f((*t)->NumElements());
  ConvertToF32((*t)->dtype, (*t)->data, f.size(), f.data());
  return Mat(f.begin(), f.end());
}

// y[S, N] = x[S, K] W[N, K]^T
Mat MatMulT(const Mat& x, const Mat& w, int64_t S, int64_t K, int64_t N) {
  Mat y(S * N, 0.0);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += x[s * K + k] * w[n * K + k];
      y[s * N + n] = acc;
    }
  }
  return y;
}

Mat RmsNorm(const Mat& x, const Mat& w, int64_t S, int64_t D, double eps) {
  Mat y(S * D);
  for (int64_t s = 0; s < S; ++s) {
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += x[s * D + d] * x[s * D + d];
    const double inv = 1.0 / std::sqrt(ss / D + eps);
    for (int64_t d = 0; d < D; ++d) y[s * D + d] = x[s * D + d] * inv * w[d];
  }
  return y;
}

void Rope(Mat& x, int64_t S, int64_t heads, int64_t H, const std::vector<double>& inv_freq,
          int restart) {
  for (int64_t s = 0; s < S; ++s) {
    const int64_t pos = restart > 0 ? s % restart : s;
    for (int64_t h = 0; h < heads; ++h) {
      double* v = &x[(s * heads + h) * H];
      for (int64_t i = 0; i < H / 2; ++i) {
        const double a = pos * inv_freq[i];
        const double x1 = v[i], x2 = v[i + H / 2];
        v[i] = x1 * std::cos(a) - x2 * std::sin(a);
        v[i + H / 2] = x2 * std::cos(a) + x1 * std::sin(a);
      }
    }
  }
}

}  // namespace

absl::StatusOr<std::vector<std::vector<double>>> ReferenceLogits(
    const std::string& model_dir, const std::vector<int32_t>& tokens,
    const ReferenceOptions& options) {
  absl::StatusOr<ModelConfig> cfg = LoadModelConfig(model_dir);
  if (!cfg.ok()) return cfg.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ck = Checkpoint::Open(model_dir);
  if (!ck.ok()) return ck.status();
  Checkpoint& c = **ck;
  const ModelConfig& m = *cfg;
  const int64_t S = static_cast<int64_t>(tokens.size());
  const int64_t D = m.hidden_size, F = m.intermediate_size, H = m.head_dim;
  const int64_t NQ = m.num_heads, NKV = m.num_kv_heads, G = NQ / NKV;
  const std::vector<double> inv_freq = RopeInverseFrequencies(m);

  absl::StatusOr<Mat> embed = Get(c, "model.embed_tokens.weight", {m.vocab_size, D});
  if (!embed.ok()) return embed.status();
  Mat x(S * D);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t d = 0; d < D; ++d) x[s * D + d] = (*embed)[tokens[s] * D + d];
  }
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    auto ln1 = Get(c, p + "input_layernorm.weight", {D});
    auto ln2 = Get(c, p + "post_attention_layernorm.weight", {D});
    auto wq = Get(c, p + "self_attn.q_proj.weight", {NQ * H, D});
    auto wk = Get(c, p + "self_attn.k_proj.weight", {NKV * H, D});
    auto wv = Get(c, p + "self_attn.v_proj.weight", {NKV * H, D});
    auto wo = Get(c, p + "self_attn.o_proj.weight", {D, NQ * H});
    auto wg = Get(c, p + "mlp.gate_proj.weight", {F, D});
    auto wu = Get(c, p + "mlp.up_proj.weight", {F, D});
    auto wd = Get(c, p + "mlp.down_proj.weight", {D, F});
    for (auto* t : {&ln1, &ln2, &wq, &wk, &wv, &wo, &wg, &wu, &wd}) {
      if (!t->ok()) return t->status();
    }
    Mat xn = RmsNorm(x, *ln1, S, D, m.rms_norm_eps);
    Mat q = MatMulT(xn, *wq, S, D, NQ * H);
    Mat k = MatMulT(xn, *wk, S, D, NKV * H);
    Mat v = MatMulT(xn, *wv, S, D, NKV * H);
    if (m.qkv_bias) {
      auto bq = Get(c, p + "self_attn.q_proj.bias", {NQ * H});
      auto bk = Get(c, p + "self_attn.k_proj.bias", {NKV * H});
      auto bv = Get(c, p + "self_attn.v_proj.bias", {NKV * H});
      for (auto* t : {&bq, &bk, &bv}) {
        if (!t->ok()) return t->status();
      }
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t i = 0; i < NQ * H; ++i) q[s * NQ * H + i] += (*bq)[i];
        for (int64_t i = 0; i < NKV * H; ++i) {
          k[s * NKV * H + i] += (*bk)[i];
          v[s * NKV * H + i] += (*bv)[i];
        }
      }
    }
    Rope(q, S, NQ, H, inv_freq, options.rope_restart_every);
    Rope(k, S, NKV, H, inv_freq, options.rope_restart_every);
    Mat attn(S * NQ * H, 0.0);
    for (int64_t h = 0; h < NQ; ++h) {
      const int64_t kvh = options.wrong_gqa_mapping ? h % NKV : h / G;
      for (int64_t i = 0; i < S; ++i) {
        std::vector<double> sc(i + 1);
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < H; ++d) dot += q[(i * NQ + h) * H + d] * k[(j * NKV + kvh) * H + d];
          sc[j] = dot / std::sqrt(static_cast<double>(H));
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (double& e : sc) sum += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < H; ++d) {
            attn[(i * NQ + h) * H + d] += sc[j] / sum * v[(j * NKV + kvh) * H + d];
          }
        }
      }
    }
    Mat o = MatMulT(attn, *wo, S, NQ * H, D);
    for (int64_t i = 0; i < S * D; ++i) x[i] += o[i];
    xn = RmsNorm(x, *ln2, S, D, m.rms_norm_eps);
    Mat g = MatMulT(xn, *wg, S, D, F);
    Mat u = MatMulT(xn, *wu, S, D, F);
    for (int64_t i = 0; i < S * F; ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
    Mat dn = MatMulT(g, *wd, S, F, D);
    for (int64_t i = 0; i < S * D; ++i) x[i] += dn[i];
  }
  auto norm = Get(c, "model.norm.weight", {D});
  if (!norm.ok()) return norm.status();
  Mat xn = RmsNorm(x, *norm, S, D, m.rms_norm_eps);
  absl::StatusOr<Mat> head = m.tie_word_embeddings ? embed : Get(c, "lm_head.weight", {m.vocab_size, D});
  if (!head.ok()) return head.status();
  Mat logits = MatMulT(xn, *head, S, D, m.vocab_size);
  std::vector<std::vector<double>> out(S);
  for (int64_t s = 0; s < S; ++s) {
    out[s].assign(logits.begin() + s * m.vocab_size, logits.begin() + (s + 1) * m.vocab_size);
  }
  return out;
}

}  // namespace pdserve::testing
