// Decoder steps over a few tokens of one sequence on the CPU, as native ops (torch.ops.litevlm_cpu).
//
// The same computations as the eager step functions of cpu_steps.py (`layers`, `chain`, `draft_cycle`,
// `verify_chain`, `decode_logits`), with the same arguments except that the per-layer weight and cache lists come flat
// (7 weights and 2 caches a layer, in the order of cpu_steps.py's `LayerWeights`) and that the q|k|v projection comes
// without the rotated copies of q and k that the eager steps fold into it: RoPE's rotation is a loop here, and the
// copies would make that product larger, read at every step. A one-row matmul is an own loop (`row_product`), larger
// ones go to ATen (MKL), and a draft head's run on bf16 panels of its weights (`pack_panels`); everything between
// them (RMSNorm, RoPE, the cache writes, attention over the cached slots, SiLU-gating, the draft's log-softmax top-1
// and the acceptance test) is one loop each over fp32 rows, with no dispatch per op. A decode step of a small decoder
// is otherwise about a hundred dispatched ops, which on a CPU cost more than the arithmetic between its weight reads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
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

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, rows of width c; w null: the rows scaled alone (unit weights).
// A prompt's loops over its rows (norms, RoPE and the cache writes, SiLU-gating) are split over the threads in
// blocks of this many rows; a step of fewer rows runs on the calling thread.
constexpr int64_t kRowGrain = 32;

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t c, double eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t stop) {
    for (int64_t r = begin; r < stop; ++r) {
      const float* xr = x + r * c;
      float* o = out + r * c;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < c; ++j) ss += xr[j] * xr[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(c) + static_cast<float>(eps));
      if (w) {
        for (int64_t j = 0; j < c; ++j) o[j] = xr[j] * inv * w[j];
      } else {
        for (int64_t j = 0; j < c; ++j) o[j] = xr[j] * inv;
      }
    }
  });
}


// y (n, out) += x (n, in) @ w (in, out), w held row-major: a decode step's or a draft step's one row, or a
// verification's few (up to kFewRows: a 16-token draft and its root). An own loop streams the weight once in storage
// order, four weight rows at a time, each read from memory once and, from the cache, serving every input row in turn,
// ahead of the BLAS call (whose dispatch it also skips, and which packs the weights for each call first: at two to
// seventeen rows that cost it about twice the one-row step). Every row is summed in the same order whatever n is, so
// a verified row's product is the one a decode step would compute from the same input. kRows > 0 fixes the row count
// when compiling (the one-row step, whose loop over rows then goes away); 0 takes n.
constexpr int64_t kFewRows = 24;

// A block of R rows by J columns of y, summed in registers over the whole input and stored once: each weight row of
// the block loaded once serves the R rows, and y is read and written once instead of at every four inputs. Each
// element gets the same sums in the same order as one row alone (the base, then four inputs at a time, then the
// rest), so the result does not depend on how the rows are blocked.
template <int64_t R, int64_t J>
inline void block_product(const float* x, int64_t in, const float* w, int64_t ldw, float* y, int64_t ldy) {
  float acc[R][J];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < J; ++j) acc[r][j] = y[r * ldy + j];
  int64_t k = 0;
  for (; k + 4 <= in; k += 4) {
    const float* w0 = w + k * ldw;
    const float* w1 = w0 + ldw;
    const float* w2 = w1 + ldw;
    const float* w3 = w2 + ldw;
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + r * in + k;
      const float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];
#pragma omp simd
      for (int64_t j = 0; j < J; ++j) acc[r][j] += x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j];
    }
  }
  for (; k < in; ++k) {
    const float* wk = w + k * ldw;
    for (int64_t r = 0; r < R; ++r) {
      const float xv = x[r * in + k];
#pragma omp simd
      for (int64_t j = 0; j < J; ++j) acc[r][j] += xv * wk[j];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < J; ++j) y[r * ldy + j] = acc[r][j];
}

// R rows of y (row stride ldy) += x (R, in) @ w (in, cols, row stride ldw), by blocks of 32 columns, the last of
// them narrower: 16 or, in a step of its own, one column at a time.
template <int64_t R>
void rows_block(const float* x, int64_t in, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t cols) {
  int64_t j = 0;
  for (; j + 32 <= cols; j += 32) block_product<R, 32>(x, in, w + j, ldw, y + j, ldy);
  for (; j + 16 <= cols; j += 16) block_product<R, 16>(x, in, w + j, ldw, y + j, ldy);
  for (; j < cols; ++j) block_product<R, 1>(x, in, w + j, ldw, y + j, ldy);
}

// y (n, cols, row stride ldy) += x (n, in) @ w (in, cols, row stride ldw): blocks of four rows, then the rest.
template <int64_t kRows>
void rows_product(const float* x, int64_t n, int64_t in, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t cols) {
  if (kRows > 0) n = kRows;
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) rows_block<4>(x + r * in, in, w, ldw, y + r * ldy, ldy, cols);
  switch (n - r) {
    case 3: rows_block<3>(x + r * in, in, w, ldw, y + r * ldy, ldy, cols); break;
    case 2: rows_block<2>(x + r * in, in, w, ldw, y + r * ldy, ldy, cols); break;
    case 1: rows_block<1>(x + r * in, in, w, ldw, y + r * ldy, ldy, cols); break;
    default: break;
  }
}

// A few-rows product of at least this many multiply-adds is split over the threads by blocks of kColumnBlock output
// columns, each column summed as on one thread. Each element of y is read and written once (its sums stay in
// registers), so two threads' columns meeting in a cache line cost one exchange, not one at every step of the sum.
constexpr int64_t kParallelProductWork = 1 << 16;
constexpr int64_t kColumnBlock = 64;

template <int64_t kRows>
void rows_product(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y) {
  const int64_t rows = kRows > 0 ? kRows : n;
  if (rows * in * out < kParallelProductWork || at::get_num_threads() == 1)
    return rows_product<kRows>(x, n, in, w, out, y, out, out);
  at::parallel_for(0, (out + kColumnBlock - 1) / kColumnBlock, 1, [&](int64_t begin, int64_t stop) {
    const int64_t j0 = begin * kColumnBlock, cols = std::min(out, stop * kColumnBlock) - j0;
    rows_product<kRows>(x, n, in, w + j0, out, y + j0, out, cols);
  });
}

void row_product(const float* x, int64_t in, const float* w, int64_t out, float* y) {
  rows_product<1>(x, 1, in, w, out, y);
}

// ---- a draft step's one-row products on bf16 weight panels -----------------------------------------------------
// A draft step is a few one-row products over the draft head's weights (fc, its layer and its
// head), which sit just past the core's own cache: the step waits on them. The draft only proposes (the
// target's verification decides every token), so its weights may be rounded: here they are kept in bf16 as panels
// of 64 columns, each (in, 64) contiguous (`pack_panels`), half the bytes, read in storage order and widened to fp32
// in registers, where one input row (fp32) sums a panel's columns over two interleaved halves of the input. The
// target's own steps keep fp32 `row_product`: their products stay exactly as they were.
constexpr int64_t kPanelWidth = 64;

// w (in, out) row-major fp32 -> (ceil(out / width), in, width) fp32 panels, each `width` columns contiguous over the
// input, the columns past `out` zero.
at::Tensor pack_columns(const at::Tensor& w, int64_t width, const char* op) {
  check_f32_contiguous(w, "a weight to pack");
  TORCH_CHECK(w.dim() == 2, "litevlm_cpu: ", op, " takes an (in, out) weight");
  const int64_t in = w.size(0), out = w.size(1), count = (out + width - 1) / width;
  at::Tensor packed = at::zeros({count, in, width}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t p = 0; p < count; ++p) {
    const int64_t cols = std::min(width, out - p * width);
    for (int64_t k = 0; k < in; ++k) std::copy_n(src + k * out + p * width, cols, dst + (p * in + k) * width);
  }
  return packed;
}

// w (in, out) row-major fp32 -> (ceil(out / 64), in, 64) bf16, the columns past `out` zero.
at::Tensor pack_panels_op(const at::Tensor& w) { return pack_columns(w, kPanelWidth, "pack_panels").to(at::kBFloat16); }

#if defined(__AVX512F__)
constexpr bool kPanelsBuilt = true;

// 16 bf16 values -> fp32 (exact: a bf16 is the top half of an fp32).
inline __m512 widen(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// y (out,) += x (in,) @ the weight packed as bf16 `panels`.
void panel_row(const float* x, int64_t in, const uint16_t* panels, int64_t out, float* y) {
  for (int64_t p = 0; p * kPanelWidth < out; ++p) {
    const uint16_t* panel = panels + p * in * kPanelWidth;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t k = 0;
    for (; k + 2 <= in; k += 2) {
      const uint16_t* w0 = panel + k * kPanelWidth;
      const uint16_t* w1 = w0 + kPanelWidth;
      const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
      a0 = _mm512_fmadd_ps(x0, widen(w0), a0);
      a1 = _mm512_fmadd_ps(x0, widen(w0 + 16), a1);
      a2 = _mm512_fmadd_ps(x0, widen(w0 + 32), a2);
      a3 = _mm512_fmadd_ps(x0, widen(w0 + 48), a3);
      b0 = _mm512_fmadd_ps(x1, widen(w1), b0);
      b1 = _mm512_fmadd_ps(x1, widen(w1 + 16), b1);
      b2 = _mm512_fmadd_ps(x1, widen(w1 + 32), b2);
      b3 = _mm512_fmadd_ps(x1, widen(w1 + 48), b3);
    }
    if (k < in) {
      const uint16_t* w0 = panel + k * kPanelWidth;
      const __m512 x0 = _mm512_set1_ps(x[k]);
      a0 = _mm512_fmadd_ps(x0, widen(w0), a0);
      a1 = _mm512_fmadd_ps(x0, widen(w0 + 16), a1);
      a2 = _mm512_fmadd_ps(x0, widen(w0 + 32), a2);
      a3 = _mm512_fmadd_ps(x0, widen(w0 + 48), a3);
    }
    alignas(64) float sums[kPanelWidth];
    _mm512_store_ps(sums, _mm512_add_ps(a0, b0));
    _mm512_store_ps(sums + 16, _mm512_add_ps(a1, b1));
    _mm512_store_ps(sums + 32, _mm512_add_ps(a2, b2));
    _mm512_store_ps(sums + 48, _mm512_add_ps(a3, b3));
    const int64_t col = p * kPanelWidth, cols = std::min(kPanelWidth, out - col);
    for (int64_t j = 0; j < cols; ++j) y[col + j] += sums[j];
  }
}
// R rows of x (row stride in) times one bf16 panel (in, 64) -> their 64 columns of y (row stride out; the `cols`
// that exist), added to y. Not inlined: inside a larger function the compiler keeps the accumulators' home on the
// stack and stores all of them at every step.
template <int R>
__attribute__((noinline)) void panel_block(const float* x, int64_t in, const uint16_t* panel, int64_t cols, float* y,
                                           int64_t out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    const uint16_t* wk = panel + k * kPanelWidth;
    const __m512 w0 = widen(wk), w1 = widen(wk + 16), w2 = widen(wk + 32), w3 = widen(wk + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * in + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
    }
  }
  alignas(64) float sums[kPanelWidth];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) _mm512_store_ps(sums + 16 * v, acc[r][v]);
    for (int64_t j = 0; j < cols; ++j) y[r * out + j] += sums[j];
  }
}

