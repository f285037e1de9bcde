// Decoder steps over a few tokens of one sequence on the CPU, as native ops (torch.ops.litevlm_cpu).
//
// The same computations as the TorchScript functions of cpu_steps.py (`layers`, `chain`, `draft_cycle`,
// `verify_chain`, `decode_logits`), with the same arguments except that the per-layer weight and cache lists come flat
// (7 weights and 2 caches a layer, in cpu_steps.py's order). The matmuls go to ATen (MKL); everything
// between them (RMSNorm, RoPE, the cache writes, attention over the cached slots, SiLU-gating, the draft's
// log-softmax top-1 and the acceptance test) is one loop each over fp32 rows, with no dispatch per op.
// A decode step of a small decoder is otherwise about a hundred dispatched ops, which on a CPU cost
// more than the arithmetic between its weight reads.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kWeightsPerLayer = 7;  // in-norm, qkv, qkv bias, o, post-norm, gate|up, down
constexpr int64_t kCachesPerLayer = 2;   // K, V

void check_f32_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "litevlm_cpu: ", what, " must be a contiguous fp32 CPU tensor");
}

// x[i] = exp(x[i]) over an array, vectorised: exp(x) = 2^k exp(r) with r = x - k ln 2 in [-ln2/2, ln2/2] and a
// degree-7 polynomial for exp(r) (within 2 ulp of std::exp in fp32). Inputs below -87 give 0, above 88 give inf.
void exp_inplace(float* x, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    const float v = x[i];
    const float clamped = std::min(std::max(v, -87.0f), 88.0f);
    // k = round(clamped / ln 2) by the 1.5 * 2^23 trick (std::floor would keep the loop scalar)
    const float k = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (clamped - k * 0.693359375f) + k * 2.12194440e-4f;  // Cody-Waite: ln 2 in two parts
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    const float e = p * __builtin_bit_cast(float, bits);
    x[i] = v < -87.0f ? 0.0f : (v > 88.0f ? INFINITY : e);
  }
}

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, rows of width c.
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t c, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    float* o = out + r * c;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < c; ++j) ss += xr[j] * xr[j];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(c) + static_cast<float>(eps));
    for (int64_t j = 0; j < c; ++j) o[j] = xr[j] * inv * w[j];
  }
}


// Which cached slots row r of a step may attend to.
struct Visible {
  const bool* mask = nullptr;  // (n, end) row-major, or null
  int64_t start = 0;
  bool causal = false;  // row r sees slots 0..start+r (a chain's tree mask)
};

// The masked softmax of one row of scores in place over slots 0..top-1 (zero beyond it and where masked).
void softmax_row(float* pr, int64_t top, int64_t end, const bool* mrow, float scale) {
  float best = -INFINITY;
  for (int64_t j = 0; j < top; ++j)
    if (!mrow || mrow[j]) best = std::max(best, pr[j]);
  for (int64_t j = 0; j < top; ++j) pr[j] = (pr[j] - best) * scale;
  exp_inplace(pr, top);
  for (int64_t j = 0; j < top; ++j)
    if (mrow && !mrow[j]) pr[j] = 0.f;
  for (int64_t j = top; j < end; ++j) pr[j] = 0.f;
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < top; ++j) total += pr[j];
  const float inv = 1.f / total;
  for (int64_t j = 0; j < top; ++j) pr[j] *= inv;
}

