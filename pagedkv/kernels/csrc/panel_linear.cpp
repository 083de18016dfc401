// The panel-packed linear: pack_panels lays a weight out once, panel_linear runs y = x @ W^T
// (+ bias) from it; panel_isa names the path this build runs.
#include <ATen/Dispatch.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <array>
#include <optional>
#include <string>
#include <utility>

#include "common.h"
#include "ops.h"
#include "simd.h"

namespace pagedkv_cpu {

// ---- Panel linear: y = x @ W^T (+ bias), every linear of a model on CPU ------------------
//
// oneDNN's and MKL's GEMMs stream a weight at half the memory bandwidth or less when x has a
// few rows (a decode step is one pass over every weight). Here W [N, K] is packed once into
// panels of PANEL output columns, [ceil(N/PANEL)][K][PANEL] (zero-padded), so a panel is one
// contiguous stream; each thread takes whole panels, and for MR rows of x at a time keeps
// MR x PANEL float32 accumulators in registers while the panel streams past (from memory for
// the first MR rows, from cache after). 16-bit weights are widened in registers (exactly), so
// they stream half the bytes; with more than MR rows a panel is widened once into a float32
// scratch instead. Every product is a float32 FMA; x is widened to float32 once, and y is
// rounded once to x's dtype at the end. That is the 8-wide (AVX2) path, Zen 3's; where AVX-512
// is compiled in, the 16-wide path further down runs instead (PAGEDKV_CPU_ISA=avx2 builds the
// 8-wide one on an AVX-512 machine; panel_isa() says which a build runs).
namespace {

constexpr int64_t PANEL = 16;
constexpr int MR = 6;  // rows of x per pass: 2 x MR accumulators + 2 weight vectors <= 16 ymm

inline v8f fma8(v8f a, v8f b, v8f c) {  // a * b + c
#if defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline v8f widen8(const float* p) { return load8(p); }
inline v8f widen8(const c10::BFloat16* p) {
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  typedef uint32_t v8u32 __attribute__((vector_size(32)));
  v8u16 h;
  std::memcpy(&h, p, sizeof(h));
  return (v8f)(__builtin_convertvector(h, v8u32) << 16);
}
inline v8f widen8(const c10::Half* p) {
#if defined(__F16C__)
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v8f v;
  for (int i = 0; i < 8; i++) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// The build's panel path for weights of `dtype` (what pack_panels lays out and panel_linear runs).
enum class PanelPath { k8, k16, kBf16Dot };
PanelPath panel_path(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return PanelPath::kBf16Dot;
#endif
#if defined(__AVX512F__)
  return PanelPath::k16;
#else
  (void)dtype;
  return PanelPath::k8;
#endif
}

inline v8f bcast8(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

// rows x [R][k] (row stride ldx) times one panel wp [k][PANEL] -> y [R][nc] (row stride ldy).
// The accumulators are named values, never indexed at run time, so they stay in registers.
template <int R, typename wt>
inline void panel_rows(const float* x, int64_t ldx, const wt* wp, int64_t k, const float* bias,
                       float* y, int64_t ldy, int64_t nc) {
  v8f acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = v8f{};
  for (int64_t j = 0; j < k; j++) {
    const v8f w0 = widen8(wp + j * PANEL), w1 = widen8(wp + j * PANEL + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const v8f xb = bcast8(x[r * ldx + j]);
      acc[r][0] = fma8(w0, xb, acc[r][0]);
      acc[r][1] = fma8(w1, xb, acc[r][1]);
    }
  }
  float tile[R][PANEL];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) {
    store8(tile[r], acc[r][0]);
    store8(tile[r] + 8, acc[r][1]);
  }
  for (int r = 0; r < R; r++)
    for (int64_t c = 0; c < nc; c++)
      y[r * ldy + c] = tile[r][c] + (bias ? bias[c] : 0.f);
}

// All m rows of x [m][k] times one panel, MR rows at a time -> y columns [0, nc) (row stride ldy).
template <typename wt>
void panel_pass(const float* x, int64_t m, int64_t k, const wt* panel, const float* bias,
                float* y, int64_t ldy, int64_t nc) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) panel_rows<MR>(x + r * k, k, panel, k, bias, y + r * ldy, ldy, nc);
  const float* xr = x + r * k;
  float* yr = y + r * ldy;
  switch (m - r) {
    case 5: panel_rows<5>(xr, k, panel, k, bias, yr, ldy, nc); break;
    case 4: panel_rows<4>(xr, k, panel, k, bias, yr, ldy, nc); break;
    case 3: panel_rows<3>(xr, k, panel, k, bias, yr, ldy, nc); break;
    case 2: panel_rows<2>(xr, k, panel, k, bias, yr, ldy, nc); break;
    case 1: panel_rows<1>(xr, k, panel, k, bias, yr, ldy, nc); break;
    default: break;
  }
}

template <typename wt>
void panel_linear_impl(const at::Tensor& x, const at::Tensor& panels, const float* bias,
                        at::Tensor& y, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), np = panels.size(0);
  const float* xp = x.data_ptr<float>();
  const wt* wp = panels.data_ptr<wt>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, np, 1, [&](int64_t b, int64_t e) {
    std::vector<float> wide;  // a 16-bit panel widened once, when more than MR rows reuse it
    for (int64_t p = b; p < e; p++) {
      const wt* panel = wp + p * k * PANEL;
      float* yq = yp + p * PANEL;
      const int64_t nc = std::min(PANEL, n - p * PANEL);
      const float* bq = bias ? bias + p * PANEL : nullptr;
      if (std::is_same_v<wt, float> || m <= MR) {
        panel_pass(xp, m, k, panel, bq, yq, n, nc);
      } else {
        wide.resize(k * PANEL);
        for (int64_t j = 0; j < k * PANEL; j += 8) store8(wide.data() + j, widen8(panel + j));
        panel_pass(xp, m, k, static_cast<const float*>(wide.data()), bq, yq, n, nc);
      }
    }
  });
}