// y (n, out) += x (n, in) @ the weight packed as bf16 `panels`, six rows at a time.
void panel_rows(const float* x, int64_t n, int64_t in, const uint16_t* panels, int64_t out, float* y) {
  for (int64_t p = 0; p * kPanelWidth < out; ++p) {
    const uint16_t* panel = panels + p * in * kPanelWidth;
    const int64_t col = p * kPanelWidth, cols = std::min(kPanelWidth, out - col);
    for (int64_t r = 0; r < n; r += 6) {
      const float* xr = x + r * in;
      float* yr = y + r * out + col;
      switch (std::min<int64_t>(6, n - r)) {
        case 6: panel_block<6>(xr, in, panel, cols, yr, out); break;
        case 5: panel_block<5>(xr, in, panel, cols, yr, out); break;
        case 4: panel_block<4>(xr, in, panel, cols, yr, out); break;
        case 3: panel_block<3>(xr, in, panel, cols, yr, out); break;
        case 2: panel_block<2>(xr, in, panel, cols, yr, out); break;
        default: panel_block<1>(xr, in, panel, cols, yr, out); break;
      }
    }
  }
}
#else
constexpr bool kPanelsBuilt = false;
#endif

bool panels_built_op() { return kPanelsBuilt; }

// An (n, out) fp32 tensor holding a product's base, for the product to add into: the bias (out,) in every row, the
// (n, out) base itself, or zeros where base is undefined.
at::Tensor based(const at::Tensor& base, int64_t n, int64_t out, const at::TensorOptions& options) {
  at::Tensor y = at::empty({n, out}, options);
  float* yp = y.data_ptr<float>();
  if (!base.defined()) {
    std::fill_n(yp, n * out, 0.f);
    return y;
  }
  check_f32_contiguous(base, "a product's base");
  TORCH_CHECK(base.numel() == out || base.numel() == n * out, "litevlm_cpu: a product's base does not match it");
  for (int64_t r = 0; r < n; ++r) std::copy_n(base.data_ptr<float>() + (base.numel() == out ? 0 : r * out), out, yp + r * out);
  return y;
}

// base + x (n, in) @ w (in, out) by the own loop at any n (fp32): row r's result is the one x[r] alone would get.
at::Tensor exact_product(const at::Tensor& base, const at::Tensor& x, const at::Tensor& w) {
  const at::Tensor xc = x.contiguous();
  check_f32_contiguous(xc, "a product's input");
  check_f32_contiguous(w, "a product's weight");
  const int64_t n = xc.size(0), out = w.size(1);
  at::Tensor y = based(base.defined() ? base.contiguous() : base, n, out, xc.options());
  if (n == 1) {
    row_product(xc.data_ptr<float>(), xc.size(1), w.data_ptr<float>(), out, y.data_ptr<float>());
  } else {
    rows_product<0>(xc.data_ptr<float>(), n, xc.size(1), w.data_ptr<float>(), out, y.data_ptr<float>());
  }
  return y;
}

// ---- the target's products on fp32 panels ----------------------------------------------------------------------
// A weight held row-major (in, out) is read by the own loop 32 columns at a time, one 128-byte piece of each of its
// `in` rows: a stride of a whole row between reads, which the core's prefetchers do not follow, so a decode step
// waited on each piece. The same weight packed as panels of 32 columns, each (in, 32) contiguous (`pack_panels32`),
// is read in storage order. The sums are the own loop's, element by element in the same order (block_product), so a
// product on the panels equals the one on the row-major weight bit for bit, at any row count.
constexpr int64_t kPanel32 = 32;

at::Tensor pack_panels32_op(const at::Tensor& w) { return pack_columns(w, kPanel32, "pack_panels32"); }

// R rows of y (row stride out; its `cols` columns that exist) += x (R, in) @ one panel (in, 32).
template <int64_t R>
void panel32_block(const float* x, int64_t in, const float* panel, int64_t cols, float* y, int64_t out) {
  if (cols == kPanel32) return block_product<R, kPanel32>(x, in, panel, kPanel32, y, out);
  float part[R * kPanel32] = {};
  for (int64_t r = 0; r < R; ++r) std::copy_n(y + r * out, cols, part + r * kPanel32);
  block_product<R, kPanel32>(x, in, panel, kPanel32, part, kPanel32);
  for (int64_t r = 0; r < R; ++r) std::copy_n(part + r * kPanel32, cols, y + r * out);
}

// y (n, out) += x (n, in) @ panels [p0, p1): each panel read once, serving every row, four rows at a time.
void panel32_rows(const float* x, int64_t n, int64_t in, const float* panels, int64_t out, float* y, int64_t p0,
                  int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = panels + p * in * kPanel32;
    const int64_t col = p * kPanel32, cols = std::min(kPanel32, out - col);
    int64_t r = 0;
    for (; r + 4 <= n; r += 4) panel32_block<4>(x + r * in, in, panel, cols, y + r * out + col, out);
    switch (n - r) {
      case 3: panel32_block<3>(x + r * in, in, panel, cols, y + r * out + col, out); break;
      case 2: panel32_block<2>(x + r * in, in, panel, cols, y + r * out + col, out); break;
      case 1: panel32_block<1>(x + r * in, in, panel, cols, y + r * out + col, out); break;
      default: break;
    }
  }
}

// base + x (n, in) @ the weight packed as fp32 `panels` (count, in, 32) -> (n, out), at any n: the own loop's sums.
at::Tensor panel32_product(const at::Tensor& base, const at::Tensor& x, const at::Tensor& panels, int64_t out) {
  const at::Tensor xc = x.contiguous();
  check_f32_contiguous(xc, "a product's input");
  check_f32_contiguous(panels, "a product's panels");
  const int64_t n = xc.size(0), in = xc.size(1), count = (out + kPanel32 - 1) / kPanel32;
  TORCH_CHECK(panels.dim() == 3 && panels.size(0) == count && panels.size(1) == in && panels.size(2) == kPanel32,
              "litevlm_cpu: the fp32 panels do not match their (", in, ", ", out, ") weight");
  at::Tensor y = based(base.defined() ? base.contiguous() : base, n, out, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (n * in * out < kParallelProductWork || at::get_num_threads() == 1) {
    panel32_rows(xp, n, in, pp, out, yp, 0, count);
  } else {
    at::parallel_for(0, count, 2, [&](int64_t begin, int64_t stop) { panel32_rows(xp, n, in, pp, out, yp, begin, stop); });
  }
  return y;
}

// base + x (n, in) @ w (in, out) -> (n, out): base a bias (out,) added to every row, an (n, out) tensor, or undefined
// (nothing added). panels: w packed by `pack_panels` (a draft head's weights, bf16), by `pack_panels32` (the target's,
// fp32: the own loop's sums up to kFewRows rows, BLAS beyond), or undefined.
at::Tensor product(const at::Tensor& base, const at::Tensor& x, const at::Tensor& w, const at::Tensor& panels = at::Tensor()) {
  const int64_t n = x.size(0), out = w.size(1);
  if (panels.defined() && panels.scalar_type() == at::kFloat) {
    if (n <= kFewRows) return panel32_product(base, x, panels, out);
    return base.defined() ? at::addmm(base, x, w) : at::mm(x, w);
  }
#if defined(__AVX512F__)
  if (panels.defined()) {
    TORCH_CHECK(panels.dim() == 3 && panels.size(0) == (out + kPanelWidth - 1) / kPanelWidth && panels.size(1) == w.size(0) &&
                    panels.size(2) == kPanelWidth && panels.is_contiguous() && panels.scalar_type() == at::kBFloat16,
                "litevlm_cpu: the weight panels do not match their (", w.size(0), ", ", out, ") weight");
    const at::Tensor xc = x.contiguous();
    check_f32_contiguous(xc, "a product's input");
    at::Tensor y = based(base.defined() ? base.contiguous() : base, n, out, x.options());
    float* yp = y.data_ptr<float>();
    const uint16_t* packed = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
    if (n == 1) {
      panel_row(xc.data_ptr<float>(), xc.size(1), packed, out, yp);
    } else {
      panel_rows(xc.data_ptr<float>(), n, xc.size(1), packed, out, yp);
    }
    return y;
  }
#endif
  const bool own = n <= kFewRows && x.is_contiguous() && w.is_contiguous() && x.scalar_type() == at::kFloat &&
                   w.scalar_type() == at::kFloat &&
                   (!base.defined() || (base.is_contiguous() && base.scalar_type() == at::kFloat &&
                                        (base.numel() == out || base.numel() == n * out)));
  if (!own) return base.defined() ? at::addmm(base, x, w) : at::mm(x, w);
  return exact_product(base, x, w);  // one dispatch: the base is copied in there, not by ATen
}

// `product` on its own (fp32 weights), for the tests: a few rows' products summed as one row's.
at::Tensor product_op(const std::optional<at::Tensor>& base, const at::Tensor& x, const at::Tensor& w) {
  return product(base.has_value() ? *base : at::Tensor(), x, w);
}

// base + x (n, in) @ w16 (in, out) with w16 a bf16 copy of the weight: x rounded to bf16 and multiplied in the CPU
// library's bf16 GEMM (AMX / AVX512-BF16, fp32 accumulation), the product returned in fp32 and the base added there.
// A prompt's products in bf16 mode (`prompt_layers` with bf16 weights); the residual stream stays fp32.
// The rows are padded to a multiple of 16: the CPU library builds a kernel for each new shape (which costs more than
// the product), and prompts come in every length (`VLM.set_bf16_matmul` builds the buckets' kernels up front).
constexpr int64_t kBf16RowBucket = 16;  // litevlm.model.layers.BF16_ROW_BUCKET

at::Tensor product_bf16(const at::Tensor& base, const at::Tensor& x, const at::Tensor& w16) {
  const int64_t m = x.size(0), pad = (kBf16RowBucket - m % kBf16RowBucket) % kBf16RowBucket;
  at::Tensor xb = x.to(at::kBFloat16);
  if (pad) xb = at::cat({xb, at::zeros({pad, x.size(1)}, xb.options())});
  at::Tensor y = at::mm(xb, w16).narrow(0, 0, m).to(at::kFloat);
  return base.defined() ? y.add_(base) : y;
}

// Which cached slots row r of a step may attend to.
struct Visible {
  const bool* mask = nullptr;  // (n, end) row-major, or null
  int64_t start = 0;
  bool causal = false;  // row r sees slots 0..start+r (a chain's tree mask)
  // A tree after a causal prompt: rows from tail_first on see the slots where their (tail rows, end) mask row allows
  const bool* tail_mask = nullptr;
  int64_t tail_first = 0;
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

// Below this many rows, a step's attention is two small GEMMs per KV head (a tree's verification, a draft's
// extension); from it on, a causal prompt's goes by blocks of rows through the same GEMMs, and any other (rows under
// a mask) is ATen's fused kernel.
constexpr int64_t kFusedAttentionRows = 64;
// A causal prompt's blocks of query rows, each over the slots up to its own last row: on drive-hd's 200-400 token
// prompts ATen's fused kernel reached about 40 GFLOP/s at one thread and gained little from a second, where the
// blocks' GEMMs run near the products' speed and over both threads.
constexpr int64_t kCausalBlockRows = 48;
static_assert(kCausalBlockRows < kFusedAttentionRows, "a causal block must take the few-rows path");

// Attention of n rows (their rotated queries in q_rows, one row every `width` floats; `first` is the first
// row's index among the step's tokens) over cached slots 0..end-1 -> y (n, hq d). One row: loops over the
// cache. A few rows: per KV head, the scores of its query heads' rows and their weighted values as two small
// GEMMs, the softmax between them. Many rows of a causal prompt (with or without a tree after it): blocks of a
// few rows. Many rows under a mask: ATen's fused attention.
void attend(const float* q_rows, int64_t width, int64_t n, int64_t first, const float* kc, const float* vc,
            int64_t slots, int64_t end, const Visible& visible, int64_t hq, int64_t hkv, int64_t d, float* y) {
  const int64_t group = hq / hkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  auto in_tail = [&](int64_t row_index) { return visible.tail_mask && row_index >= visible.tail_first; };
  auto top_of = [&](int64_t row_index) { return visible.causal && !in_tail(row_index) ? visible.start + row_index + 1 : end; };
  auto mask_of = [&](int64_t row_index) -> const bool* {
    if (in_tail(row_index)) return visible.tail_mask + (row_index - visible.tail_first) * end;
    return visible.mask ? visible.mask + row_index * end : nullptr;
  };
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
  if (n >= kFusedAttentionRows && visible.causal && !visible.mask) {
    // a causal prompt, a tree's rows after it by their mask (answer openings): blocks of kCausalBlockRows rows, each
    // over the slots up to its last row only (every slot for a block holding tree rows), by the few-rows path's two
    // GEMMs a KV head; the blocks' costs grow with their index, so a task takes block i and its mirror
    const int64_t blocks = (n + kCausalBlockRows - 1) / kCausalBlockRows;
    auto block = [&](int64_t b) {
      const int64_t r0 = b * kCausalBlockRows, rows = std::min(kCausalBlockRows, n - r0);
      attend(q_rows + r0 * width, width, rows, first + r0, kc, vc, slots, std::min(end, top_of(first + r0 + rows - 1)),
             visible, hq, hkv, d, y + r0 * hq * d);
    };
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t stop) {
      for (int64_t b = begin; b < stop; ++b) {
        block(b);
        if (blocks - 1 - b != b) block(blocks - 1 - b);
      }
    });
    return;
  }
  if (n >= kFusedAttentionRows) {
    // rows under a mask: ATen's fused attention (the softmax in its tiles, over the threads), reading the queries in
    // place and the cache's first `end` slots, GQA unexpanded
    at::Tensor q = at::from_blob(const_cast<float*>(q_rows), {1, hq, n, d}, {n * width, d, width, 1}, options);
    at::Tensor k = at::from_blob(const_cast<float*>(kc), {1, hkv, end, d}, {hkv * slots * d, slots * d, d, 1}, options);
    at::Tensor v = at::from_blob(const_cast<float*>(vc), {1, hkv, end, d}, {hkv * slots * d, slots * d, d, 1}, options);
    at::Tensor allowed = at::zeros({n, end}, options.dtype(at::kBool));
    bool* a = allowed.data_ptr<bool>();
    for (int64_t r = 0; r < n; ++r) {
      const int64_t top = top_of(first + r);
      const bool* mrow = mask_of(first + r);
      for (int64_t j = 0; j < top; ++j) a[r * end + j] = !mrow || mrow[j];
    }
    at::Tensor out = at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, std::nullopt, hq != hkv);
    at::from_blob(y, {1, hq, n, d}, {n * hq * d, d, hq * d, 1}, options).copy_(out);
    return;
  }
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