// Attention of n rows (their rotated queries in q_rows, one row every `width` floats; `first` is the first
// row's index among the step's tokens) over cached slots 0..end-1 -> y (n, hq d). One row: loops over the
// cache. Several rows: per KV head, the scores of its query heads' rows and their weighted values as two
// small GEMMs, the softmax between them.
void attend(const float* q_rows, int64_t width, int64_t n, int64_t first, const float* kc, const float* vc,
            int64_t slots, int64_t end, const Visible& visible, int64_t hq, int64_t hkv, int64_t d, float* y) {
  const int64_t group = hq / hkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  auto top_of = [&](int64_t row_index) { return visible.causal ? visible.start + row_index + 1 : end; };
  auto mask_of = [&](int64_t row_index) { return visible.mask ? visible.mask + row_index * end : nullptr; };
  if (n == 1) {
    std::vector<float> scores(end);
    const int64_t top = top_of(first);
    for (int64_t h = 0; h < hq; ++h) {
      const float* q = q_rows + h * d;
      const float* keys = kc + (h / group) * slots * d;
      const float* values = vc + (h / group) * slots * d;
      for (int64_t j = 0; j < top; ++j) {
        const float* kj = keys + j * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t t = 0; t < d; ++t) s += q[t] * kj[t];
        scores[j] = s;
      }
      softmax_row(scores.data(), top, end, mask_of(first), scale);
      float* out = y + h * d;
      std::fill_n(out, d, 0.f);
      for (int64_t j = 0; j < top; ++j) {
        const float p = scores[j];
        const float* vj = values + j * d;
#pragma omp simd
        for (int64_t t = 0; t < d; ++t) out[t] += p * vj[t];
      }
    }
    return;
  }
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const int64_t m = n * group;  // query rows per KV head: (token, head in group)
  at::Tensor q_g = at::empty({m, d}, options);
  float* q_p = q_g.data_ptr<float>();
  for (int64_t g = 0; g < hkv; ++g) {
    for (int64_t r = 0; r < n; ++r) std::copy_n(q_rows + r * width + g * group * d, group * d, q_p + r * group * d);
    at::Tensor keys = at::from_blob(const_cast<float*>(kc) + g * slots * d, {end, d}, options);
    at::Tensor values = at::from_blob(const_cast<float*>(vc) + g * slots * d, {end, d}, options);
    at::Tensor probs = at::mm(q_g, keys.t());  // (m, end)
    float* p = probs.data_ptr<float>();
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row_index = first + i / group;
      softmax_row(p + i * end, top_of(row_index), end, mask_of(row_index), scale);
    }
    at::Tensor out = at::mm(probs, values);  // (m, d)
    const float* o = out.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) std::copy_n(o + r * group * d, group * d, y + r * hq * d + g * group * d);
  }
}