#if defined(__AVX512F__)
// ---- 16-wide panels (AVX-512): one zmm per panel row ----------------------------------------
// A tile is R <= MR16 rows of x times P <= NP16 adjacent panels: R x P zmm accumulators (24 of
// the 32 registers), P weight vectors loaded once per K step (kept in registers, the next lines
// prefetched) and R broadcasts of x, so the panels stream past once per 6 rows (once per step
// at 1-6 rows) and each broadcast feeds 4 products. float32 and float16 weights (and bfloat16
// without AVX512-BF16) are widened to float32 in registers and multiplied by float32 x with
// FMAs, as on the 8-wide path. bfloat16 weights on AVX512-BF16 use the paired layout of
// pack_panels and vdpbf16ps: one instruction adds two K steps' products (x's bfloat16 pair
// broadcast) into float32 accumulators, so x must be bfloat16 itself (panel_linear takes x in
// the weights' dtype: nothing is rounded that was not already). Against the 8-wide float32
// FMAs this adds vdpbf16ps's own rules: bfloat16 subnormal inputs read as zero and subnormal
// sums are flushed (DAZ/FTZ, whatever MXCSR says), and the pair's two products are added to
// the accumulator as one step; y is rounded once to bfloat16, as before.
constexpr int MR16 = 6, NP16 = 4;
constexpr int64_t ROW_CHUNK16 = 16 * MR16;  // rows per task (at most) when rows are split
constexpr int64_t X_IN_CACHE16 = 256 << 10;  // bytes of x that stay in a core's L2 for a pass
constexpr int64_t PREFETCH16 = 16;  // K steps ahead a panel is prefetched (a line per step)

inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One K step (a pair of steps for bfloat16 x) of the tile's R x P accumulators; x row r at
// x + r * ldx, panel q at wp + q * pstride.
template <int R, int P, typename xt, typename wt>
inline void tile_step(__m512 (&acc)[R][P], const xt* x, int64_t ldx, const wt* wp,
                      int64_t pstride, int64_t s) {
  if constexpr (std::is_same_v<xt, c10::BFloat16>) {
#if defined(__AVX512BF16__)
    __m512bh w[P];
#pragma GCC unroll 4
    for (int q = 0; q < P; q++)
    {
      const wt* at = wp + q * pstride + s * 2 * PANEL;
      _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH16 * 2 * PANEL), _MM_HINT_T0);
      w[q] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(at));
      asm("" : "+v"(w[q]));  // one load per step, not one per row
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * s, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int q = 0; q < P; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], w[q], xb);
    }
#endif
  } else {
    __m512 w[P];
#pragma GCC unroll 4
    for (int q = 0; q < P; q++) {
      const wt* at = wp + q * pstride + s * PANEL;
      _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH16 * PANEL), _MM_HINT_T0);
      w[q] = widen16(at);
      asm("" : "+v"(w[q]));  // one load per step, not one per row
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + s]);
#pragma GCC unroll 4
      for (int q = 0; q < P; q++) acc[r][q] = _mm512_fmadd_ps(w[q], xb, acc[r][q]);
    }
  }
}