// One sequence's rows among a step's stacked rows: rows row0..row0+n-1 of x, written at its cache slots
// start..start+n-1 (its own caches), seeing what `visible` allows over slots 0..start+n-1.
struct Segment {
  int64_t row0 = 0, n = 0, start = 0;
  Visible visible;
};

// The rows of every segment through the layers -> (N, C) (or one row a segment with last_only). Each segment's rows
// write and read their own caches: caches holds, for segment s and layer i, K and V at (s * layers + i) * 2. The four
// products take the rows of all segments at once, so each weight is read once a step for every sequence. exact: the
// products run the own loop at any row count, whose sums for a row do not depend on the rows beside it, so a
// sequence's results are the same whatever else is in the batch (BLAS may round a larger product otherwise).
// cos / sin: one (D,) row per row of x (its RoPE position).
at::Tensor run_segments(at::Tensor x, const std::vector<const float*>& cos_rows, const std::vector<const float*>& sin_rows,
                        const std::vector<Segment>& segs, at::TensorList weights, at::TensorList caches, int64_t hq,
                        int64_t hkv, int64_t d, double eps, bool last_only, at::TensorList bf16 = {},
                        at::TensorList panels = {}, bool exact = false) {
  const int64_t layers = weights.size() / kWeightsPerLayer;
  const int64_t nseg = segs.size();
  TORCH_CHECK(bf16.empty() || static_cast<int64_t>(bf16.size()) == 4 * layers,
              "litevlm_cpu: bf16 weights must hold 4 tensors per layer (q|k|v, o, gate|up, down)");
  // the layer's four products: in fp32 (own loop, panels or BLAS), or in bf16 where bf16 copies of the weights are given
  TORCH_CHECK(panels.empty() || static_cast<int64_t>(panels.size()) == 4 * layers,
              "litevlm_cpu: weight panels must hold 4 tensors per layer (q|k|v, o, gate|up, down)");
  auto mul = [&bf16, &panels, exact](int64_t layer, int64_t which, const at::Tensor& base, const at::Tensor& in,
                                     const at::Tensor& w) {
    if (!bf16.empty()) return product_bf16(base, in, bf16[layer * 4 + which]);
    const at::Tensor p = panels.empty() ? at::Tensor() : panels[layer * 4 + which];
    if (exact) return p.defined() && p.scalar_type() == at::kFloat ? panel32_product(base, in, p, w.size(1)) : exact_product(base, in, w);
    return product(base, in, w, p);
  };
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer && layers > 0,
              "litevlm_cpu: weights must hold 7 tensors per layer");
  TORCH_CHECK(nseg > 0 && static_cast<int64_t>(caches.size()) == nseg * layers * kCachesPerLayer,
              "litevlm_cpu: caches must hold K and V per layer for each sequence");
  TORCH_CHECK(!last_only || layers == 1, "last_only runs one layer: the next layer would need every row");
  x = x.contiguous();
  check_f32_contiguous(x, "x");
  int64_t n = x.size(0);
  const int64_t c = x.size(1);
  const int64_t nqk = (hq + hkv) * d;
  std::vector<int64_t> seg_of(n, -1);
  for (int64_t s = 0; s < nseg; ++s) {
    TORCH_CHECK(segs[s].row0 >= 0 && segs[s].n > 0 && segs[s].row0 + segs[s].n <= n,
                "litevlm_cpu: a sequence's rows run past the step's");
    for (int64_t r = segs[s].row0; r < segs[s].row0 + segs[s].n; ++r) seg_of[r] = s;
  }

  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor& in_norm = weights[i * kWeightsPerLayer + 0];
    const at::Tensor& qkv_w = weights[i * kWeightsPerLayer + 1];
    const at::Tensor& qkv_b = weights[i * kWeightsPerLayer + 2];
    const at::Tensor& o_w = weights[i * kWeightsPerLayer + 3];
    const at::Tensor& post_norm = weights[i * kWeightsPerLayer + 4];
    const at::Tensor& gate_up = weights[i * kWeightsPerLayer + 5];
    const at::Tensor& down = weights[i * kWeightsPerLayer + 6];
    std::vector<float*> kcs(nseg), vcs(nseg);
    std::vector<int64_t> slots(nseg);
    for (int64_t s = 0; s < nseg; ++s) {
      const at::Tensor& k_cache = caches[(s * layers + i) * kCachesPerLayer];
      const at::Tensor& v_cache = caches[(s * layers + i) * kCachesPerLayer + 1];
      check_f32_contiguous(k_cache, "the K cache");
      check_f32_contiguous(v_cache, "the V cache");
      slots[s] = k_cache.size(2);
      TORCH_CHECK(segs[s].start + segs[s].n <= slots[s], "litevlm_cpu: slots ", segs[s].start, "..",
                  segs[s].start + segs[s].n - 1, " run past the cache (", slots[s], ")");
      kcs[s] = k_cache.data_ptr<float>();
      vcs[s] = v_cache.data_ptr<float>();
    }

    at::Tensor xn = x;
    if (in_norm.numel() > 0) {
      xn = at::empty_like(x);
      rms_norm_rows(x.data_ptr<float>(), in_norm.data_ptr<float>(), xn.data_ptr<float>(), n, c, eps);
    }
    TORCH_CHECK(qkv_w.size(1) == nqk + hkv * d, "litevlm_cpu: the packed q|k|v projection must be (C, ", nqk + hkv * d,
                ") without the rotated copies (cpu_steps.py's native wrappers cut them); got ", qkv_w.size(1), " columns");
    at::Tensor qkv = mul(i, 0, qkv_b, xn, qkv_w);  // (n, nqk + hkv d): [q k | v]
    const int64_t width = qkv.size(1);
    const int64_t half_d = d / 2;
    float* qkv_p = qkv.data_ptr<float>();
    // RoPE in place over q|k, x * cos + rotate_half(x) * sin per head, then the cache writes.
    at::parallel_for(0, n, kRowGrain, [&](int64_t begin, int64_t stop) {
      for (int64_t r = begin; r < stop; ++r) {
        float* row = qkv_p + r * width;
        const float* cs = cos_rows[r];
        const float* sn = sin_rows[r];
        for (int64_t h = 0; h < hq + hkv; ++h) {
          float* q = row + h * d;
          for (int64_t j = 0; j < half_d; ++j) {
            const float a = q[j], b = q[j + half_d];
            q[j] = a * cs[j] - b * sn[j];
            q[j + half_d] = b * cs[j + half_d] + a * sn[j + half_d];
          }
        }
        const int64_t s = seg_of[r];
        if (s < 0) continue;
        const int64_t slot = segs[s].start + r - segs[s].row0;
        for (int64_t h = 0; h < hkv; ++h) {
          std::copy_n(row + (hq + h) * d, d, kcs[s] + (h * slots[s] + slot) * d);
          std::copy_n(row + nqk + h * d, d, vcs[s] + (h * slots[s] + slot) * d);
        }
      }
    });
    const int64_t out_rows = last_only ? nseg : n;
    at::Tensor y = at::empty({out_rows, hq * d}, x.options());
    float* y_p = y.data_ptr<float>();
    auto attend_segment = [&](int64_t s) {
      const Segment& g = segs[s];
      const int64_t end = g.start + g.n;
      if (last_only) {
        attend(qkv_p + (g.row0 + g.n - 1) * width, width, 1, g.n - 1, kcs[s], vcs[s], slots[s], end, g.visible, hq,
               hkv, d, y_p + s * hq * d);
      } else {
        attend(qkv_p + g.row0 * width, width, g.n, 0, kcs[s], vcs[s], slots[s], end, g.visible, hq, hkv, d,
               y_p + g.row0 * hq * d);
      }
    };
    if (nseg == 1) {
      attend_segment(0);
    } else {
      at::parallel_for(0, nseg, 1, [&](int64_t begin, int64_t stop) {
        for (int64_t s = begin; s < stop; ++s) attend_segment(s);
      });
    }
    if (last_only) {
      std::vector<int64_t> last(nseg);
      for (int64_t s = 0; s < nseg; ++s) last[s] = segs[s].row0 + segs[s].n - 1;
      x = nseg == 1 ? x.slice(0, n - 1, n) : x.index_select(0, at::tensor(last, at::kLong)).contiguous();
      n = nseg;
    }
    x = mul(i, 1, x, y, o_w);
    at::Tensor xn2 = at::empty_like(x);
    rms_norm_rows(x.data_ptr<float>(), post_norm.data_ptr<float>(), xn2.data_ptr<float>(), n, c, eps);
    at::Tensor gu = mul(i, 2, at::Tensor(), xn2, gate_up);  // (n, 2I)
    const int64_t half = gu.size(1) / 2;
    at::Tensor act = at::empty({n, half}, x.options());
    const float* gu_p = gu.data_ptr<float>();
    float* act_p = act.data_ptr<float>();
    at::parallel_for(0, n, kRowGrain, [&](int64_t begin, int64_t stop) {
      for (int64_t r = begin; r < stop; ++r) {
        const float* gate = gu_p + r * 2 * half;
        float* a = act_p + r * half;
        for (int64_t j = 0; j < half; ++j) a[j] = -gate[j];
        exp_inplace(a, half);
        for (int64_t j = 0; j < half; ++j) a[j] = gate[j] / (1.f + a[j]) * gate[half + j];
      }
    });
    x = mul(i, 3, x, act, down);
  }
  return x;
}