// n tokens at cache slots start..start+n-1 through the layers -> (n, C) (or (1, C) with last_only).
// cos / sin: one (D,) row per token (its RoPE position).
at::Tensor run_layers(at::Tensor x, const std::vector<const float*>& cos_rows, const std::vector<const float*>& sin_rows,
                      int64_t start, const Visible& visible, at::TensorList weights, at::TensorList caches, int64_t hq,
                      int64_t hkv, int64_t d, double eps, bool last_only) {
  const int64_t layers = weights.size() / kWeightsPerLayer;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer && layers > 0,
              "litevlm_cpu: weights must hold 7 tensors per layer");
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == layers * kCachesPerLayer,
              "litevlm_cpu: caches must hold K and V per layer");
  TORCH_CHECK(!last_only || layers == 1, "last_only runs one layer: the next layer would need every row");
  x = x.contiguous();
  check_f32_contiguous(x, "x");
  int64_t n = x.size(0);
  const int64_t c = x.size(1);
  const int64_t nqk = (hq + hkv) * d;
  const int64_t end = start + n;

  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor& in_norm = weights[i * kWeightsPerLayer + 0];
    const at::Tensor& qkv_w = weights[i * kWeightsPerLayer + 1];
    const at::Tensor& qkv_b = weights[i * kWeightsPerLayer + 2];
    const at::Tensor& o_w = weights[i * kWeightsPerLayer + 3];
    const at::Tensor& post_norm = weights[i * kWeightsPerLayer + 4];
    const at::Tensor& gate_up = weights[i * kWeightsPerLayer + 5];
    const at::Tensor& down = weights[i * kWeightsPerLayer + 6];
    const at::Tensor& k_cache = caches[i * kCachesPerLayer];
    const at::Tensor& v_cache = caches[i * kCachesPerLayer + 1];
    check_f32_contiguous(k_cache, "the K cache");
    check_f32_contiguous(v_cache, "the V cache");
    const int64_t slots = k_cache.size(2);
    TORCH_CHECK(end <= slots, "litevlm_cpu: slots ", start, "..", end - 1, " run past the cache (", slots, ")");

    at::Tensor xn = x;
    if (in_norm.numel() > 0) {
      xn = at::empty_like(x);
      rms_norm_rows(x.data_ptr<float>(), in_norm.data_ptr<float>(), xn.data_ptr<float>(), n, c, eps);
    }
    at::Tensor qkv = at::addmm(qkv_b, xn, qkv_w);  // (n, 2 nqk + hkv d): [q k | rot q rot k | v]
    const int64_t width = qkv.size(1);
    float* qkv_p = qkv.data_ptr<float>();
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    // RoPE in place over q|k (the rotated half comes pre-multiplied by the packed weights), then the cache writes.
    for (int64_t r = 0; r < n; ++r) {
      float* row = qkv_p + r * width;
      const float* cs = cos_rows[r];
      const float* sn = sin_rows[r];
      for (int64_t h = 0; h < hq + hkv; ++h) {
        float* q = row + h * d;
        const float* q_rot = row + nqk + h * d;
        for (int64_t j = 0; j < d; ++j) q[j] = q[j] * cs[j] + q_rot[j] * sn[j];
      }
      for (int64_t h = 0; h < hkv; ++h) {
        std::copy_n(row + (hq + h) * d, d, kc + (h * slots + start + r) * d);
        std::copy_n(row + 2 * nqk + h * d, d, vc + (h * slots + start + r) * d);
      }
    }
    const int64_t first = last_only ? n - 1 : 0;  // rows that go on past the cache writes
    if (last_only) {
      x = x.slice(0, n - 1, n);
      n = 1;
    }
    at::Tensor y = at::empty({n, hq * d}, x.options());
    attend(qkv_p + first * width, width, n, first, kc, vc, slots, end, visible, hq, hkv, d, y.data_ptr<float>());
    x = at::addmm(x, y, o_w);
    at::Tensor xn2 = at::empty_like(x);
    rms_norm_rows(x.data_ptr<float>(), post_norm.data_ptr<float>(), xn2.data_ptr<float>(), n, c, eps);
    at::Tensor gu = at::mm(xn2, gate_up);  // (n, 2I)
    const int64_t half = gu.size(1) / 2;
    at::Tensor act = at::empty({n, half}, x.options());
    const float* gu_p = gu.data_ptr<float>();
    float* act_p = act.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const float* gate = gu_p + r * 2 * half;
      float* a = act_p + r * half;
      for (int64_t j = 0; j < half; ++j) a[j] = -gate[j];
      exp_inplace(a, half);
      for (int64_t j = 0; j < half; ++j) a[j] = gate[j] / (1.f + a[j]) * gate[half + j];
    }
    x = at::addmm(x, act, down);
  }
  return x;
}

std::vector<const float*> rows_at(const at::Tensor& table, const int64_t* positions, int64_t n) {
  check_f32_contiguous(table, "the RoPE table");
  const int64_t d = table.size(-1);
  std::vector<const float*> out(n);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(positions[r] >= 0 && positions[r] < table.size(0), "litevlm_cpu: RoPE position ", positions[r],
                " is outside the table (", table.size(0), ")");
    out[r] = table.data_ptr<float>() + positions[r] * d;
  }
  return out;
}

// cos / sin already at the tokens' positions: (n, 1, D), or (1, 1, D) shared by all n (tree nodes at one depth).
std::vector<const float*> rows_of(const at::Tensor& gathered, int64_t n) {
  check_f32_contiguous(gathered, "cos / sin");
  const int64_t rows = gathered.numel() / gathered.size(-1);
  TORCH_CHECK(rows == n || rows == 1, "litevlm_cpu: cos / sin hold ", rows, " rows for ", n, " tokens");
  std::vector<const float*> out(n);
  for (int64_t r = 0; r < n; ++r) out[r] = gathered.data_ptr<float>() + (rows == 1 ? 0 : r) * gathered.size(-1);
  return out;
}

at::Tensor layers_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t start,
                     const std::optional<at::Tensor>& mask, at::TensorList weights, at::TensorList caches, int64_t hq,
                     int64_t hkv, int64_t d, double eps, bool last_only) {
  Visible visible;
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->to(at::kBool).contiguous();
    const int64_t n = x.size(0);
    TORCH_CHECK(m.numel() == n * (start + n), "litevlm_cpu: the mask must be (1, 1, n, start + n)");
    visible.mask = m.data_ptr<bool>();
  }
  return run_layers(x, rows_of(cos, x.size(0)), rows_of(sin, x.size(0)), start, visible, weights, caches, hq, hkv, d, eps, last_only);
}