// Store the first `cols` of v + b at p in wt (the weights' and x's dtype): rounded to nearest
// even once, as Tensor.to does (vcvtneps2bf16 also flushes float32 subnormals to zero).
inline void store16(float* p, __m512 v, __mmask16 cols) { _mm512_mask_storeu_ps(p, cols, v); }
inline void store16(c10::Half* p, __m512 v, __mmask16 cols) {
  _mm256_mask_storeu_epi16(p, cols, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 cols) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, cols, (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float f[PANEL];
  _mm512_store_ps(f, v);
  for (int c = 0; c < PANEL; c++)
    if (cols >> c & 1) p[c] = from_f<c10::BFloat16>(f[c]);
#endif
}

// R rows of x times P panels over `steps` K steps, plus bias [nc] when given -> y [R][nc] in wt
// (row stride ldy; nc <= P * 16 columns are real, the rest padding).
template <int R, int P, typename xt, typename wt>
void panel_tile16(const xt* x, int64_t ldx, const wt* wp, int64_t pstride, int64_t steps,
                  const float* bias, wt* y, int64_t ldy, int64_t nc) {
  __m512 acc[R][P];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int q = 0; q < P; q++) acc[r][q] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; s++) tile_step<R, P>(acc, x, ldx, wp, pstride, s);
  // Unrolled whole, so acc is only ever indexed by constants and stays in registers (a loop
  // with a run-time bound kept a copy of acc on the stack: zeroed, stored and reloaded per
  // tile, 3% of a 2,048-row product on Zen 4).
#pragma GCC unroll 4
  for (int q = 0; q < P; q++) {
    const int64_t cols = std::clamp<int64_t>(nc - q * PANEL, 0, PANEL);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + q * PANEL) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) store16(y + r * ldy + q * PANEL, _mm512_add_ps(acc[r][q], b), mask);
  }
}

template <typename xt, typename wt>
using Tile16 = void (*)(const xt*, int64_t, const wt*, int64_t, int64_t, const float*, wt*,
                        int64_t, int64_t);

// Every (R, P) instance of panel_tile16, indexed [(R - 1) * NP16 + P - 1].
template <typename xt, typename wt, int... I>
constexpr std::array<Tile16<xt, wt>, sizeof...(I)> tile16_table(std::integer_sequence<int, I...>) {
  return {&panel_tile16<I / NP16 + 1, I % NP16 + 1, xt, wt>...};
}

// y [m][n] (in wt) = x [m][ldx] times np panels (`steps` K steps each, pstride elements apart)
// + bias. Tasks are (group of NP16 panels, chunk of <= ROW_CHUNK16 rows; chunks even), group-
// major while x fits in cache (each weight read from memory once), chunk-major for a large x
// (a chunk of x stays in cache while every panel streams past it). A chunk's rows are dealt
// evenly to its tiles (8 rows: 4 + 4, not 6 + 2). Writes y only.
template <typename xt, typename wt>
void panel_linear16(const xt* xp, int64_t m, int64_t ldx, const wt* wp, int64_t np,
                    int64_t steps, int64_t pstride, const float* bias, wt* yp, int64_t n) {
  static constexpr auto table =
      tile16_table<xt, wt>(std::make_integer_sequence<int, MR16 * NP16>{});
  const int64_t groups = (np + NP16 - 1) / NP16, chunks = (m + ROW_CHUNK16 - 1) / ROW_CHUNK16;
  const bool x_in_cache = m * ldx * static_cast<int64_t>(sizeof(xt)) <= X_IN_CACHE16;
  at::parallel_for(0, groups * chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) {
      const int64_t g = x_in_cache ? t / chunks : t % groups;
      const int64_t c = x_in_cache ? t % chunks : t / groups;
      const int64_t p0 = g * NP16, col0 = p0 * PANEL;
      const int64_t panels = std::min<int64_t>(NP16, np - p0), nc = n - col0;
      const int64_t r_begin = c * m / chunks, rows = (c + 1) * m / chunks - r_begin;
      const int64_t tiles = (rows + MR16 - 1) / MR16;
      for (int64_t i = 0, r0 = r_begin; i < tiles; i++) {
        const int64_t tile_rows = rows / tiles + (i < rows % tiles);
        table[(tile_rows - 1) * NP16 + panels - 1](xp + r0 * ldx, ldx, wp + p0 * pstride,
                                                   pstride, steps, bias ? bias + col0 : nullptr,
                                                   yp + r0 * n + col0, n, nc);
        r0 += tile_rows;
      }
    }
  });
}
#endif  // __AVX512F__

}  // namespace