// n tokens of one sequence at cache slots start..start+n-1 through the layers -> (n, C) (or (1, C) with last_only).
// cos / sin: one (D,) row per token (its RoPE position).
at::Tensor run_layers(at::Tensor x, const std::vector<const float*>& cos_rows, const std::vector<const float*>& sin_rows,
                      int64_t start, const Visible& visible, at::TensorList weights, at::TensorList caches, int64_t hq,
                      int64_t hkv, int64_t d, double eps, bool last_only, at::TensorList bf16 = {},
                      at::TensorList panels = {}) {
  Segment one;
  one.n = x.size(0);
  one.start = start;
  one.visible = visible;
  return run_segments(x, cos_rows, sin_rows, {one}, weights, caches, hq, hkv, d, eps, last_only, bf16, panels);
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

// The target's fp32 panels as the steps take them (`pack_panels32`): 4 per layer (q|k|v, o, gate|up, down), then the
// LM head's; or none (the products then read the row-major weights).
struct TargetPanels {
  at::TensorList layers;
  at::Tensor head;
};

TargetPanels target_panels(at::TensorList panels, at::TensorList weights) {
  if (panels.empty()) return {};
  const int64_t layers = static_cast<int64_t>(weights.size()) / kWeightsPerLayer;
  TORCH_CHECK(static_cast<int64_t>(panels.size()) == 4 * layers + 1,
              "litevlm_cpu: the target's panels must hold 4 tensors per layer and the head's");
  return {panels.slice(0, 4 * layers), panels[4 * layers]};
}

at::Tensor layers_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t start,
                     const std::optional<at::Tensor>& mask, at::TensorList weights, at::TensorList caches, int64_t hq,
                     int64_t hkv, int64_t d, double eps, bool last_only, at::TensorList panels) {
  Visible visible;
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->to(at::kBool).contiguous();
    const int64_t n = x.size(0);
    TORCH_CHECK(m.numel() == n * (start + n), "litevlm_cpu: the mask must be (1, 1, n, start + n)");
    visible.mask = m.data_ptr<bool>();
  }
  return run_layers(x, rows_of(cos, x.size(0)), rows_of(sin, x.size(0)), start, visible, weights, caches, hq, hkv, d, eps,
                    last_only, {}, target_panels(panels, weights).layers);
}

// The index of a row's largest logit (the first where several are equal).
int64_t row_argmax(const float* l, int64_t v) {
  int64_t arg = 0;
  for (int64_t j = 1; j < v; ++j)
    if (l[j] > l[arg]) arg = j;
  return arg;
}

// A row of draft logits' most likely token and its log-probability: (log p, index into the draft vocabulary).
std::pair<float, int64_t> top1_row(const float* l, int64_t v) {
  const int64_t arg = row_argmax(l, v);
  float total = 0.f;
  for (int64_t j = 0; j < v; ++j) total += std::exp(l[j] - l[arg]);
  return {-std::log(total), arg};
}

// The most likely draft token after a feature and its log-probability (`top1_row`).
std::pair<float, int64_t> top1(const at::Tensor& hidden, const at::Tensor& head, const at::Tensor& head_panels) {
  at::Tensor logits = product(at::Tensor(), hidden, head, head_panels);  // (1, V')
  return top1_row(logits.data_ptr<float>(), logits.size(1));
}

at::Tensor chain_op(const at::Tensor& root_hidden, int64_t position, int64_t start, int64_t depth, double log_min,
                    int64_t eos, const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& embed,
                    const at::Tensor& fc_w, const at::Tensor& fc_b, const at::Tensor& head, const at::Tensor& vocab_map,
                    at::TensorList weights, at::TensorList caches, int64_t hq, int64_t hkv, int64_t d, double eps,
                    at::TensorList panels) {
  // panels: empty, or [fc, head, then q|k|v, o, gate|up, down of each layer] packed by `pack_panels`
  TORCH_CHECK(panels.empty() || static_cast<int64_t>(panels.size()) == 2 + 4 * static_cast<int64_t>(weights.size()) / kWeightsPerLayer,
              "litevlm_cpu: a draft's panels must hold fc, the head and 4 tensors per layer");
  const at::Tensor fc_panels = panels.empty() ? at::Tensor() : panels[0];
  const at::Tensor head_panels = panels.empty() ? at::Tensor() : panels[1];
  const at::TensorList layer_panels = panels.empty() ? at::TensorList() : panels.slice(2);
  check_f32_contiguous(embed, "the embedding");
  const int64_t c = embed.size(1);
  const bool mapped = vocab_map.numel() > 0;
  at::Tensor map = mapped ? vocab_map.to(at::kLong).contiguous() : vocab_map;
  auto target_id = [&](int64_t idx) { return mapped ? map.data_ptr<int64_t>()[idx] : idx; };
  auto [value, idx] = top1(root_hidden.contiguous(), head, head_panels);
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
    at::Tensor x = product(fc_b, pair, fc_w, fc_panels);
    const int64_t pos = position + i;
    hidden = run_layers(x, rows_at(cos_table, &pos, 1), rows_at(sin_table, &pos, 1), start + i, Visible{}, weights,
                        caches, hq, hkv, d, eps, false, {}, layer_panels);
    auto [step_value, step_idx] = top1(hidden, head, head_panels);
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
                          int64_t hkv, int64_t d, double eps, at::TensorList panels) {
  at::Tensor x = product(fc_b, at::cat({nxt, feats}, -1), fc_w, panels.empty() ? at::Tensor() : panels[0]);
  at::Tensor pos = pair_pos.to(at::kLong).contiguous();
  const int64_t m = pos.numel();
  at::Tensor h_root = run_layers(x, rows_at(cos_table, pos.data_ptr<int64_t>(), m),
                                 rows_at(sin_table, pos.data_ptr<int64_t>(), m), done, Visible{}, weights, caches, hq,
                                 hkv, d, eps, true, {}, panels.empty() ? at::TensorList() : panels.slice(2));
  at::Tensor drafted = chain_op(h_root, root_pos, done + feats.size(0), depth, log_min, eos, cos_table, sin_table,
                                embed, fc_w, fc_b, head, vocab_map, weights, caches, hq, hkv, d, eps, panels);
  return at::cat({root.to(at::kLong).view({1}), drafted});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_chain_op(
    const at::Tensor& tokens, int64_t start, int64_t root_pos, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& embed, at::TensorList weights, at::TensorList caches, int64_t hq, int64_t hkv, int64_t d,
    double eps, const at::Tensor& norm_w, const at::Tensor& head, at::TensorList panels) {
  const TargetPanels tp = target_panels(panels, weights);
  at::Tensor toks = tokens.to(at::kLong).contiguous();
  const int64_t n = toks.numel();
  const int64_t* t = toks.data_ptr<int64_t>();
  std::vector<int64_t> pos(n);
  for (int64_t r = 0; r < n; ++r) pos[r] = root_pos + r;
  Visible causal;
  causal.causal = true;
  causal.start = start;
  at::Tensor x = run_layers(embed.index_select(0, toks), rows_at(cos_table, pos.data(), n),
                            rows_at(sin_table, pos.data(), n), start, causal, weights, caches, hq, hkv, d, eps, false, {},
                            tp.layers);
  const int64_t c = x.size(1);
  at::Tensor xn = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), norm_w.contiguous().data_ptr<float>(), xn.data_ptr<float>(), n, c, eps);
  at::Tensor logits = product(at::Tensor(), xn, head, tp.head);  // (n, V)
  const int64_t v = logits.size(1);
  const float* l = logits.data_ptr<float>();
  std::vector<int64_t> pred(n);
  for (int64_t r = 0; r < n; ++r) pred[r] = row_argmax(l + r * v, v);
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
                                                    const at::Tensor& norm_w, const at::Tensor& head,
                                                    at::TensorList panels) {
  const TargetPanels tp = target_panels(panels, weights);
  at::Tensor x = run_layers(embed.index_select(0, token.to(at::kLong).view({1})), rows_at(cos_table, &position, 1),
                            rows_at(sin_table, &position, 1), slot, Visible{}, weights, caches, hq, hkv, d, eps, false,
                            {}, tp.layers);
  at::Tensor xn = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), norm_w.contiguous().data_ptr<float>(), xn.data_ptr<float>(), 1, x.size(1), eps);
  return {product(at::Tensor(), xn, head, tp.head), xn};
}