// The most likely draft token after a feature and its log-probability: (log p, index into the draft vocabulary).
std::pair<float, int64_t> top1(const at::Tensor& hidden, const at::Tensor& head) {
  at::Tensor logits = at::mm(hidden, head);  // (1, V')
  const float* l = logits.data_ptr<float>();
  const int64_t v = logits.size(1);
  int64_t arg = 0;
  for (int64_t j = 1; j < v; ++j)
    if (l[j] > l[arg]) arg = j;
  float total = 0.f;
  for (int64_t j = 0; j < v; ++j) total += std::exp(l[j] - l[arg]);
  return {-std::log(total), arg};
}

at::Tensor chain_op(const at::Tensor& root_hidden, int64_t position, int64_t start, int64_t depth, double log_min,
                    int64_t eos, const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& embed,
                    const at::Tensor& fc_w, const at::Tensor& fc_b, const at::Tensor& head, const at::Tensor& vocab_map,
                    at::TensorList weights, at::TensorList caches, int64_t hq, int64_t hkv, int64_t d, double eps) {
  check_f32_contiguous(embed, "the embedding");
  const int64_t c = embed.size(1);
  const bool mapped = vocab_map.numel() > 0;
  at::Tensor map = mapped ? vocab_map.to(at::kLong).contiguous() : vocab_map;
  auto target_id = [&](int64_t idx) { return mapped ? map.data_ptr<int64_t>()[idx] : idx; };
  auto [value, idx] = top1(root_hidden.contiguous(), head);
  int64_t tok = target_id(idx);
  std::vector<int64_t> drafted{tok};
  at::Tensor hidden = root_hidden.contiguous();
  at::Tensor pair = at::empty({1, 2 * c}, embed.options());
  for (int64_t i = 0; i < depth - 1; ++i) {
    if (value < log_min || tok == eos) break;
    TORCH_CHECK(tok >= 0 && tok < embed.size(0), "litevlm_cpu: drafted token ", tok, " is outside the embedding");
    float* p = pair.data_ptr<float>();
    std::copy_n(embed.data_ptr<float>() + tok * c, c, p);
    std::copy_n(hidden.data_ptr<float>(), c, p + c);
    at::Tensor x = at::addmm(fc_b, pair, fc_w);
    const int64_t pos = position + i;
    hidden = run_layers(x, rows_at(cos_table, &pos, 1), rows_at(sin_table, &pos, 1), start + i, Visible{}, weights,
                        caches, hq, hkv, d, eps, false);
    auto [step_value, step_idx] = top1(hidden, head);
    value += step_value;
    tok = target_id(step_idx);
    drafted.push_back(tok);
  }
  return at::tensor(drafted, at::kLong);
}