// "avx512_bf16" (bfloat16 weights through vdpbf16ps, the rest 16-wide), "avx512" (16-wide), or
// "avx2" (8-wide; also the name of the portable build): what Linear.pack's rule reads.
std::string panel_isa() {
  switch (panel_path(at::kBFloat16)) {
    case PanelPath::kBf16Dot: return "avx512_bf16";
    case PanelPath::k16: return "avx512";
    default: return "avx2";
  }
}

// W [N, K] -> [ceil(N/PANEL)][K][PANEL] (zero-padded); on the vdpbf16ps path, bfloat16 W ->
// [ceil(N/PANEL)][ceil(K/2)][PANEL][2]: each column's K values in interleaved pairs (K padded
// with a zero to even), so one 64-byte load holds two K steps of the panel's 16 columns.
at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_panels: weight must be 2-D [N, K], got ", w.sizes());
  const int64_t n = w.size(0), k = w.size(1), np = (n + PANEL - 1) / PANEL;
  const bool pairs = panel_path(w.scalar_type()) == PanelPath::kBf16Dot;
  const int64_t kp = pairs ? (k + 1) / 2 : k;
  at::Tensor src = w.contiguous();
  at::Tensor out = pairs ? at::zeros({np, kp, PANEL, 2}, w.options())
                         : at::zeros({np, k, PANEL}, w.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pack_panels", [&] {
    const scalar_t* sp = src.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, np, 1, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; p++)
        for (int64_t c = 0; c < PANEL && p * PANEL + c < n; c++)
          for (int64_t j = 0; j < k; j++) {
            const int64_t at = pairs ? ((p * kp + j / 2) * PANEL + c) * 2 + j % 2
                                     : (p * k + j) * PANEL + c;
            op[at] = sp[(p * PANEL + c) * k + j];
          }
    });
  });
  return out;
}

// x [M, K] (float32, or the weight's 16-bit dtype), panels from pack_panels of W [n, K],
// bias [n] float32 or None -> y [M, n] in x's dtype (float32 accumulation, one rounding).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  // pack_panels' vdpbf16ps layout; it cannot tell an odd K from K + 1 (layers.Linear checks).
  const bool pairs = panels.dim() == 4;
  const int64_t k = x.dim() == 2 ? x.size(1) : -1;
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 + pairs && panels.size(2) == PANEL &&
                  (pairs ? panels.size(3) == 2 && panels.size(1) == (k + 1) / 2
                         : panels.size(1) == k) &&
                  n > (panels.size(0) - 1) * PANEL && n <= panels.size(0) * PANEL,
              "panel_linear: x ", x.sizes(), " does not fit panels ", panels.sizes(), " of ", n,
              " columns");
  TORCH_CHECK(x.scalar_type() == panels.scalar_type(),
              "panel_linear: x is ", x.scalar_type(), ", weights ", panels.scalar_type());
  TORCH_CHECK(!pairs || panel_path(panels.scalar_type()) == PanelPath::kBf16Dot,
              "panel_linear: paired panels need this build's vdpbf16ps path");
  at::Tensor bc;
  if (bias) {
    bc = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bc.numel() == n, "panel_linear: bias has ", bc.numel(), " values, not ", n);
  }
  const float* bp = bias ? bc.data_ptr<float>() : nullptr;
#if defined(__AVX512F__)
  at::Tensor y = at::empty({x.size(0), n}, x.options());  // tiles round to x's dtype once
#if defined(__AVX512BF16__)
  if (pairs) {
    at::Tensor xb = x.contiguous();
    if (k % 2) xb = at::constant_pad_nd(xb, {0, 1});  // a zero to pair with the padding K step
    panel_linear16(xb.data_ptr<c10::BFloat16>(), x.size(0), xb.size(1),
                   panels.data_ptr<c10::BFloat16>(), panels.size(0), panels.size(1),
                   panels.size(1) * PANEL * 2, bp, y.data_ptr<c10::BFloat16>(), n);
    return y;
  }
#endif
  const at::Tensor xc = x.to(at::kFloat).contiguous();  // 16-bit x: widened once, not per panel
  dispatch(panels.scalar_type(), "panel_linear", [&](auto tag) {
    using wt = typename decltype(tag)::type;
    panel_linear16(xc.data_ptr<float>(), x.size(0), k, panels.data_ptr<wt>(), panels.size(0), k,
                   k * PANEL, bp, y.data_ptr<wt>(), n);
  });
  return y;
#else
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));  // cast once at the end
  const at::Tensor xc = x.to(at::kFloat).contiguous();  // 16-bit x: widened once, not per panel
  dispatch(panels.scalar_type(), "panel_linear",
           [&](auto tag) { panel_linear_impl<typename decltype(tag)::type>(xc, panels, bp, y, n); });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
#endif
}

}  // namespace pagedkv_cpu