// ---- steps of several sequences at once ---------------------------------------------------------------------
// The rows of B sequences stacked into each product (the weights read once a step for all of them), each sequence
// writing and attending over its own caches (`run_segments`; caches: K and V per layer, sequence after sequence).
// The products run the own loop at any row count, so each sequence's numbers are those it gets alone.

std::vector<int64_t> long_values(const at::Tensor& t, const char* what, int64_t n) {
  at::Tensor c = t.to(at::kLong).contiguous();
  TORCH_CHECK(c.numel() == n, "litevlm_cpu: ", what, " must hold ", n, " values; got ", c.numel());
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + n);
}

// The final norm and the LM head over rows x (n, C) -> (logits (n, V), normed rows (n, C)).
std::pair<at::Tensor, at::Tensor> head_rows(const at::Tensor& x, const at::Tensor& norm_w, const at::Tensor& head, double eps,
                                            const at::Tensor& head_panels) {
  at::Tensor xn = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), norm_w.contiguous().data_ptr<float>(), xn.data_ptr<float>(), x.size(0), x.size(1), eps);
  if (head_panels.defined()) return {panel32_product(at::Tensor(), xn, head_panels, head.size(1)), xn};
  return {exact_product(at::Tensor(), xn, head), xn};
}

// One decode step of B sequences: tokens (B,) at positions (B,), written at slots (B,) of their own caches ->
// (logits (B, V), hidden (B, C) after the final norm).
std::tuple<at::Tensor, at::Tensor> batch_decode_op(const at::Tensor& tokens, const at::Tensor& positions,
                                                   const at::Tensor& slots, const at::Tensor& cos_table,
                                                   const at::Tensor& sin_table, const at::Tensor& embed,
                                                   at::TensorList weights, at::TensorList caches, int64_t hq, int64_t hkv,
                                                   int64_t d, double eps, const at::Tensor& norm_w, const at::Tensor& head,
                                                   at::TensorList panels) {
  const TargetPanels tp = target_panels(panels, weights);
  const int64_t b = tokens.numel();
  const auto pos = long_values(positions, "positions", b);
  const auto at_slot = long_values(slots, "slots", b);
  std::vector<Segment> segs(b);
  for (int64_t s = 0; s < b; ++s) {
    segs[s].row0 = s;
    segs[s].n = 1;
    segs[s].start = at_slot[s];
  }
  at::Tensor x = run_segments(embed.index_select(0, tokens.to(at::kLong).view({b})), rows_at(cos_table, pos.data(), b),
                              rows_at(sin_table, pos.data(), b), segs, weights, caches, hq, hkv, d, eps, false, {}, tp.layers,
                              true);
  auto [logits, xn] = head_rows(x, norm_w, head, eps, tp.head);
  return {logits, xn};
}

// `verify_chain` for B sequences: their chains (root + drafts) stacked in tokens (N,), counts (B,) tokens each, the
// chain of sequence s at slots starts[s].. and positions root_pos[s].. -> (the emitted tokens of every sequence, one
// run after another (N',), each run's length (B,) = its accepted drafts + 1, and for those N' pairs the normed features,
// next embeddings and positions the draft extends with).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_verify_chain_op(
    const at::Tensor& tokens, const at::Tensor& counts, const at::Tensor& starts, const at::Tensor& root_pos,
    const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& embed, at::TensorList weights,
    at::TensorList caches, int64_t hq, int64_t hkv, int64_t d, double eps, const at::Tensor& norm_w,
    const at::Tensor& head, at::TensorList panels) {
  const TargetPanels tp = target_panels(panels, weights);
  at::Tensor toks = tokens.to(at::kLong).contiguous();
  const int64_t n = toks.numel();
  const int64_t b = counts.numel();
  const auto count = long_values(counts, "counts", b);
  const auto start = long_values(starts, "starts", b);
  const auto root = long_values(root_pos, "root positions", b);
  std::vector<Segment> segs(b);
  std::vector<int64_t> pos(n);
  int64_t row = 0;
  for (int64_t s = 0; s < b; ++s) {
    segs[s].row0 = row;
    segs[s].n = count[s];
    segs[s].start = start[s];
    segs[s].visible.causal = true;
    segs[s].visible.start = start[s];
    for (int64_t r = 0; r < count[s]; ++r) pos[row + r] = root[s] + r;
    row += count[s];
  }
  TORCH_CHECK(row == n, "litevlm_cpu: the chains' counts sum to ", row, " but ", n, " tokens were given");
  at::Tensor x = run_segments(embed.index_select(0, toks), rows_at(cos_table, pos.data(), n),
                              rows_at(sin_table, pos.data(), n), segs, weights, caches, hq, hkv, d, eps, false, {}, tp.layers,
                              true);
  auto [logits, xn] = head_rows(x, norm_w, head, eps, tp.head);
  const int64_t v = logits.size(1);
  const float* l = logits.data_ptr<float>();
  const int64_t* t = toks.data_ptr<int64_t>();
  std::vector<int64_t> emitted, kept_rows, kept_pos, runs(b);
  for (int64_t s = 0; s < b; ++s) {
    const int64_t r0 = segs[s].row0;
    int64_t a = 0;
    int64_t pred = row_argmax(l + r0 * v, v);
    while (a + 1 < count[s] && t[r0 + a + 1] == pred) {
      ++a;
      pred = row_argmax(l + (r0 + a) * v, v);
    }
    for (int64_t j = 1; j <= a; ++j) emitted.push_back(t[r0 + j]);
    emitted.push_back(pred);
    for (int64_t j = 0; j <= a; ++j) {
      kept_rows.push_back(r0 + j);
      kept_pos.push_back(root[s] + j);
    }
    runs[s] = a + 1;
  }
  at::Tensor out = at::tensor(emitted, at::kLong);
  return {out, at::tensor(runs, at::kLong), xn.index_select(0, at::tensor(kept_rows, at::kLong)),
          embed.index_select(0, out), at::tensor(kept_pos, at::kLong)};
}

// `draft_cycle` for B sequences: sequence s's new pairs (counts[s] rows of feats / nxt / pair_pos, stacked) into its
// draft cache at dones[s].., then a chain of at most depths[s] drafts from its root (0: none) at positions root_pos[s]..
// -> (B, 1 + max depth): the root, the drafts, -1 past a chain's end. A chain stops at a draft below log_min or at eos
// (as `chain`), each sequence on its own; the layer's products take every live chain's row at once.
at::Tensor batch_draft_cycle_op(const at::Tensor& feats, const at::Tensor& nxt, const at::Tensor& pair_pos,
                                const at::Tensor& counts, const at::Tensor& dones, const at::Tensor& roots,
                                const at::Tensor& root_pos, const at::Tensor& depths, double log_min, int64_t eos,
                                const at::Tensor& cos_table, const at::Tensor& sin_table, const at::Tensor& embed,
                                const at::Tensor& fc_w, const at::Tensor& fc_b, const at::Tensor& head,
                                const at::Tensor& vocab_map, at::TensorList weights, at::TensorList caches, int64_t hq,
                                int64_t hkv, int64_t d, double eps, at::TensorList panels) {
  TORCH_CHECK(panels.empty() || static_cast<int64_t>(panels.size()) == 2 + 4 * static_cast<int64_t>(weights.size()) / kWeightsPerLayer,
              "litevlm_cpu: a draft's panels must hold fc, the head and 4 tensors per layer");
  const at::Tensor fc_panels = panels.empty() ? at::Tensor() : panels[0];
  const at::Tensor head_panels = panels.empty() ? at::Tensor() : panels[1];
  const at::TensorList layer_panels = panels.empty() ? at::TensorList() : panels.slice(2);
  const int64_t b = counts.numel();
  const auto count = long_values(counts, "counts", b);
  const auto done = long_values(dones, "dones", b);
  const auto root = long_values(roots, "roots", b);
  const auto rpos = long_values(root_pos, "root positions", b);
  const auto depth = long_values(depths, "depths", b);
  check_f32_contiguous(embed, "the embedding");
  const int64_t c = embed.size(1);
  const bool mapped = vocab_map.numel() > 0;
  at::Tensor map = mapped ? vocab_map.to(at::kLong).contiguous() : vocab_map;
  auto target_id = [&](int64_t idx) { return mapped ? map.data_ptr<int64_t>()[idx] : idx; };

  // the new pairs: every sequence's rows through the layer, the last row of each going on (its predicted feature)
  at::Tensor ppos = pair_pos.to(at::kLong).contiguous();
  const int64_t m = ppos.numel();
  std::vector<Segment> segs(b);
  int64_t row = 0;
  for (int64_t s = 0; s < b; ++s) {
    TORCH_CHECK(count[s] > 0, "litevlm_cpu: every sequence extends its draft by at least one pair");
    segs[s].row0 = row;
    segs[s].n = count[s];
    segs[s].start = done[s];
    row += count[s];
  }
  TORCH_CHECK(row == m, "litevlm_cpu: the pairs' counts sum to ", row, " but ", m, " pairs were given");
  at::Tensor x = product(fc_b, at::cat({nxt, feats}, -1).contiguous(), fc_w, fc_panels);
  at::Tensor hidden = run_segments(x, rows_at(cos_table, ppos.data_ptr<int64_t>(), m),
                                   rows_at(sin_table, ppos.data_ptr<int64_t>(), m), segs, weights, caches, hq, hkv, d,
                                   eps, true, {}, layer_panels);  // (B, C)

  int64_t width = 1;
  for (int64_t s = 0; s < b; ++s) width = std::max(width, 1 + depth[s]);
  at::Tensor out = at::full({b, width}, -1, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t s = 0; s < b; ++s) o[s * width] = root[s];
  std::vector<float> value(b, 0.f);
  std::vector<int64_t> tok(b, -1), live;  // live: the sequences still drafting, in order
  auto top_rows = [&](const at::Tensor& h, const std::vector<int64_t>& who, int64_t level) {
    at::Tensor logits = product(at::Tensor(), h, head, head_panels);  // (rows, V')
    const int64_t v = logits.size(1);
    const float* l = logits.data_ptr<float>();
    for (size_t i = 0; i < who.size(); ++i) {
      const int64_t s = who[i];
      const auto [log_p, arg] = top1_row(l + i * v, v);
      value[s] += log_p;
      tok[s] = target_id(arg);
      o[s * width + 1 + level] = tok[s];
    }
  };
  for (int64_t s = 0; s < b; ++s)
    if (depth[s] > 0) live.push_back(s);
  if (live.empty()) return out;
  at::Tensor h_rows = hidden.index_select(0, at::tensor(live, at::kLong)).contiguous();  // live rows' features
  top_rows(h_rows, live, 0);
  for (int64_t level = 0;; ++level) {
    std::vector<int64_t> next, keep;
    for (size_t i = 0; i < live.size(); ++i) {
      const int64_t s = live[i];
      if (level + 1 >= depth[s] || value[s] < log_min || tok[s] == eos) continue;
      TORCH_CHECK(tok[s] >= 0 && tok[s] < embed.size(0), "litevlm_cpu: drafted token ", tok[s], " is outside the embedding");
      next.push_back(s);
      keep.push_back(static_cast<int64_t>(i));
    }
    if (next.empty()) break;
    const int64_t k = next.size();
    at::Tensor pair = at::empty({k, 2 * c}, embed.options());
    float* p = pair.data_ptr<float>();
    const float* hp = h_rows.data_ptr<float>();
    std::vector<int64_t> pos(k);
    std::vector<Segment> step(k);
    std::vector<at::Tensor> step_caches;
    const int64_t per = static_cast<int64_t>(caches.size()) / b;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t s = next[i];
      std::copy_n(embed.data_ptr<float>() + tok[s] * c, c, p + i * 2 * c);
      std::copy_n(hp + keep[i] * c, c, p + i * 2 * c + c);
      pos[i] = rpos[s] + level;
      step[i].row0 = i;
      step[i].n = 1;
      step[i].start = done[s] + count[s] + level;
      for (int64_t j = 0; j < per; ++j) step_caches.push_back(caches[s * per + j]);
    }
    at::Tensor xs = product(fc_b, pair, fc_w, fc_panels);
    h_rows = run_segments(xs, rows_at(cos_table, pos.data(), k), rows_at(sin_table, pos.data(), k), step, weights,
                          step_caches, hq, hkv, d, eps, false, {}, layer_panels);
    top_rows(h_rows, next, level + 1);
    live = next;
  }
  return out;
}