at::Tensor draft_cycle_op(const at::Tensor& feats, const at::Tensor& nxt, const at::Tensor& pair_pos, int64_t done,
                          const at::Tensor& root, int64_t root_pos, int64_t depth, double log_min, int64_t eos,
                          const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& embed,
                          const at::Tensor& fc_w, const at::Tensor& fc_b, const at::Tensor& head,
                          const at::Tensor& vocab_map, at::TensorList weights, at::TensorList caches, int64_t hq,
                          int64_t hkv, int64_t d, double eps) {
  at::Tensor x = at::addmm(fc_b, at::cat({nxt, feats}, -1), fc_w);
  at::Tensor pos = pair_pos.to(at::kLong).contiguous();
  const int64_t m = pos.numel();
  at::Tensor h_root = run_layers(x, rows_at(cos_table, pos.data_ptr<int64_t>(), m),
                                 rows_at(sin_table, pos.data_ptr<int64_t>(), m), done, Visible{}, weights, caches, hq,
                                 hkv, d, eps, true);
  at::Tensor drafted = chain_op(h_root, root_pos, done + feats.size(0), depth, log_min, eos, cos_table, sin_table,
                                embed, fc_w, fc_b, head, vocab_map, weights, caches, hq, hkv, d, eps);
  return at::cat({root.to(at::kLong).view({1}), drafted});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_chain_op(
    const at::Tensor& tokens, int64_t start, int64_t root_pos, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& embed, at::TensorList weights, at::TensorList caches, int64_t hq, int64_t hkv, int64_t d,
    double eps, const at::Tensor& norm_w, const at::Tensor& head) {
  at::Tensor toks = tokens.to(at::kLong).contiguous();
  const int64_t n = toks.numel();
  const int64_t* t = toks.data_ptr<int64_t>();
  std::vector<int64_t> pos(n);
  for (int64_t r = 0; r < n; ++r) pos[r] = root_pos + r;
  Visible causal;
  causal.causal = true;
  causal.start = start;
  at::Tensor x = run_layers(embed.index_select(0, toks), rows_at(cos_table, pos.data(), n),
                            rows_at(sin_table, pos.data(), n), start, causal, weights, caches, hq, hkv, d, eps, false);
  const int64_t c = x.size(1);
  at::Tensor xn = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), norm_w.contiguous().data_ptr<float>(), xn.data_ptr<float>(), n, c, eps);
  at::Tensor logits = at::mm(xn, head);  // (n, V)
  const int64_t v = logits.size(1);
  const float* l = logits.data_ptr<float>();
  std::vector<int64_t> pred(n);
  for (int64_t r = 0; r < n; ++r) {
    int64_t arg = 0;
    for (int64_t j = 1; j < v; ++j)
      if (l[r * v + j] > l[r * v + arg]) arg = j;
    pred[r] = arg;
  }
  int64_t a = 0;
  while (a + 1 < n && t[a + 1] == pred[a]) ++a;
  std::vector<int64_t> emitted(t + 1, t + 1 + a);
  emitted.push_back(pred[a]);
  at::Tensor out = at::tensor(emitted, at::kLong);
  at::Tensor positions = at::arange(root_pos, root_pos + a + 1, at::kLong);
  return {out, xn.slice(0, 0, a + 1), embed.index_select(0, out), positions};
}

std::tuple<at::Tensor, at::Tensor> decode_logits_op(const at::Tensor& token, int64_t position, int64_t slot,
                                                    const at::Tensor& cos_table, const at::Tensor& sin_table,
                                                    const at::Tensor& embed, at::TensorList weights, at::TensorList caches,
                                                    int64_t hq, int64_t hkv, int64_t d, double eps,
                                                    const at::Tensor& norm_w, const at::Tensor& head) {
  at::Tensor x = run_layers(embed.index_select(0, token.to(at::kLong).view({1})), rows_at(cos_table, &position, 1),
                            rows_at(sin_table, &position, 1), slot, Visible{}, weights, caches, hq, hkv, d, eps, false);
  at::Tensor xn = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), norm_w.contiguous().data_ptr<float>(), xn.data_ptr<float>(), 1, x.size(1), eps);
  return {at::mm(xn, head), xn};
}

// A prompt of one sequence written at cache slots 0..n-1, causally (row r sees slots 0..r): a prefill, or a
// pruned prefill's layers -> (n, C), before any final norm.
at::Tensor prompt_layers_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                            at::TensorList caches, int64_t hq, int64_t hkv, int64_t d, double eps) {
  Visible causal;
  causal.causal = true;
  return run_layers(x, rows_of(cos, x.size(0)), rows_of(sin, x.size(0)), 0, causal, weights, caches, hq, hkv, d, eps,
                    false);
}

// ---- the ViewSelector's inference (litevlm.select.views), one question --------------------------------------
// Its layers are tiny (width 64, a question of ~10-40 words): as ATen ops each costs more in dispatch than in
// arithmetic, so everything here is plain loops over fp32 rows.

// y (rows, out) = x (rows, in) W + b with W given transposed, (in, ld) row-major (nn.Linear's weight.t()), of
// which columns 0..out-1 are used (one small GEMM in the BLAS: ~3x a plain loop here).
std::vector<float> linear_rows(const std::vector<float>& x, int64_t rows, int64_t in, const float* wt, int64_t ld,
                               int64_t out, const float* b) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  std::vector<float> y(rows * out);
  at::Tensor yt = at::from_blob(y.data(), {rows, out}, f32);
  yt.copy_(at::from_blob(const_cast<float*>(b), {1, out}, f32).expand({rows, out}));
  at::Tensor xt = at::from_blob(const_cast<float*>(x.data()), {rows, in}, f32);
  at::Tensor w = at::from_blob(const_cast<float*>(wt), {in, out}, {ld, 1}, f32);
  yt.addmm_(xt, w);
  return y;
}