// A prompt of one sequence written at cache slots 0..n-1, causally (row r sees slots 0..r): a prefill, or a
// pruned prefill's layers -> (n, C), before any final norm. tail_mask (m, n): the last m rows are a tree after the
// prompt instead (answer openings), row i of them seeing the slots where tail_mask[i] is true.
at::Tensor prompt_layers_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                            at::TensorList caches, int64_t hq, int64_t hkv, int64_t d, double eps, at::TensorList bf16,
                            const std::optional<at::Tensor>& tail_mask) {
  Visible causal;
  causal.causal = true;
  at::Tensor tail;
  if (tail_mask.has_value()) {
    tail = tail_mask->to(at::kBool).contiguous();
    const int64_t n = x.size(0);
    TORCH_CHECK(tail.dim() == 2 && tail.size(1) == n && tail.size(0) <= n,
                "litevlm_cpu: the tree mask after a prompt must be (tree rows, prompt + tree rows)");
    causal.tail_mask = tail.data_ptr<bool>();
    causal.tail_first = n - tail.size(0);
  }
  return run_layers(x, rows_of(cos, x.size(0)), rows_of(sin, x.size(0)), 0, causal, weights, caches, hq, hkv, d, eps,
                    false, bf16);
}

// ---- the ViewSelector's inference (litevlm.select.views), one question --------------------------------------
// Its layers are tiny (width 64, a question of ~10-40 words): as ATen ops each costs more in dispatch than in
// arithmetic, so everything here, from the hashed word ids to the logits, is plain loops over fp32 rows, with the
// weights packed into one buffer (`ViewSelector._native`) so that a call passes three tensors.

// y (rows, out) = x (rows, in) Wt + b, Wt (in, out) row-major (nn.Linear's weight.t()): the bias in every row, then
// the few-rows product (`rows_product`, on the calling thread: these layers are too small to split).
void linear_into(const float* x, int64_t rows, int64_t in, const float* wt, int64_t out, const float* b, float* y) {
  for (int64_t r = 0; r < rows; ++r) std::copy(b, b + out, y + r * out);
  rows_product<0>(x, rows, in, wt, out, y, out, out);
}

void layer_norm_into(const float* x, int64_t rows, int64_t c, const float* w, const float* b, double eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    float mean = 0.f, var = 0.f;
    for (int64_t j = 0; j < c; ++j) mean += xr[j];
    mean /= static_cast<float>(c);
    for (int64_t j = 0; j < c; ++j) var += (xr[j] - mean) * (xr[j] - mean);
    const float inv = 1.f / std::sqrt(var / static_cast<float>(c) + static_cast<float>(eps));
    for (int64_t j = 0; j < c; ++j) y[r * c + j] = (xr[j] - mean) * inv * w[j] + b[j];
  }
}

// Exact GELU as nn.GELU(), x * Phi(x), vectorised: erf by Abramowitz & Stegun 7.1.26 (absolute error below
// 1.5e-7) with exp_inplace for its Gaussian factor. `scratch` holds count floats.
void gelu_inplace(float* x, int64_t count, float* scratch) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    const float z = x[i] * 0.70710678118654752f;
    scratch[i] = -z * z;
  }
  exp_inplace(scratch, count);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    const float z = std::fabs(x[i]) * 0.70710678118654752f;
    const float t = 1.f / (1.f + 0.3275911f * z);
    const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    const float erf_abs = 1.f - poly * scratch[i];
    const float erf = x[i] < 0.f ? -erf_abs : erf_abs;
    x[i] = 0.5f * x[i] * (1.f + erf);
  }
}

// p[j] = exp(q . k_j * scale - max) over `count` keys k_j of d floats, one every `stride` floats -> the sum of p:
// a softmax row, left for the caller to normalise.
float exp_scores(const float* q, const float* keys, int64_t stride, int64_t count, int64_t d, float scale, float* p) {
  float best = -INFINITY;
  for (int64_t j = 0; j < count; ++j) {
    const float* kj = keys + j * stride;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < d; ++e) s += q[e] * kj[e];
    p[j] = s * scale;
    best = std::max(best, p[j]);
  }
  for (int64_t j = 0; j < count; ++j) p[j] -= best;
  exp_inplace(p, count);
  float total = 0.f;
  for (int64_t j = 0; j < count; ++j) total += p[j];
  return total;
}

// Multi-head attention of nq query rows q (nq, C) over t rows k, v (t, C), every key visible -> y (nq, C).
// q, k, v may sit inside wider rows: one row every q_stride / kv_stride floats.
void mha_into(const float* q, int64_t q_stride, const float* k, const float* v, int64_t kv_stride, int64_t nq,
              int64_t t, int64_t c, int64_t heads, float* y) {
  const int64_t d = c / heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> p(t);
  std::fill(y, y + nq * c, 0.f);
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const float total = exp_scores(q + i * q_stride + h * d, k + h * d, kv_stride, t, d, scale, p.data());
      float* yi = y + i * c + h * d;
      for (int64_t j = 0; j < t; ++j) {
        const float* vj = v + j * kv_stride + h * d;
        const float pj = p[j] / total;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) yi[e] += pj * vj[e];
      }
    }
  }
}

// The ViewSelector's forward (`ViewSelector.forward` in inference) for one question with no padding:
//   ids (T, K) int64, each word's hashed bucket ids with 0 as padding; lexical (N,) the lexical map (1 = named);
//   packed: the weights, in `ViewSelector._native_pack`'s order, every linear weight transposed to (in, out):
//     embed (buckets, C), pos (max_words, C), latents (N, C), lexical_query (2, C),
//     per layer: norm1 w b, in_proj (C, 3C) b, out_proj (C, C) b, norm2 w b, linear1 (C, F) b, linear2 (F, C) b,
//     norm w b, latent_norm w b, cross in_proj q rows (C, C), its k|v rows (C, 2C), in_proj b, cross out_proj (C, C) b,
//     head norm w b,
//     head linear (C, C) b, head linear (C, 1) b
// -> logits (1, N).
at::Tensor view_logits_op(const at::Tensor& ids_in, const at::Tensor& lexical_in, const at::Tensor& packed,
                          int64_t layers, int64_t c, int64_t f, int64_t heads, int64_t buckets, int64_t max_words,
                          double eps) {
  check_f32_contiguous(packed, "the ViewSelector's packed weights");
  const at::Tensor ids_t = ids_in.to(at::kLong).contiguous();
  const at::Tensor lex_t = lexical_in.to(at::kFloat).contiguous();
  TORCH_CHECK(ids_t.dim() == 2 && ids_t.size(0) >= 1 && ids_t.size(0) <= max_words,
              "litevlm_cpu: view_logits takes (T, K) word ids with 1 <= T <= max_words");
  TORCH_CHECK(c % heads == 0, "litevlm_cpu: view_logits heads must divide the width");
  const int64_t t = ids_t.size(0), kk = ids_t.size(1), n = lex_t.numel();
  const int64_t per_layer = 9 * c + 3 * c * c + c * c + 2 * c * f + f;
  const int64_t tail_size = 12 * c + 5 * c * c + 1;
  TORCH_CHECK(packed.numel() == (buckets + max_words + n + 2) * c + layers * per_layer + tail_size,
              "litevlm_cpu: view_logits packed weights do not match the config");
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const float* lex = lex_t.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  const float* embed = w;
  const float* pos = embed + buckets * c;
  const float* latents = pos + max_words * c;
  const float* lexq = latents + n * c;
  const float* cur = lexq + 2 * c;
  auto take = [&cur](int64_t size) {
    const float* p = cur;
    cur += size;
    return p;
  };

  // the words: the mean of each word's bucket embeddings (padding excluded), plus its position
  std::vector<float> x(t * c, 0.f);
  for (int64_t i = 0; i < t; ++i) {
    float* xi = x.data() + i * c;
    int64_t count = 0;
    for (int64_t j = 0; j < kk; ++j) {
      const int64_t id = ids[i * kk + j];
      TORCH_CHECK(id >= 0 && id < buckets, "litevlm_cpu: view_logits word id out of range");
      if (id == 0) continue;
      ++count;
      const float* e = embed + id * c;
      for (int64_t e_i = 0; e_i < c; ++e_i) xi[e_i] += e[e_i];
    }
    const float inv = count ? 1.f / static_cast<float>(count) : 0.f;
    for (int64_t e_i = 0; e_i < c; ++e_i) xi[e_i] = xi[e_i] * inv + pos[i * c + e_i];
  }
  // the latent queries: one per camera, offset where the lexical map named it or named another camera
  float named_any = 0.f;
  for (int64_t v = 0; v < n; ++v) named_any += lex[v];
  std::vector<float> q(n * c);
  for (int64_t v = 0; v < n; ++v) {
    const float other = (named_any > 0.f ? 1.f : 0.f) * (1.f - lex[v]);
    for (int64_t e_i = 0; e_i < c; ++e_i)
      q[v * c + e_i] = latents[v * c + e_i] + lex[v] * lexq[e_i] + other * lexq[c + e_i];
  }

  const int64_t rows = std::max(t, n);
  const int64_t wide = std::max(f, c);  // the encoder's FFN and the head's hidden layer share a buffer
  std::vector<float> h(rows * c), qkv(rows * 3 * c), y(rows * c), o(rows * c), ff(rows * wide), scratch(rows * wide);
  for (int64_t l = 0; l < layers; ++l) {  // pre-norm encoder layers
    const float *n1w = take(c), *n1b = take(c), *in_w = take(c * 3 * c), *in_b = take(3 * c), *out_w = take(c * c),
                *out_b = take(c), *n2w = take(c), *n2b = take(c), *l1w = take(c * f), *l1b = take(f),
                *l2w = take(f * c), *l2b = take(c);
    layer_norm_into(x.data(), t, c, n1w, n1b, eps, h.data());
    linear_into(h.data(), t, c, in_w, 3 * c, in_b, qkv.data());
    mha_into(qkv.data(), 3 * c, qkv.data() + c, qkv.data() + 2 * c, 3 * c, t, t, c, heads, y.data());
    linear_into(y.data(), t, c, out_w, c, out_b, o.data());
    for (int64_t i = 0; i < t * c; ++i) x[i] += o[i];
    layer_norm_into(x.data(), t, c, n2w, n2b, eps, h.data());
    linear_into(h.data(), t, c, l1w, f, l1b, ff.data());
    gelu_inplace(ff.data(), t * f, scratch.data());
    linear_into(ff.data(), t, f, l2w, c, l2b, o.data());
    for (int64_t i = 0; i < t * c; ++i) x[i] += o[i];
  }
  const float *nw = take(c), *nb = take(c), *lnw = take(c), *lnb = take(c), *wq = take(c * c), *wkv = take(c * 2 * c),
              *cin_b = take(3 * c), *cout_w = take(c * c), *cout_b = take(c), *hnw = take(c), *hnb = take(c),
              *h1w = take(c * c), *h1b = take(c), *h2w = take(c), *h2b = take(1);
  layer_norm_into(x.data(), t, c, nw, nb, eps, h.data());  // the encoder's output norm: the keys' rows
  std::vector<float> ql(n * c), qp(n * c), kv(t * 2 * c);
  layer_norm_into(q.data(), n, c, lnw, lnb, eps, ql.data());
  // the cross-attention's in-projection: q from the latents, k and v from the words
  linear_into(ql.data(), n, c, wq, c, cin_b, qp.data());
  linear_into(h.data(), t, c, wkv, 2 * c, cin_b + c, kv.data());
  mha_into(qp.data(), c, kv.data(), kv.data() + c, 2 * c, n, t, c, heads, y.data());
  linear_into(y.data(), n, c, cout_w, c, cout_b, o.data());
  for (int64_t i = 0; i < n * c; ++i) q[i] += o[i];
  layer_norm_into(q.data(), n, c, hnw, hnb, eps, h.data());
  linear_into(h.data(), n, c, h1w, c, h1b, ff.data());
  gelu_inplace(ff.data(), n * c, scratch.data());
  std::vector<float> logits(n);
  linear_into(ff.data(), n, c, h2w, 1, h2b, logits.data());
  return at::tensor(logits, at::kFloat).view({1, n});
}

// ---- the TokenSelector's scoring head (litevlm.select.tokens), one prompt --------------------------------------

// The head's weights w = [norm, W_q (C, 2 Hq D + 1) = [q | rot q | gate], b_q, W_k (C, Hkv D), b_k, last bonus (1),
// head logits (Hq), W1 token half (C, hidden), b1, W1 context half (hidden, C), w2 (hidden), b2 (1), tag weights (2)],
// all contiguous fp32; cos / sin (T, D) at the prompt's positions; tags (2, N) or empty; the question is rows
// first_row..T-1 and the visual tokens sit at prompt indices `vis`.

// out = a * cos + rotate_half(a) * sin over one head's d values (RoPE into another place; out does not overlap a).
inline void rope_into(const float* a, const float* cr, const float* sr, int64_t d, float* out) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t e = 0; e < half; ++e) out[e] = a[e] * cr[e] - a[e + half] * sr[e];
#pragma omp simd
  for (int64_t e = half; e < d; ++e) out[e] = a[e] * cr[e] + a[e - half] * sr[e];
}

// The head's scores from its products: hq_rows (n, C) the question rows through the head's RMSNorm, keys (T, Hkv D)
// every row's head keys (bias included, RoPE not yet applied), pre (first_row, hidden) every row before the question
// through the token half of the content MLP's first layer (no bias) -> log-scores (N,) of the visual tokens `vis`.
at::Tensor head_scores(const at::Tensor& hq_rows, const at::Tensor& keys, at::Tensor pre_t, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t first_row, const at::Tensor& vis_t, const at::Tensor& tags,
                       at::TensorList w, int64_t hq, int64_t hkv, int64_t d) {
  const int64_t n = hq_rows.size(0), c = hq_rows.size(1), t = first_row + n, nv = vis_t.numel(), g = hq / hkv;
  const int64_t hidden = w[7].size(1);
  TORCH_CHECK(first_row >= 1 && n >= 1 && cos.size(0) == t && cos.size(1) == d && keys.size(0) == t &&
                  pre_t.size(0) == first_row && pre_t.size(1) == hidden,
              "litevlm_cpu: token_scores shapes");
  TORCH_CHECK(w[1].size(1) == 2 * hq * d + 1 && w[3].size(1) == hkv * d, "litevlm_cpu: token_scores projections");
  const int64_t* vis = vis_t.data_ptr<int64_t>();
  for (int64_t j = 0; j < nv; ++j) TORCH_CHECK(vis[j] >= 0 && vis[j] < first_row, "litevlm_cpu: a visual index past the views");
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const float* hp = hq_rows.data_ptr<float>();
  at::Tensor qg = at::addmm(w[2], hq_rows, w[1]);  // (n, 2 Hq D + 1)
  const int64_t qw = qg.size(1);
  float* qp = qg.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)  // RoPE: a * cos + rot(a) * sin, the rotation folded into the weights
    for (int64_t e = 0; e < hq * d; ++e)
      qp[i * qw + e] = qp[i * qw + e] * cs[(first_row + i) * d + e % d] + qp[i * qw + hq * d + e] * sn[(first_row + i) * d + e % d];
  // the keys' RoPE with rot = rotate_half applied here, into (Hkv, T, D): one batched matmul reads them transposed
  at::Tensor kh = at::empty({hkv, t, d}, hq_rows.options());
  const float* kp = keys.data_ptr<float>();
  const int64_t kstride = keys.stride(0);
  float* khp = kh.data_ptr<float>();
  for (int64_t m = 0; m < hkv; ++m)
    for (int64_t r = 0; r < t; ++r) {
      rope_into(kp + r * kstride + m * d, cs + r * d, sn + r * d, d, khp + (m * t + r) * d);
    }
  // the query rows grouped by kv head, row i * G + g of group m = query head m * G + g of row i
  at::Tensor qh = qg.slice(1, 0, hq * d).view({n, hkv, g, d}).permute({1, 0, 2, 3}).reshape({hkv, n * g, d});
  at::Tensor logits = at::bmm(qh, kh.transpose(1, 2)).contiguous();  // (Hkv, n G, T)
  float* lp = logits.data_ptr<float>();

  // row pooling beta (softmax of the gates, the last row's with its bonus) and the head weights
  std::vector<float> beta(n), head_w(hq);
  for (int64_t i = 0; i < n; ++i) beta[i] = qp[i * qw + 2 * hq * d] + (i == n - 1 ? w[5].data_ptr<float>()[0] : 0.f);
  auto softmax = [](std::vector<float>& v) {
    const float best = *std::max_element(v.begin(), v.end());
    float total = 0.f;
    for (float& a : v) total += (a = std::exp(a - best));
    for (float& a : v) a /= total;
  };
  softmax(beta);
  std::copy_n(w[6].data_ptr<float>(), hq, head_w.data());
  softmax(head_w);

  // mix_j = sum over heads m and rows i of head_w[m] beta[i] softmax_keys(q_i^m . k^m / sqrt(d))[vis_j], summed over
  // every key in `pooled` (contiguous, vectorised) and read at the visual tokens once
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> pooled(t, 0.f);
  for (int64_t m = 0; m < hkv; ++m)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t top = first_row + i + 1;  // causal: row first_row + i sees keys 0..first_row + i
      for (int64_t gg = 0; gg < g; ++gg) {
        float* p = lp + ((m * n + i) * g + gg) * t;
        float best = -INFINITY;
        for (int64_t j = 0; j < top; ++j) best = std::max(best, p[j] *= scale);
        for (int64_t j = 0; j < top; ++j) p[j] -= best;
        exp_inplace(p, top);
        float total = 0.f;
        for (int64_t j = 0; j < top; ++j) total += p[j];
        const float coef = head_w[m * g + gg] * beta[i] / total;
        float* acc = pooled.data();
#pragma omp simd
        for (int64_t j = 0; j < top; ++j) acc[j] += coef * p[j];
      }
    }
  // the content MLP on [norm(h_j), context], its first layer split into the token half (`pre`, over every row before
  // the question: the visual tokens and the few text tokens between the views, which costs less than gathering the
  // visual rows) and the context half, added here with the bias
  std::vector<float> ctx(c, 0.f), pre_ctx(hidden);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t e = 0; e < c; ++e) ctx[e] += beta[i] * hp[i * c + e];
  const float* w1c = w[9].data_ptr<float>();  // (hidden, C)
  for (int64_t u = 0; u < hidden; ++u) {
    float acc = w[8].data_ptr<float>()[u];
    for (int64_t e = 0; e < c; ++e) acc += w1c[u * c + e] * ctx[e];
    pre_ctx[u] = acc;
  }
  at::Tensor act = at::empty({first_row, hidden}, hq_rows.options());
  float* pre = act.data_ptr<float>();
  const float* pre_in = pre_t.data_ptr<float>();
  const int64_t pstride = pre_t.stride(0);
  for (int64_t j = 0; j < first_row; ++j)
    for (int64_t u = 0; u < hidden; ++u) pre[j * hidden + u] = pre_in[j * pstride + u] + pre_ctx[u];
  std::vector<float> scratch(first_row * hidden);
  gelu_inplace(pre, first_row * hidden, scratch.data());
  const float* w2 = w[10].data_ptr<float>();
  const float b2 = w[11].data_ptr<float>()[0];
  const bool tagged = tags.numel() > 0;
  at::Tensor tags_c = tagged ? tags.to(at::kFloat).contiguous() : tags;
  TORCH_CHECK(!tagged || (tags_c.size(0) == 2 && tags_c.size(1) == nv), "litevlm_cpu: token_scores tags must be (2, N)");
  const float* tw = w[12].data_ptr<float>();
  at::Tensor out = at::empty({nv}, hq_rows.options());
  float* o = out.data_ptr<float>();
  for (int64_t j = 0; j < nv; ++j) {
    float s = b2;
    const float* pj = pre + vis[j] * hidden;
    for (int64_t u = 0; u < hidden; ++u) s += pj[u] * w2[u];
    s += std::log(pooled[vis[j]] + 1e-9f);
    if (tagged) s += tw[0] * tags_c.data_ptr<float>()[j] + tw[1] * tags_c.data_ptr<float>()[nv + j];
    o[j] = s;
  }
  return out;
}