std::vector<float> linear_rows(const std::vector<float>& x, int64_t rows, const at::Tensor& wt, const at::Tensor& b) {
  return linear_rows(x, rows, wt.size(0), wt.data_ptr<float>(), wt.size(1), wt.size(1), b.data_ptr<float>());
}

std::vector<float> layer_norm_rows(const std::vector<float>& x, int64_t rows, int64_t c, const at::Tensor& w,
                                   const at::Tensor& b, double eps) {
  const float* wp = w.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  std::vector<float> y(rows * c);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * c;
    float mean = 0.f, var = 0.f;
    for (int64_t j = 0; j < c; ++j) mean += xr[j];
    mean /= static_cast<float>(c);
    for (int64_t j = 0; j < c; ++j) var += (xr[j] - mean) * (xr[j] - mean);
    const float inv = 1.f / std::sqrt(var / static_cast<float>(c) + static_cast<float>(eps));
    for (int64_t j = 0; j < c; ++j) y[r * c + j] = (xr[j] - mean) * inv * wp[j] + bp[j];
  }
  return y;
}

void gelu_inplace(std::vector<float>& x) {  // exact GELU, as nn.GELU()
  for (float& v : x) v = 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
}

// Multi-head attention of nq query rows q (nq, C) over t rows k, v (t, C), every key visible -> (nq, C).
// q, k, v may sit inside wider rows: one row every q_stride / kv_stride floats.
std::vector<float> mha(const float* q, int64_t q_stride, const float* k, const float* v, int64_t kv_stride, int64_t nq,
                       int64_t t, int64_t c, int64_t heads) {
  const int64_t d = c / heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> y(nq * c, 0.f), p(t);
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* qi = q + i * q_stride + h * d;
      float best = -INFINITY;
      for (int64_t j = 0; j < t; ++j) {
        const float* kj = k + j * kv_stride + h * d;
        float s = 0.f;
        for (int64_t e = 0; e < d; ++e) s += qi[e] * kj[e];
        p[j] = s * scale;
        best = std::max(best, p[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < t; ++j) {
        p[j] = std::exp(p[j] - best);
        total += p[j];
      }
      float* yi = y.data() + i * c + h * d;
      for (int64_t j = 0; j < t; ++j) {
        const float* vj = v + j * kv_stride + h * d;
        const float pj = p[j] / total;
        for (int64_t e = 0; e < d; ++e) yi[e] += pj * vj[e];
      }
    }
  }
  return y;
}