void check_head_inputs(at::TensorList w, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(w.size() == 13, "litevlm_cpu: token_scores takes 13 weights");
  for (const auto& t : w) check_f32_contiguous(t, "a TokenSelector weight");
  check_f32_contiguous(cos, "cos");
  check_f32_contiguous(sin, "sin");
}

// `_head_ops` of litevlm/select/tokens.py: the head on the prompt x (T, C) as it reads it (the views as they enter the decoder or layer 0's output, the
// question rows from `first_row` on) -> log-scores (N,).
at::Tensor token_scores_op(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, int64_t first_row,
                           const at::Tensor& vis_in, const at::Tensor& tags, at::TensorList w, int64_t hq, int64_t hkv,
                           int64_t d, double eps) {
  check_head_inputs(w, cos, sin);
  const at::Tensor x = x_in.contiguous();
  check_f32_contiguous(x, "x");
  const int64_t t = x.size(0), c = x.size(1);
  TORCH_CHECK(first_row >= 1 && first_row < t, "litevlm_cpu: token_scores needs question rows after the views");
  at::Tensor h = at::empty({t, c}, x.options());
  rms_norm_rows(x.data_ptr<float>(), w[0].data_ptr<float>(), h.data_ptr<float>(), t, c, eps);
  return head_scores(h.slice(0, first_row, t), at::addmm(w[4], h, w[3]), at::mm(h.slice(0, 0, first_row), w[7]), cos,
                     sin, first_row, vis_in.to(at::kLong).contiguous(), tags, w, hq, hkv, d);
}

// A prompt-reading TokenSelector at inference, in one call: the prompt's embeddings x (T, C), the question from
// `first_row` on. Every row before the question meets one product, `fused` (C, 2 Hkv D + Hkv D + hidden): decoder
// layer 0's keys and values and the head's keys and token-half MLP, their RMSNorm weights folded in (each row is
// scaled by its own 1 / rms first), `fused_bias` beside it; layer 0's keys and values go to the scratch `caches`
// (one layer's K and V for T slots), and the question rows alone then run through layer 0 (`layer`: its 7 weights,
// q|k|v unrotated) over them, and through the head's norm -> log-scores (N,), as `token_scores` of the prompt the
// head reads (`TokenSelector.prompt_view`).
at::Tensor prompt_scores_op(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, int64_t first_row,
                            const at::Tensor& vis_in, const at::Tensor& tags, at::TensorList layer, at::TensorList caches,
                            at::TensorList w, const at::Tensor& fused, const at::Tensor& fused_bias, int64_t hq,
                            int64_t hkv, int64_t d, double eps) {
  check_head_inputs(w, cos, sin);
  TORCH_CHECK(static_cast<int64_t>(layer.size()) == kWeightsPerLayer && layer[0].numel() > 0,
              "litevlm_cpu: prompt_scores takes one decoder layer with its input norm");
  check_f32_contiguous(fused, "the fused products");
  check_f32_contiguous(fused_bias, "the fused bias");
  const at::Tensor x = x_in.contiguous();
  check_f32_contiguous(x, "x");
  const int64_t t = x.size(0), c = x.size(1), kw = hkv * d, hidden = w[7].size(1);
  TORCH_CHECK(first_row >= 1 && first_row < t, "litevlm_cpu: prompt_scores needs question rows after the views");
  TORCH_CHECK(fused.size(0) == c && fused.size(1) == 3 * kw + hidden && fused_bias.numel() == fused.size(1),
              "litevlm_cpu: prompt_scores' fused product must be (C, 3 Hkv D + hidden)");
  const at::Tensor& k_cache = caches[0];
  const at::Tensor& v_cache = caches[1];
  check_f32_contiguous(k_cache, "the K cache");
  check_f32_contiguous(v_cache, "the V cache");
  const int64_t slots = k_cache.size(2);
  TORCH_CHECK(slots >= t, "litevlm_cpu: the scratch cache holds ", slots, " slots for ", t, " rows");

  // every row before the question, scaled by 1 / its rms (the norms' weights are in `fused`), in one product
  at::Tensor xs = at::empty({first_row, c}, x.options());
  rms_norm_rows(x.data_ptr<float>(), nullptr, xs.data_ptr<float>(), first_row, c, eps);
  at::Tensor prod = at::addmm(fused_bias, xs, fused);  // (first_row, [k v | head k | token MLP])
  const int64_t width = prod.size(1);
  const float* pp = prod.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  at::parallel_for(0, first_row, kRowGrain, [&](int64_t begin, int64_t stop) {  // layer 0's K (RoPE) and V, cached
    for (int64_t r = begin; r < stop; ++r) {
      const float* row = pp + r * width;
      const float* cr = cs + r * d;
      const float* sr = sn + r * d;
      for (int64_t h = 0; h < hkv; ++h) {
        rope_into(row + h * d, cr, sr, d, kc + (h * slots + r) * d);
        std::copy_n(row + kw + h * d, d, vc + (h * slots + r) * d);
      }
    }
  });
  // the question rows through layer 0 over the cached rows before them and themselves, then the head's norm
  Visible causal;
  causal.causal = true;
  causal.start = first_row;
  const std::vector<const float*> cos_rows = rows_of(cos, t), sin_rows = rows_of(sin, t);
  at::Tensor q_out = run_layers(x.slice(0, first_row, t), {cos_rows.begin() + first_row, cos_rows.end()},
                                {sin_rows.begin() + first_row, sin_rows.end()}, first_row, causal, layer, caches, hq,
                                hkv, d, eps, false);
  const int64_t n = t - first_row;
  at::Tensor hq_rows = at::empty({n, c}, x.options());
  rms_norm_rows(q_out.data_ptr<float>(), w[0].data_ptr<float>(), hq_rows.data_ptr<float>(), n, c, eps);
  at::Tensor keys = at::cat({prod.slice(1, 2 * kw, 3 * kw), at::addmm(w[4], hq_rows, w[3])});  // (T, Hkv D)
  return head_scores(hq_rows, keys, prod.slice(1, 3 * kw, 3 * kw + hidden), cos, sin, first_row,
                     vis_in.to(at::kLong).contiguous(), tags, w, hq, hkv, d);
}

}  // namespace

TORCH_LIBRARY(litevlm_cpu, m) {
  m.def("layers(Tensor x, Tensor cos, Tensor sin, int start, Tensor? mask, Tensor[] weights, Tensor[] caches, "
        "int hq, int hkv, int d, float eps, bool last_only=False, Tensor[] panels) -> Tensor",
        &layers_op);
  m.def("chain(Tensor root_hidden, int position, int start, int depth, float log_min, int eos, Tensor cos_table, "
        "Tensor sin_table, Tensor embed, Tensor fc_w, Tensor fc_b, Tensor head, Tensor vocab_map, Tensor[] weights, "
        "Tensor[] caches, int hq, int hkv, int d, float eps, Tensor[] panels) -> Tensor",
        &chain_op);
  m.def("draft_cycle(Tensor feats, Tensor nxt, Tensor pair_pos, int done, Tensor root, int root_pos, int depth, "
        "float log_min, int eos, Tensor cos_table, Tensor sin_table, Tensor embed, Tensor fc_w, Tensor fc_b, "
        "Tensor head, Tensor vocab_map, Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, float eps, "
        "Tensor[] panels) -> Tensor",
        &draft_cycle_op);
  m.def("verify_chain(Tensor tokens, int start, int root_pos, Tensor cos_table, Tensor sin_table, Tensor embed, "
        "Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, float eps, Tensor norm_w, Tensor head, "
        "Tensor[] panels) -> (Tensor, Tensor, Tensor, Tensor)",
        &verify_chain_op);
  m.def("decode_logits(Tensor token, int position, int slot, Tensor cos_table, Tensor sin_table, Tensor embed, "
        "Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, float eps, Tensor norm_w, Tensor head, "
        "Tensor[] panels) -> (Tensor, Tensor)",
        &decode_logits_op);
  m.def("batch_decode(Tensor tokens, Tensor positions, Tensor slots, Tensor cos_table, Tensor sin_table, "
        "Tensor embed, Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, float eps, Tensor norm_w, "
        "Tensor head, Tensor[] panels) -> (Tensor, Tensor)",
        &batch_decode_op);
  m.def("batch_verify_chain(Tensor tokens, Tensor counts, Tensor starts, Tensor root_pos, Tensor cos_table, "
        "Tensor sin_table, Tensor embed, Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, float eps, "
        "Tensor norm_w, Tensor head, Tensor[] panels) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        &batch_verify_chain_op);
  m.def("batch_draft_cycle(Tensor feats, Tensor nxt, Tensor pair_pos, Tensor counts, Tensor dones, Tensor roots, "
        "Tensor root_pos, Tensor depths, float log_min, int eos, Tensor cos_table, Tensor sin_table, Tensor embed, "
        "Tensor fc_w, Tensor fc_b, Tensor head, Tensor vocab_map, Tensor[] weights, Tensor[] caches, int hq, int hkv, "
        "int d, float eps, Tensor[] panels) -> Tensor",
        &batch_draft_cycle_op);
  m.def("prompt_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, Tensor[] caches, int hq, int hkv, int d, "
        "float eps, Tensor[] bf16, Tensor? tail_mask=None) -> Tensor",
        &prompt_layers_op);
  m.def("product(Tensor? base, Tensor x, Tensor w) -> Tensor", &product_op);
  m.def("pack_panels(Tensor w) -> Tensor", &pack_panels_op);
  m.def("pack_panels32(Tensor w) -> Tensor", &pack_panels32_op);
  m.def("panels_built() -> bool", &panels_built_op);
  m.def("token_scores(Tensor x, Tensor cos, Tensor sin, int first_row, Tensor vis, Tensor tags, Tensor[] weights, "
        "int hq, int hkv, int d, float eps) -> Tensor",
        &token_scores_op);
  m.def("prompt_scores(Tensor x, Tensor cos, Tensor sin, int first_row, Tensor vis, Tensor tags, Tensor[] layer, "
        "Tensor[] caches, Tensor[] weights, Tensor fused, Tensor fused_bias, int hq, int hkv, int d, float eps) -> Tensor",
        &prompt_scores_op);
  m.def("view_logits(Tensor ids, Tensor lexical, Tensor packed, int layers, int width, int ffn, int heads, "
        "int buckets, int max_words, float eps) -> Tensor",
        &view_logits_op);
}