// `_logits_ops` of litevlm/select/views.py for one question with no padding: embedded words x (1, T, C), latent
// queries q (1, N, C); encoder: 12 tensors a layer, tail: 14 (views.py's order, every linear weight transposed to
// (in, out) row-major) -> logits (1, N).
at::Tensor view_logits_op(const at::Tensor& x_in, const at::Tensor& q_in, at::TensorList encoder, at::TensorList tail,
                          int64_t heads, double eps) {
  TORCH_CHECK(x_in.size(0) == 1 && q_in.size(0) == 1, "litevlm_cpu: view_logits takes one question");
  TORCH_CHECK(encoder.size() % 12 == 0 && tail.size() == 14, "litevlm_cpu: view_logits weights do not match");
  for (const auto& w : encoder) check_f32_contiguous(w, "a ViewSelector weight");
  for (const auto& w : tail) check_f32_contiguous(w, "a ViewSelector weight");
  at::Tensor xc = x_in.contiguous(), qc = q_in.contiguous();
  check_f32_contiguous(xc, "x");
  check_f32_contiguous(qc, "q");
  const int64_t t = xc.size(1), c = xc.size(2), n = qc.size(1);
  std::vector<float> x(xc.data_ptr<float>(), xc.data_ptr<float>() + t * c);
  for (size_t l = 0; l < encoder.size(); l += 12) {
    const auto w = encoder.slice(l, 12);
    std::vector<float> h = layer_norm_rows(x, t, c, w[0], w[1], eps);
    std::vector<float> qkv = linear_rows(h, t, w[2], w[3]);  // (t, 3C)
    std::vector<float> y = mha(qkv.data(), 3 * c, qkv.data() + c, qkv.data() + 2 * c, 3 * c, t, t, c, heads);
    std::vector<float> o = linear_rows(y, t, w[4], w[5]);
    for (int64_t i = 0; i < t * c; ++i) x[i] += o[i];
    h = layer_norm_rows(x, t, c, w[6], w[7], eps);
    std::vector<float> f = linear_rows(h, t, w[8], w[9]);
    gelu_inplace(f);
    o = linear_rows(f, t, w[10], w[11]);
    for (int64_t i = 0; i < t * c; ++i) x[i] += o[i];
  }
  x = layer_norm_rows(x, t, c, tail[0], tail[1], eps);
  std::vector<float> q(qc.data_ptr<float>(), qc.data_ptr<float>() + n * c);
  std::vector<float> ql = layer_norm_rows(q, n, c, tail[2], tail[3], eps);
  // the cross-attention's in-projection: q from the latents, k and v from the words (in_w (3C, C) = [q; k; v])
  const float* in_wt = tail[4].data_ptr<float>();  // (C, 3C)
  const float* in_b = tail[5].data_ptr<float>();
  std::vector<float> qp = linear_rows(ql, n, c, in_wt, 3 * c, c, in_b);
  std::vector<float> kv = linear_rows(x, t, c, in_wt + c, 3 * c, 2 * c, in_b + c);
  std::vector<float> y = mha(qp.data(), c, kv.data(), kv.data() + c, 2 * c, n, t, c, heads);
  std::vector<float> o = linear_rows(y, n, tail[6], tail[7]);
  for (int64_t i = 0; i < n * c; ++i) q[i] += o[i];
  std::vector<float> h = linear_rows(layer_norm_rows(q, n, c, tail[8], tail[9], eps), n, tail[10], tail[11]);
  gelu_inplace(h);
  std::vector<float> logits = linear_rows(h, n, tail[12], tail[13]);  // (n, 1)
  return at::tensor(logits, at::kFloat).view({1, n});
}

}  // namespace

TORCH_LIBRARY(litevlm_cpu, m) {
  m.def("layers(Tensor x, Tensor cos, Tensor sin, int start, Tensor? mask, Tensor[] weights, Tensor[] caches, "
        "int hq, int hkv, int d, float eps, bool last_only=False) -> Tensor",
        &layers_op);
  m.def("chain(Tensor root_hidden, int position, int start, int depth, float log_min, int eos, Tensor cos_table, "
        "Tensor sin_table, Tensor embed, Tensor fc_w, Tensor fc_b, Tensor head, Tensor vocab_map, Tensor[] weights, "
        "Tensor[] caches, int hq, int hkv, int d, float eps) -> Tensor",
        &chain_op);
  m.def("draft_cycle(Tensor feats, Tensor nxt, Tensor pair_pos, int done, Tensor root, int root_pos, int depth, "
        "float log_min, int eos, Tensor cos_table, Tensor sin_table, Tensor embed, Tensor fc_w, Tensor fc_b, "
        "Tensor head, Tensor vocab_map, Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, float eps) -> Tensor",
        &draft_cycle_op);
  m.def("verify_chain(Tensor tokens, int start, int root_pos, Tensor cos_table, Tensor sin_table, Tensor embed, "
        "Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, float eps, Tensor norm_w, Tensor head) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        &verify_chain_op);
  m.def("decode_logits(Tensor token, int position, int slot, Tensor cos_table, Tensor sin_table, Tensor embed, "
        "Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, float eps, Tensor norm_w, Tensor head) "
        "-> (Tensor, Tensor)",
        &decode_logits_op);
  m.def("prompt_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, "
        "float eps) -> Tensor",
        &prompt_layers_op);
  m.def("view_logits(Tensor x, Tensor q, Tensor[] encoder, Tensor[] tail, int heads, float eps) -> Tensor",
        &view_logits_op);
}
