// pagedkv's fused CPU kernels (built on first use by pagedkv/kernels/cpu.py, see there).
//
// Each kernel rounds where the pure-torch reference in pagedkv/model/ rounds (statistics and
// accumulations in float32, results cast to the activation dtype at the same points), so the
// two paths agree to float32 summation order. Work is split across torch's own OpenMP pool
// (at::parallel_for), so torch.set_num_threads governs these kernels too.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "csrc/common.h"
#include "csrc/kv_formats.h"
#include "csrc/simd.h"

namespace pagedkv_cpu {
namespace {

// out[t] = q . k[t] for n rows k[t] of d floats (row-major), four rows at a time when d % 8 == 0.
inline void dot_rows(const float* q, const float* k, int64_t n, int64_t d, float* out) {
  int64_t t = 0;
  if (d % 8 == 0) {
    for (; t + 4 <= n; t += 4) {
      const float* k0 = k + t * d;
      v8f a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t j = 0; j < d; j += 8) {
        const v8f qv = load8(q + j);
        a0 += qv * load8(k0 + j);
        a1 += qv * load8(k0 + d + j);
        a2 += qv * load8(k0 + 2 * d + j);
        a3 += qv * load8(k0 + 3 * d + j);
      }
      out[t] = hsum8(a0);
      out[t + 1] = hsum8(a1);
      out[t + 2] = hsum8(a2);
      out[t + 3] = hsum8(a3);
    }
  }
  for (; t < n; t++) {
    float dot = 0.f;
    for (int64_t j = 0; j < d; j++) dot += q[j] * k[t * d + j];
    out[t] = dot;
  }
}


void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name,
              ": expected a CPU [rows, n] tensor with a contiguous last dim");
}

// RMSNorm of one row: out = T(x * rsqrt(mean(x^2) + eps)) * w, rounded as layers.RMSNorm.
template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; j++) { float v = to_f(x[j]); ss += v * v; }
  const float scale = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; j++) out[j] = from_f<T>(rnd<T>(to_f(x[j]) * scale) * to_f(w[j]));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), sx = x.stride(0);
  auto out = at::empty({rows, n}, x.options());
  auto wc = w.contiguous();
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; i++) rms_row(xp + i * sx, wp, op + i * n, n, (float)eps);
    });
  });
  return out;
}

// residual += x (rounded to T); returns RMSNorm(residual) * w (vLLM's fused_add_rms_norm).
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                         double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: x and residual differ in shape or dtype");
  const int64_t rows = x.size(0), n = x.size(1), sx = x.stride(0), sr = residual.stride(0);
  auto out = at::empty({rows, n}, x.options());
  auto wc = w.contiguous();
  dispatch(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; i++) {
        scalar_t* r = rp + i * sr;
        const scalar_t* xi = xp + i * sx;
        for (int64_t j = 0; j < n; j++) r[j] = from_f<scalar_t>(to_f(r[j]) + to_f(xi[j]));
        rms_row(r, wp, op + i * n, n, (float)eps);
      }
    });
  });
  return out;
}

// silu(gate) * up for gate_up [T, 2I] = [gate | up]: silu rounded to T, then the product.
at::Tensor silu_and_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_and_mul");
  const int64_t rows = gu.size(0), n = gu.size(1) / 2, s = gu.stride(0);
  auto out = at::empty({rows, n}, gu.options());
  dispatch(gu.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* g = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; i++) {
        const scalar_t* gi = g + i * s;
        scalar_t* oi = o + i * n;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) {
          const float x = to_f(gi[j]);
          oi[j] = from_f<scalar_t>(rnd<scalar_t>(x / (1.f + fast_exp(-x))) * to_f(gi[n + j]));
        }
      }
    });
  });
  return out;
}

// Rotate-half RoPE in place on x [T, heads, D] (rows may be strided; heads contiguous), with
// cos / signed-sin tables [P, D] (layers.RotaryEmbedding) gathered at positions [T]:
// x = T(T(x * cos) + T(swap_halves(x) * sin)), the reference's three roundings.
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope_: expected x [T, heads, D] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type()
              && sin.scalar_type() == x.scalar_type(), "rope_: tables must be contiguous, x's dtype");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2, sx = x.stride(0);
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t table_len = cos.size(0);
  for (int64_t i = 0; i < t; i++)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < table_len, "rope_: position ", pp[i], " outside the table");
  dispatch(x.scalar_type(), "rope_", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, t, 8, [&](int64_t b, int64_t e) {
      std::vector<float> cf(d), sf(d), xf(d);
      for (int64_t i = b; i < e; i++) {
        const scalar_t* c = cp + pp[i] * d;
        const scalar_t* s = sp + pp[i] * d;
        for (int64_t j = 0; j < d; j++) { cf[j] = to_f(c[j]); sf[j] = to_f(s[j]); }
        for (int64_t h = 0; h < heads; h++) {
          scalar_t* __restrict v = xp + i * sx + h * d;
          float* __restrict x = xf.data();
          for (int64_t j = 0; j < d; j++) x[j] = to_f(v[j]);
          const float* __restrict cc = cf.data();
          const float* __restrict ss = sf.data();
          for (int64_t j = 0; j < half; j++)
            v[j] = from_f<scalar_t>(rnd<scalar_t>(x[j] * cc[j]) + rnd<scalar_t>(x[j + half] * ss[j]));
          for (int64_t j = half; j < d; j++)
            v[j] = from_f<scalar_t>(rnd<scalar_t>(x[j] * cc[j]) + rnd<scalar_t>(x[j - half] * ss[j]));
        }
      }
    });
  });
}

// cache[h, slot[t]] = x[t, h] for x [T, kv_heads, D] (strided rows) into a cache
// [kv_heads, num_blocks, block_size, D]; slots < 0 are skipped (vLLM's padding convention).
void write_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k.scalar_type() == k_cache.scalar_type() &&
              v.scalar_type() == v_cache.scalar_type(),
              "write_kv_: expected k, v [T, kv_heads, D] and contiguous caches of their dtype");
  const int64_t t = k.size(0), kvh = k.size(1), d = k.size(2);
  const int64_t slots = k_cache.size(1) * k_cache.size(2);
  auto sm = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = sm.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; i++) TORCH_CHECK(sp[i] < slots, "write_kv_: slot ", sp[i], " >= ", slots);
  dispatch(k.scalar_type(), "write_kv_", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t sk0 = k.stride(0), sk1 = k.stride(1), sv0 = v.stride(0), sv1 = v.stride(1);
    at::parallel_for(0, t, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; i++) {
        if (sp[i] < 0) continue;
        for (int64_t h = 0; h < kvh; h++) {
          scalar_t* kd = kc + (h * slots + sp[i]) * d;
          scalar_t* vd = vc + (h * slots + sp[i]) * d;
          const scalar_t* ks = kp + i * sk0 + h * sk1;
          const scalar_t* vs = vp + i * sv0 + h * sv1;
          for (int64_t j = 0; j < d; j++) { kd[j] = ks[j]; vd[j] = vs[j]; }
        }
      }
    });
  });
}


// One block of n scores p of one query head through the online softmax: p becomes
// exp(p - max), the running max m and sum l take the block in; returns the factor the head's
// earlier output accumulator must be scaled by (0 on the first block, m = -inf). Mutates p, m, l.
inline float softmax_block(float* p, int64_t n, float& m, float& l) {
  float mx = m;
#pragma omp simd reduction(max : mx)
  for (int64_t t = 0; t < n; t++) mx = std::max(mx, p[t]);
  const float corr = m == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(m - mx);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; t++) { p[t] = fast_exp(p[t] - mx); sum += p[t]; }
  l = l * corr + sum;
  m = mx;
  return corr;
}

// A decode call's shapes and raw pointers (decode_impl, decode_fixed): q [S, H, D] (rows
// strided by sq), caches [KVH, NB, BS, D] of `storage`, out [S, H, D]; g query heads per KV head.
template <typename scalar_t, typename storage> struct DecodeViews {
  int64_t s_n, heads, kvh, nb, bs, g, sq;
  const scalar_t* qp;
  const storage *kc, *vc;
  scalar_t* op;
  DecodeViews(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              at::Tensor& out)
      : s_n(q.size(0)), heads(q.size(1)), kvh(k_cache.size(0)), nb(k_cache.size(1)),
        bs(k_cache.size(2)), g(q.size(1) / k_cache.size(0)), sq(q.stride(0)),
        qp(q.data_ptr<scalar_t>()), kc(static_cast<const storage*>(k_cache.data_ptr())),
        vc(static_cast<const storage*>(v_cache.data_ptr())), op(out.data_ptr<scalar_t>()) {}
};

// The g query heads of one KV head done: out[h] = acc[h] * unit / l[h] (acc [g, d] float32,
// out [g, d]; 0 where l is 0) and, when lse is given, lse[h] = m[h] + log(l[h]), the
// log-sum-exp of the scaled scores (-inf for none). Mutates out and lse.
template <typename scalar_t>
inline void finish_heads(const float* acc, const float* m, const float* l, int64_t g, int64_t d,
                         float unit, scalar_t* out, float* lse) {
  for (int64_t h = 0; h < g; h++) {
    const float inv = l[h] > 0.f ? unit / l[h] : 0.f;
    for (int64_t j = 0; j < d; j++) out[h * d + j] = from_f<scalar_t>(acc[h * d + j] * inv);
    if (lse) lse[h] = l[h] > 0.f ? m[h] + std::log(l[h]) : -std::numeric_limits<float>::infinity();
  }
}

// One query token per sequence attending to keys first_pos[s] .. seq_lens[s] - 1 of its
// paged K/V (block_tables [S, W] hold the physical block of each logical block). q [S, H, D]
// (strided rows), caches [KVH, NB, BS, D] in q's dtype, int8 or fp8; k_scales / v_scales
// [KVH, NB, BS] float32 (int8 caches: a stored value times its token's scale); out [S, H, D];
// lse [S, H] float32 (log-sum-exp of the scaled scores) when defined. Online softmax, float32
// throughout, one block at a time; all H / KVH query heads of a KV head share each block's
// loads (GQA), widened to float32 once for all of them. A token's key scale multiplies its
// scores, its value scale its softmax weight: q . (k8 * s) = (q . k8) * s.
template <typename scalar_t, typename Fmt>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const float* ksp, const float* vsp, const int64_t* btp, int64_t width,
                 const int64_t* fpp, const int64_t* slp, float sc, at::Tensor& out, float* lsep) {
  using storage = typename Fmt::storage;
  const DecodeViews<scalar_t, storage> a(q, k_cache, v_cache, out);
  const int64_t s_n = a.s_n, heads = a.heads, d = q.size(2), kvh = a.kvh, nb = a.nb, bs = a.bs;
  const int64_t g = a.g, sq = a.sq;
  const scalar_t* qp = a.qp;
  const storage *kc = a.kc, *vc = a.vc;
  at::parallel_for(0, s_n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), kf(bs * d), vf(bs * d), p(g * bs), m(g), l(g);
    for (int64_t item = begin; item < end; item++) {
      const int64_t s = item / kvh, kh = item % kvh;
      const int64_t first = fpp[s], len = slp[s];
      for (int64_t h = 0; h < g; h++) {
        const scalar_t* qs = qp + s * sq + (kh * g + h) * d;
        for (int64_t j = 0; j < d; j++) qf[h * d + j] = to_f(qs[j]) * sc;
        m[h] = -std::numeric_limits<float>::infinity();
        l[h] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = first; pos < len;) {
        const int64_t blk = btp[s * width + pos / bs], off = pos % bs;
        const int64_t n = std::min(bs - off, len - pos);
        const int64_t row0 = (kh * nb + blk) * bs + off;  // the first token's slot row
        const storage* kb = kc + row0 * d;
        const storage* vb = vc + row0 * d;
        const float* ks = ksp ? ksp + row0 : nullptr;
        const float* vs = vsp ? vsp + row0 : nullptr;
        const float* kblock;
        const float* vblock;
        if constexpr (std::is_same_v<storage, float>) {
          kblock = kb;
          vblock = vb;
        } else {  // widen the block once for all g query heads
          Fmt::widen(kb, kf.data(), n * d);
          Fmt::widen(vb, vf.data(), n * d);
          kblock = kf.data();
          vblock = vf.data();
        }
        for (int64_t h = 0; h < g; h++) {
          const float* qh = qf.data() + h * d;
          float* ph = p.data() + h * bs;
          dot_rows(qh, kblock, n, d, ph);
          if (ks)
            for (int64_t t = 0; t < n; t++) ph[t] *= ks[t];
          const float corr = softmax_block(ph, n, m[h], l[h]);
          float* ah = acc.data() + h * d;
#pragma omp simd
          for (int64_t j = 0; j < d; j++) ah[j] *= corr;
          for (int64_t t = 0; t < n; t++) {
            const float w = vs ? ph[t] * vs[t] : ph[t];
            const float* vt = vblock + t * d;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) ah[j] += w * vt[j];
          }
        }
        pos += n;
      }
      finish_heads(acc.data(), m.data(), l.data(), g, d, 1.f, a.op + (s * heads + kh * g) * d,
                   lsep ? lsep + s * heads + kh * g : nullptr);
    }
  });
}

// ---- Decode attention for head sizes 64 and 128 (issue 25) -------------------------------
//
// decode_impl's algorithm with the head size known at compile time, so a query head, a row's
// products and the output accumulators live in registers (D / QW vectors each) and no block is
// widened into a scratch copy: each K/V row is widened in registers as it is used. Scores of QW
// rows come out of one transposing reduction (row_sums) instead of one horizontal sum per row.
// An int8 cache takes q . k in integers: q (times the softmax scale) is quantized once per step
// and head to int16 (|q16| <= 32767: 2^-15 of the head's largest value, far below q's own
// bfloat16 rounding) and multiplied with the int8 keys widened to int16 in pairs (vpdpwssd
// with AVX-512 VNNI, vpmaddwd with AVX-512BW or AVX2, a plain loop elsewhere), summed exactly
// in int32 (|sum| <= 32767 * 127 * 256 < 2^31 for D <= 256), then times the q and key scales.


// p[h * ps + t] = scale x the G sums dot(t, r) leaves in r[h] (QW-lane partial sums of row t
// for head h), for the n rows of one block: QW rows at a time through one transposing
// reduction (row_sums) per head. Writes p.
template <int G, typename Dot>
inline void rows_scores(int64_t n, float* p, int64_t ps, float scale, Dot dot) {
  for (int64_t t0 = 0; t0 < n; t0 += QW) {
    vqf r[G][QW] = {};
    const int64_t rows = std::min<int64_t>(QW, n - t0);
    for (int64_t i = 0; i < rows; i++) {
      vqf a[G];
      dot(t0 + i, a);
      for (int h = 0; h < G; h++) r[h][i] = a[h];
    }
    for (int h = 0; h < G; h++) {
      const vqf s = row_sums(r[h]) * scale;
      std::memcpy(p + h * ps + t0, &s, sizeof(float) * rows);
    }
  }
}

// p[h * ps + t] = q_h . k[t] (float32) for the n rows of one block and G query heads (q_h in
// registers: C vectors at qv + h * C); each row is loaded and widened once for all G heads.
template <typename Fmt, int D, int G>
inline void block_scores(const vqf* qv, const typename Fmt::storage* kb, int64_t n, float* p,
                         int64_t ps) {
  constexpr int C = D / QW;
  rows_scores<G>(n, p, ps, 1.f, [&](int64_t t, vqf* a) {
    const typename Fmt::storage* kt = kb + t * D;
    vqf k[C];
    for (int c = 0; c < C; c++) k[c] = fmt_vec<Fmt>(kt + c * QW);
    for (int h = 0; h < G; h++) {
      a[h] = qv[h * C] * k[0];
      for (int c = 1; c < C; c++) a[h] = fma_q(qv[h * C + c], k[c], a[h]);
    }
  });
}

#if defined(__AVX512BF16__) && PAGEDKV_QW == 16
#define PAGEDKV_BF16_DOT 1
// block_scores for a bfloat16 cache read in place by bfloat16 queries, with vdpbf16ps: q_h (D
// bfloat16 values at qb + h * D, not scaled) times each key row, two K steps per instruction,
// the sums times `scale` at the end. The products of two bfloat16 values are exact in float32,
// so the scores differ from block_scores' in summation order and vdpbf16ps's DAZ/FTZ rules
// only (see panel_linear16), and in one rounding where the scale is not a power of two.
template <int D, int G>
inline void block_scores_bf16(const c10::BFloat16* qb, const c10::BFloat16* kb, int64_t n,
                              float* p, int64_t ps, float scale) {
  constexpr int C2 = D / 32;
  __m512bh q[G * C2];
  for (int i = 0; i < G * C2; i++) q[i] = (__m512bh)_mm512_loadu_si512(qb + i * 32);
  rows_scores<G>(n, p, ps, scale, [&](int64_t t, vqf* a) {
    const c10::BFloat16* kt = kb + t * D;
    __m512bh k[C2];
    for (int c = 0; c < C2; c++) k[c] = (__m512bh)_mm512_loadu_si512(kt + c * 32);
    for (int h = 0; h < G; h++) {
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[h * C2], k[0]);
      for (int c = 1; c < C2; c++) s = _mm512_dpbf16_ps(s, q[h * C2 + c], k[c]);
      a[h] = (vqf)s;
    }
  });
}
#else
#define PAGEDKV_BF16_DOT 0
#endif

// Whether keys of format KFmt take block_scores_bf16 (a bfloat16 cache read in place, on
// AVX512-BF16; the queries are then bfloat16 too, the cache being of q's dtype).
template <typename KFmt>
constexpr bool bf16_dot = PAGEDKV_BF16_DOT && std::is_same_v<KFmt, SameFmt<c10::BFloat16>>;

// dots[h * DOTS + t] = q16_h . k[t] (int32, exact) for G query heads (q16_h: D int16 values
// at qv + h * D / (2 QW)) and the n rows of one block: each key vector widened once for the G
// heads; the rows are int8 (a cache block, widened here) or int16 (a tile's widened copy,
// TileScratch). Writes dots (n rounded up to QW per head, n <= SPAN).
constexpr int64_t SPAN = 128;  // rows of a tile's widened copy (TileScratch, below)
constexpr int64_t DOTS = SPAN + QW;
template <int D, int G, typename K>
inline void block_dots_int8(const vqs16* qv, const K* kb, int64_t n, int32_t* dots) {
  constexpr int C2 = D / (2 * QW);
  for (int64_t t0 = 0; t0 < n; t0 += QW) {
    vqi32 r[G][QW] = {};
    const int64_t rows = std::min<int64_t>(QW, n - t0);
    for (int64_t i = 0; i < rows; i++) {
      const K* kt = kb + (t0 + i) * D;
      vqi32 a[G] = {};
      for (int c = 0; c < C2; c++) {
        vqs16 k16;
        if constexpr (std::is_same_v<K, int8_t>) {
          vqi8x2 k8;
          std::memcpy(&k8, kt + c * 2 * QW, sizeof(k8));
          k16 = __builtin_convertvector(k8, vqs16);
        } else {
          std::memcpy(&k16, kt + c * 2 * QW, sizeof(k16));
        }
        for (int h = 0; h < G; h++) a[h] = dot_pairs(a[h], k16, qv[h * C2 + c]);
      }
      for (int h = 0; h < G; h++) r[h][i] = a[h];
    }
    for (int h = 0; h < G; h++) {
      const vqi32 sums = row_sums(r[h]);
      std::memcpy(dots + h * DOTS + t0, &sums, sizeof(int32_t) * rows);
    }
  }
}

// One query head (D float32 values, already times the softmax scale) as int16 values and
// their scale (q ~= q16 * scale); mutates q16.
template <int D> inline float quantize_q16(const float* q, int16_t* q16) {
  float amax = 0.f;
  for (int j = 0; j < D; j++) amax = std::max(amax, std::abs(q[j]));
  const float s = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
  for (int j = 0; j < D; j++) q16[j] = static_cast<int16_t>(std::nearbyint(q[j] * inv));
  return s;
}

// Asks for `bytes` bytes at a and at b to be brought into the cache (a block is far from the
// last one: the hardware prefetcher, following streams, would not fetch it ahead).
inline void prefetch_rows(const void* a, const void* b, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) {
    __builtin_prefetch(static_cast<const char*>(a) + i);
    __builtin_prefetch(static_cast<const char*>(b) + i);
  }
}

// ---- Query tiles: rows that read the same blocks share each block's loads ------------------
//
// Consecutive rows whose block tables start with the same block (the tokens of one prefill
// chunk, which the caller lays out one row per token; decodes of requests sharing a cached
// prefix) form a tile of up to TILE_ROWS rows. A tile walks the union of its rows' key ranges
// once. Where two or more of its rows read the same block, that block is widened once (int8 keys
// to int16, every value row and every other format to float32: TileScratch) and each of them
// attends to it there, over just the positions it sees (its causal end, its window's start);
// a row reading a block of its own (a decode past the shared prefix; a lone decode) reads it in
// place, widening in registers. Tiles go to threads in zigzag order (first, last, second,
// second-to-last, ...): a chunk's later rows see more keys, and torch's static split would
// otherwise hand one thread all the long ones.
constexpr int64_t TILE_ROWS = 16;

// The tiles of `rows` rows (block_tables [rows, width]): tile i is rows [starts[i], starts[i+1]).
std::vector<int64_t> row_tiles(const int64_t* btp, int64_t rows, int64_t width) {
  std::vector<int64_t> starts{0};
  for (int64_t r = 1; r < rows; r++) {
    const int64_t r0 = starts.back();
    if (r - r0 >= TILE_ROWS || width == 0 || btp[r * width] != btp[r0 * width]) starts.push_back(r);
  }
  if (rows > 0) starts.push_back(rows);
  return starts;
}

// The tile of the i-th of n work slots in zigzag order (0, n-1, 1, n-2, ...).
inline int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// Blocks widened for a tile, one after another (up to SPAN rows): int8 keys as int16 (q . k
// stays in integers), everything else as float32, in the units fmt_vec gives (so fmt_unit
// still applies); int8's scales beside them. Mutates k, v, ks, vs.
template <typename Fmt, int D> struct TileScratch {
  using KRow = std::conditional_t<std::is_same_v<Fmt, Int8Fmt>, int16_t, float>;
  std::vector<KRow> k;
  std::vector<float> v, ks, vs;
  TileScratch() : k(SPAN * D), v(SPAN * D), ks(SPAN), vs(SPAN) {}
  // Rows at .. at + n - 1 := the n cache rows at kb / vb (and their scales at ksp / vsp, int8).
  void widen(const typename Fmt::storage* kb, const typename Fmt::storage* vb, const float* ksp,
             const float* vsp, int64_t n, int64_t at) {
    KRow* kd = k.data() + at * D;
    float* vd = v.data() + at * D;
    if constexpr (std::is_same_v<KRow, int16_t>) {
#pragma omp simd
      for (int64_t j = 0; j < n * D; j++) kd[j] = kb[j];
      std::memcpy(ks.data() + at, ksp, n * sizeof(float));
      std::memcpy(vs.data() + at, vsp, n * sizeof(float));
    } else {
      for (int64_t j = 0; j < n * D; j += QW) {
        const vqf f = fmt_vec<Fmt>(kb + j);
        std::memcpy(kd + j, &f, sizeof(f));
      }
    }
    for (int64_t j = 0; j < n * D; j += QW) {
      const vqf f = fmt_vec<Fmt>(vb + j);
      std::memcpy(vd + j, &f, sizeof(f));
    }
  }
};

// One query row-head's state in a tile: q (float32 vectors, or int16 and its scale for an int8
// cache, or for a bfloat16 cache on AVX512-BF16 also q itself, unscaled: qb), the online
// softmax's m and l, the output accumulator.
template <int D> struct RowHeads {
  static constexpr int C = D / QW;
  std::vector<vqf> qf, acc;
  std::vector<vqs16> q16;
  std::vector<c10::BFloat16> qb;
  std::vector<float> qscale, m, l;
  RowHeads(int64_t n, bool with_qb)
      : qf(n * C), acc(n * C), q16(n * C / 2), qb(with_qb ? n * D : 0), qscale(n), m(n), l(n) {}
};

// acc[h] = acc[h] * corr[h] + sum_t w[h][t] * v[t] for H query heads (acc: C vectors each;
// w: H rows of n weights, ws apart) over the n value rows at vb: H * C accumulators stay in
// registers and each value vector is widened once for all H heads. With one head, even and
// odd rows go to two partial sums, so that 2C chains of FMAs are in flight rather than C (a
// chain waits out each FMA's latency). Mutates acc.
template <typename VFmt, int D, int H>
inline void weigh_values(vqf* acc, const float* corr, const float* w, int64_t ws,
                         const typename VFmt::storage* vb, int64_t n) {
  constexpr int C = D / QW, U = H == 1 ? 2 : 1;
  vqf a[U][H][C];
  for (int h = 0; h < H; h++)
    for (int c = 0; c < C; c++) {
      a[0][h][c] = acc[h * C + c] * corr[h];
      if constexpr (U == 2) a[1][h][c] = vqf{};
    }
  auto row = [&](int u, int64_t t) {
    const typename VFmt::storage* vt = vb + t * D;
    for (int c = 0; c < C; c++) {
      const vqf v = fmt_vec<VFmt>(vt + c * QW);
      for (int h = 0; h < H; h++) a[u][h][c] = fma_q(vqf{} + w[h * ws + t], v, a[u][h][c]);
    }
  };
  int64_t t = 0;
  for (; t + U <= n; t += U)
    for (int u = 0; u < U; u++) row(u, t + u);
  for (; t < n; t++) row(0, t);
  for (int h = 0; h < H; h++)
    for (int c = 0; c < C; c++) acc[h * C + c] = U == 2 ? a[0][h][c] + a[U - 1][h][c] : a[0][h][c];
}

// p[h * ps + t] = the scores of query heads i .. i + G - 1 of st against the n key rows at kb
// (block_scores, or block_scores_bf16 for a bfloat16 cache read in place); `scale` is the
// softmax scale, already in st.qf but not in st.qb. Writes p.
template <typename KFmt, int D, int G>
inline void head_scores(const RowHeads<D>& st, int64_t i, const typename KFmt::storage* kb,
                        int64_t n, float* p, int64_t ps, float scale) {
  if constexpr (bf16_dot<KFmt>) {
#if PAGEDKV_BF16_DOT
    block_scores_bf16<D, G>(st.qb.data() + i * D, kb, n, p, ps, scale);
#endif
  } else {
    (void)scale;
    block_scores<KFmt, D, G>(st.qf.data() + i * (D / QW), kb, n, p, ps);
  }
}

// The g query heads i0 .. i0 + g - 1 of one row attend the n rows of one block at kb / vb
// (KFmt / VFmt: the cache's format read in place, or a tile's widened copy); ks / vs: the rows'
// int8 scales (null otherwise); p: g rows of ps >= n scores, corr: g factors, dots: g rows of
// DOTS values (scratch); scale: the softmax scale (head_scores). Key rows are scored for a pair of
// heads at once (head_scores), value rows weighed for up to 16 / C heads at once
// (weigh_values). Mutates the heads' m, l and accumulators.
template <typename KFmt, typename VFmt, bool int8, int D>
inline void attend_row(RowHeads<D>& st, int64_t i0, int64_t g, const typename KFmt::storage* kb,
                       const typename VFmt::storage* vb, const float* ks, const float* vs,
                       int64_t n, int64_t ps, float* p, float* corr, int32_t* dots, float scale) {
  constexpr int C = D / QW;
  constexpr int HB = C >= 16 ? 1 : C >= 8 ? 2 : 4;
  if constexpr (int8) {  // int8 keys: a pair of heads' dot products per key widened
    const vqs16* q16 = st.q16.data() + i0 * C / 2;
    int64_t h = 0;
    for (; h + 2 <= g; h += 2) block_dots_int8<D, 2>(q16 + h * C / 2, kb, n, dots + h * DOTS);
    if (h < g) block_dots_int8<D, 1>(q16 + h * C / 2, kb, n, dots + h * DOTS);
  } else {
    int64_t h = 0;
    for (; h + 2 <= g; h += 2) head_scores<KFmt, D, 2>(st, i0 + h, kb, n, p + h * ps, ps, scale);
    if (h < g) head_scores<KFmt, D, 1>(st, i0 + h, kb, n, p + h * ps, ps, scale);
  }
  for (int64_t h = 0; h < g; h++) {
    const int64_t i = i0 + h;
    float* ph = p + h * ps;
    if constexpr (int8) {
      const int32_t* dh = dots + h * DOTS;
      const float qs = st.qscale[i];
#pragma omp simd
      for (int64_t t = 0; t < n; t++) ph[t] = static_cast<float>(dh[t]) * (qs * ks[t]);
    }
    corr[h] = softmax_block(ph, n, st.m[i], st.l[i]);
    if constexpr (int8) {
#pragma omp simd
      for (int64_t t = 0; t < n; t++) ph[t] *= vs[t];
    }
  }
  for (int64_t h = 0; h < g; h += HB) {
    vqf* acc = st.acc.data() + (i0 + h) * C;
    switch (std::min<int64_t>(HB, g - h)) {
      case 1: weigh_values<VFmt, D, 1>(acc, corr + h, p + h * ps, ps, vb, n); break;
      case 2: weigh_values<VFmt, D, 2>(acc, corr + h, p + h * ps, ps, vb, n); break;
      case 3: weigh_values<VFmt, D, 3>(acc, corr + h, p + h * ps, ps, vb, n); break;
      default: weigh_values<VFmt, D, 4>(acc, corr + h, p + h * ps, ps, vb, n); break;
    }
  }
}

// The int16 key rows of an int8 tile's widened copy (block_dots_int8 takes them as they are).
struct Int16Rows { using storage = int16_t; };

// One decode_fixed call's shared inputs (views of its arguments).
template <typename scalar_t, typename Fmt> struct TileInputs {
  const DecodeViews<scalar_t, typename Fmt::storage>& a;
  const float *ksp, *vsp;
  const int64_t *btp, *fpp, *slp;
  int64_t width;
  float scale;  // the softmax scale
};

// Rows [r0, r0 + nr) share one block table: their key range [first, len) is widened SPAN rows
// at a time (TileScratch) and each row attends to its part of every span (one online-softmax
// step per span). Mutates st.
template <typename scalar_t, typename Fmt, int D>
void attend_spans(const TileInputs<scalar_t, Fmt>& in, RowHeads<D>& st, TileScratch<Fmt, D>& sc,
                  int64_t kh, int64_t r0, int64_t nr, int64_t first, int64_t len, float* p,
                  float* corr, int32_t* dots) {
  constexpr bool int8 = std::is_same_v<Fmt, Int8Fmt>;
  using KScratchFmt = std::conditional_t<int8, Int16Rows, SameFmt<float>>;
  const auto& a = in.a;
  for (int64_t start = first; start < len;) {
    int64_t pos = start, n_span = 0;
    while (pos < len && n_span + (a.bs - pos % a.bs) <= SPAN) {
      const int64_t n = std::min(a.bs - pos % a.bs, len - pos);
      const int64_t row0 = (kh * a.nb + in.btp[r0 * in.width + pos / a.bs]) * a.bs + pos % a.bs;
      sc.widen(a.kc + row0 * D, a.vc + row0 * D, int8 ? in.ksp + row0 : nullptr,
               int8 ? in.vsp + row0 : nullptr, n, n_span);
      n_span += n;
      pos += n;
    }
    for (int64_t r = r0; r < r0 + nr; r++) {
      const int64_t lo = std::max(in.fpp[r], start) - start, hi = std::min(in.slp[r], pos) - start;
      if (lo >= hi) continue;
      attend_row<KScratchFmt, SameFmt<float>, int8, D>(
          st, (r - r0) * a.g, a.g, sc.k.data() + lo * D, sc.v.data() + lo * D,
          sc.ks.data() + lo, sc.vs.data() + lo, hi - lo, SPAN, p, corr, dots, in.scale);
    }
    start = pos;
  }
}

// The first block the thread reads next: its first slot row and row count (rows 0: none).
struct NextBlock { int64_t row = 0, rows = 0; };

// Rows [r0, r0 + nr) whose tables may part (decodes past a shared prefix), block by block: a
// block two or more of them read is widened once (when the format needs widening), the others
// are read in place by their one reader; the next block, or on the last one `after` (the next
// item's first), is prefetched. Mutates st.
template <typename scalar_t, typename Fmt, int D>
void attend_blocks(const TileInputs<scalar_t, Fmt>& in, RowHeads<D>& st, TileScratch<Fmt, D>& sc,
                   int64_t kh, int64_t r0, int64_t nr, int64_t first, int64_t len, float* p,
                   float* corr, int32_t* dots, NextBlock after) {
  using storage = typename Fmt::storage;
  constexpr bool int8 = std::is_same_v<Fmt, Int8Fmt>;
  constexpr bool in_place_only = std::is_same_v<storage, float>;  // nothing to widen
  using KScratchFmt = std::conditional_t<int8, Int16Rows, SameFmt<float>>;
  const auto& a = in.a;
  const int64_t bs = a.bs, nb = a.nb, g = a.g, width = in.width;
  const int64_t* btp = in.btp;
  for (int64_t pos = first; pos < len;) {
    const int64_t b = pos / bs, off = pos % bs;
    const int64_t n = std::min(bs - off, len - pos);
    // The block most rows read here: the first reader's.
    int64_t lead = -1, lead_row = r0, readers = 0;
    for (int64_t r = r0; r < r0 + nr; r++) {
      if (std::max(in.fpp[r], pos) >= std::min(in.slp[r], pos + n)) continue;
      const int64_t blk = btp[r * width + b];
      if (lead < 0) lead = blk, lead_row = r;
      readers += blk == lead;
    }
    if (pos + n < len) {  // the next block: its own place in memory, no stream to follow
      const int64_t next = (kh * nb + btp[lead_row * width + b + 1]) * bs;
      prefetch_rows(a.kc + next * D, a.vc + next * D, std::min(bs, len - pos - n) * D * sizeof(storage));
      if constexpr (int8) prefetch_rows(in.ksp + next, in.vsp + next, bs * sizeof(float));
    } else if (after.rows > 0) {  // the next item's first block, likewise
      prefetch_rows(a.kc + after.row * D, a.vc + after.row * D, after.rows * D * sizeof(storage));
      if constexpr (int8) prefetch_rows(in.ksp + after.row, in.vsp + after.row, after.rows * sizeof(float));
    }
    const bool widen = !in_place_only && readers > 1;
    if (widen) {
      const int64_t lead0 = (kh * nb + lead) * bs + off;
      sc.widen(a.kc + lead0 * D, a.vc + lead0 * D, int8 ? in.ksp + lead0 : nullptr,
               int8 ? in.vsp + lead0 : nullptr, n, 0);
    }
    for (int64_t r = r0; r < r0 + nr; r++) {
      const int64_t lo = std::max(in.fpp[r], pos) - pos, hi = std::min(in.slp[r], pos + n) - pos;
      if (lo >= hi) continue;
      const int64_t blk = btp[r * width + b];
      const int64_t row0 = (kh * nb + blk) * bs + off + lo;  // the row's first slot here
      const float* ks = int8 ? in.ksp + row0 : nullptr;
      const float* vs = int8 ? in.vsp + row0 : nullptr;
      if (widen && blk == lead)
        attend_row<KScratchFmt, SameFmt<float>, int8, D>(
            st, (r - r0) * g, g, sc.k.data() + lo * D, sc.v.data() + lo * D, ks, vs, hi - lo,
            SPAN, p, corr, dots, in.scale);
      else
        attend_row<Fmt, Fmt, int8, D>(st, (r - r0) * g, g, a.kc + row0 * D, a.vc + row0 * D,
                                      ks, vs, hi - lo, SPAN, p, corr, dots, in.scale);
    }
    pos += n;
  }
}

// decode_impl for a compile-time head size D (a multiple of 2 * QW); same arguments, except
// that rows are taken in tiles (above): a tile on one block table (a prefill chunk) through
// attend_spans, others (decodes) through attend_blocks.
template <typename scalar_t, typename Fmt, int D>
void decode_fixed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const float* ksp, const float* vsp, const int64_t* btp, int64_t width,
                  const int64_t* fpp, const int64_t* slp, float sc, at::Tensor& out, float* lsep) {
  using storage = typename Fmt::storage;
  constexpr int C = D / QW;
  constexpr bool int8 = std::is_same_v<Fmt, Int8Fmt>;
  constexpr bool in_place_only = std::is_same_v<storage, float>;  // nothing to widen
  const DecodeViews<scalar_t, storage> a(q, k_cache, v_cache, out);
  const TileInputs<scalar_t, Fmt> in{a, ksp, vsp, btp, fpp, slp, width, sc};
  const int64_t heads = a.heads, kvh = a.kvh, g = a.g, sq = a.sq;
  const scalar_t* qp = a.qp;
  const std::vector<int64_t> tiles = row_tiles(btp, a.s_n, width);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) - 1;
  // The first block item `it` reads (its tile's first row's), for prefetching.
  auto first_block = [&](int64_t it) {
    const int64_t r = tiles[zigzag(it / kvh, num_tiles)], kh = it % kvh, pos = fpp[r];
    if (pos >= slp[r]) return NextBlock{};
    const int64_t row = (kh * a.nb + btp[r * width + pos / a.bs]) * a.bs + pos % a.bs;
    return NextBlock{row, std::min(a.bs - pos % a.bs, slp[r] - pos)};
  };
  at::parallel_for(0, std::max<int64_t>(num_tiles, 0) * kvh, 1, [&](int64_t begin, int64_t end) {
    RowHeads<D> st(TILE_ROWS * g, bf16_dot<Fmt>);
    TileScratch<Fmt, D> scratch;
    std::vector<float> p(g * SPAN), corr(g);
    std::vector<int32_t> dots(g * DOTS);
    for (int64_t item = begin; item < end; item++) {
      const int64_t tile = zigzag(item / kvh, num_tiles), kh = item % kvh;
      const int64_t r0 = tiles[tile], nr = tiles[tile + 1] - r0;
      int64_t first = std::numeric_limits<int64_t>::max(), len = 0;
      bool one_table = true;
      for (int64_t r = r0; r < r0 + nr; r++) {
        first = std::min(first, fpp[r]);
        len = std::max(len, slp[r]);
        one_table = one_table && (r == r0 || std::memcmp(btp + r * width, btp + r0 * width,
                                                         width * sizeof(int64_t)) == 0);
        for (int64_t h = 0; h < g; h++) {
          const int64_t i = (r - r0) * g + h;
          const scalar_t* qs = qp + r * sq + (kh * g + h) * D;
          float* qh = reinterpret_cast<float*>(st.qf.data() + i * C);
          for (int j = 0; j < D; j++) qh[j] = to_f(qs[j]) * sc * fmt_unit<Fmt>;
          if constexpr (bf16_dot<Fmt>) std::memcpy(st.qb.data() + i * D, qs, D * sizeof(scalar_t));
          if constexpr (int8)
            st.qscale[i] = quantize_q16<D>(qh, reinterpret_cast<int16_t*>(st.q16.data() + i * C / 2));
          st.m[i] = -std::numeric_limits<float>::infinity();
          st.l[i] = 0.f;
        }
      }
      std::fill(st.acc.begin(), st.acc.begin() + nr * g * C, vqf{});
      if (nr > 1 && one_table && !in_place_only)
        attend_spans<scalar_t, Fmt, D>(in, st, scratch, kh, r0, nr, first, len, p.data(),
                                       corr.data(), dots.data());
      else
        attend_blocks<scalar_t, Fmt, D>(in, st, scratch, kh, r0, nr, first, len, p.data(),
                                        corr.data(), dots.data(),
                                        item + 1 < end ? first_block(item + 1) : NextBlock{});
      for (int64_t r = r0; r < r0 + nr; r++)
        finish_heads(reinterpret_cast<const float*>(st.acc.data() + (r - r0) * g * C),
                     st.m.data() + (r - r0) * g, st.l.data() + (r - r0) * g, g, D, fmt_unit<Fmt>,
                     a.op + (r * heads + kh * g) * D, lsep ? lsep + r * heads + kh * g : nullptr);
    }
  });
}


void paged_decode_attention_q(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache,
                              const c10::optional<at::Tensor>& k_scales,
                              const c10::optional<at::Tensor>& v_scales,
                              const at::Tensor& block_tables, const at::Tensor& first_pos,
                              const at::Tensor& seq_lens, double scale, at::Tensor& out,
                              const c10::optional<at::Tensor>& lse) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_decode_attention: q must be [S, H, D] with contiguous heads");
  const at::ScalarType cache_t = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
              v_cache.scalar_type() == cache_t && out.scalar_type() == q.scalar_type(),
              "paged_decode_attention: caches (of one dtype) and out must be contiguous, out "
              "of q's dtype");
  TORCH_CHECK(cache_t == q.scalar_type() || cache_t == at::kChar ||
              cache_t == at::kFloat8_e4m3fn || cache_t == at::kFloat8_e5m2,
              "paged_decode_attention: cache dtype ", cache_t, " is neither q's, int8 nor fp8");
  TORCH_CHECK(k_scales.has_value() == v_scales.has_value() &&
              k_scales.has_value() == (cache_t == at::kChar),
              "paged_decode_attention: int8 caches need k_scales and v_scales, others none");
  check_scales(k_scales, k_cache, "k_scales");
  check_scales(v_scales, v_cache, "v_scales");
  const int64_t s_n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kvh = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(heads % kvh == 0 && k_cache.size(3) == d, "paged_decode_attention: head shapes");
  auto bt = block_tables.to(at::kLong).contiguous();
  auto fp = first_pos.to(at::kLong).contiguous();
  auto sl = seq_lens.to(at::kLong).contiguous();
  const int64_t width = bt.size(1);
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* fpp = fp.data_ptr<int64_t>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  for (int64_t s = 0; s < s_n; s++) {
    TORCH_CHECK(slp[s] >= 0 && slp[s] <= width * bs, "paged_decode_attention: seq_len ", slp[s],
                " exceeds the block table");
    for (int64_t b = fpp[s] / bs; b * bs < slp[s]; b++)
      TORCH_CHECK(btp[s * width + b] >= 0 && btp[s * width + b] < nb,
                  "paged_decode_attention: block id out of range");
  }
  float* lsep = nullptr;
  if (lse.has_value()) {
    TORCH_CHECK(lse->is_contiguous() && lse->scalar_type() == at::kFloat, "lse must be float32");
    lsep = lse->data_ptr<float>();
  }
  const float* ksp = k_scales ? k_scales->data_ptr<float>() : nullptr;
  const float* vsp = v_scales ? v_scales->data_ptr<float>() : nullptr;
  const float sc = static_cast<float>(scale);
  dispatch(q.scalar_type(), "paged_decode_attention", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    auto run = [&](auto fmt) {
      using Fmt = decltype(fmt);
      if (d == 64)
        decode_fixed<scalar_t, Fmt, 64>(q, k_cache, v_cache, ksp, vsp, btp, width, fpp, slp, sc,
                                        out, lsep);
      else if (d == 128)
        decode_fixed<scalar_t, Fmt, 128>(q, k_cache, v_cache, ksp, vsp, btp, width, fpp, slp,
                                         sc, out, lsep);
      else
        decode_impl<scalar_t, Fmt>(q, k_cache, v_cache, ksp, vsp, btp, width, fpp, slp, sc, out,
                                   lsep);
    };
    switch (cache_t) {
      case at::kChar: run(Int8Fmt{}); break;
      case at::kFloat8_e4m3fn: run(E4M3Fmt{}); break;
      case at::kFloat8_e5m2: run(E5M2Fmt{}); break;
      default: run(SameFmt<scalar_t>{}); break;
    }
  });
}

// The model-dtype cache's entry point (caches of q's dtype, no scales).
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& first_pos, const at::Tensor& seq_lens,
                            double scale, at::Tensor& out, const c10::optional<at::Tensor>& lse) {
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode_attention: caches and out must be contiguous and of q's dtype");
  paged_decode_attention_q(q, k_cache, v_cache, c10::nullopt, c10::nullopt, block_tables,
                           first_pos, seq_lens, scale, out, lse);
}

// int8 KV write (kv_int8.py's scheme, in one pass): for x [T, KVH, D] (strided rows), each
// token's and head's scale s (of the 16 candidates 1 + i / 256, i = -1 .. 14, times
// max|x| / 127: the least squared round-trip error, the first of equals) goes to
// scales[h, slot[t]] and round(x / s) (half to even, within +-127; 0 for a zero vector) to
// cache[h, slot[t]]. The errors are counted exactly, as kv_int8._squared_errors does: x - q s
// (exact), times 2^(21 - e) (max|x| / 127 = m 2^e), rounded to an integer, squared and summed
// exactly, so this picks the scale the torch path picks. Slots < 0 are skipped.
constexpr int INT8_FIRST_STEP = -1;  // candidates 1 + i / 256 for first <= i < first + count
constexpr int INT8_CANDIDATES = 16;
constexpr int INT8_ERROR_BITS = 20;
// The widest head the exact float64 sums below allow (a squared error count < 2^40.2 units).
constexpr int64_t INT8_MAX_HEAD = 4096;

// The first candidate of the least error in err[0 .. INT8_CANDIDATES).
inline int int8_argmin(const double* err) {
  int best = 0;
  for (int c = 1; c < INT8_CANDIDATES; c++)
    if (err[c] < err[best]) best = c;
  return best;
}

// err[c] := the squared round-trip error of x [d] (float32) as round(x / cand[c]) (within
// +-127), in the exact units above (e: max|x| / 127's binary exponent), an integer held
// exactly in a double: x - q c in double, times 2^(21 - e), rounded, squared, summed in int64.
// Writes err[0 .. INT8_CANDIDATES).
inline void int8_candidate_errors_scalar(const float* x, int64_t d, const float* cand, int e,
                                         double* err) {
  const double unit_scale = std::ldexp(1.0, INT8_ERROR_BITS + 1 - e);
  for (int c = 0; c < INT8_CANDIDATES; c++) {
    int64_t sum = 0;
    for (int64_t j = 0; j < d; j++) {
      const float r = std::min(std::max(std::nearbyint(x[j] / cand[c]), -127.f), 127.f);
      const double diff = (static_cast<double>(x[j]) - static_cast<double>(r) * static_cast<double>(cand[c])) * unit_scale;
      const int64_t units = static_cast<int64_t>(std::nearbyint(diff));
      sum += units * units;
    }
    err[c] = static_cast<double>(sum);
  }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// The AVX-512 search, a lane per candidate, one element of x after another (no horizontal
// sums), in float32: x and the candidates scaled by 2^k (k = ERROR_BITS + 1 - e; vscalefps,
// exact) give the same quotients, no clamp acts (|x| / c < 127.5 for every candidate from
// 1 - 1/256 up), and the residual x' - round(x' / c') c' is exact in one FMA (a multiple of
// c''s last place, under c' in size; Sterbenz where |x'| < c'). Its rounding to a whole unit
// is the torch path's integer.
static_assert(INT8_CANDIDATES == 16 && INT8_FIRST_STEP >= -1,
              "the float32 residuals are exact only without saturating candidates");

// f(xv, a[i]) for every element of x [d] scaled by 2^k (broadcast), the accumulators a[0 .. 3]
// taken in turn (four dependency chains: the search is bound by their latency). Mutates a.
template <typename A, typename F>
inline void int8_each_element(const float* x, int64_t d, __m512 k, A (&a)[4], F f) {
  alignas(64) float xs[16];
  for (int64_t j0 = 0; j0 < d; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, d - j0);
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    _mm512_store_ps(xs, _mm512_scalef_ps(_mm512_maskz_loadu_ps(m, x + j0), k));
    int64_t j = 0;
    for (; j + 3 < n; j += 4)
      for (int i = 0; i < 4; i++) f(_mm512_set1_ps(xs[j + i]), a[i]);
    for (; j < n; j++) f(_mm512_set1_ps(xs[j]), a[0]);
  }
}

// The residuals x' - round(x' / c') c' of element x' (broadcast) against every candidate c'.
inline __m512 int8_residuals(__m512 xv, __m512 sv) {
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return _mm512_fnmadd_ps(_mm512_roundscale_ps(_mm512_div_ps(xv, sv), NEAREST), sv, xv);
}

// int8_candidate_errors_scalar's err, exactly: the residuals rounded to whole units, their
// squares (< 2^41) summed in float64 (exact for d <= INT8_MAX_HEAD). Writes err.
inline void int8_exact_errors(const float* x, int64_t d, __m512 k, __m512 sv, double* err) {
  struct Sums { __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd(); } a[4];
  int8_each_element(x, d, k, a, [sv](__m512 xv, Sums& a) {
    const __m512 u = _mm512_roundscale_ps(int8_residuals(xv, sv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(u));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(u, 1));
    a.lo = _mm512_fmadd_pd(lo, lo, a.lo);
    a.hi = _mm512_fmadd_pd(hi, hi, a.hi);
  });
  _mm512_storeu_pd(err, _mm512_add_pd(_mm512_add_pd(a[0].lo, a[1].lo), _mm512_add_pd(a[2].lo, a[3].lo)));
  _mm512_storeu_pd(err + 8, _mm512_add_pd(_mm512_add_pd(a[0].hi, a[1].hi), _mm512_add_pd(a[2].hi, a[3].hi)));
}

// The best candidate (int8_argmin of the exact errors) with AVX-512. First the float32 sums of
// the squared residuals, unrounded: each within tol of the exact error (a residual's square
// moves by at most |r| + 1/4 <= c'_max (1 + 2^-16) / 2 + 1/4 when r rounds to whole units;
// the float32 squares and sums are off by (d + 1) 2^-24 of the sum at most). When one lane is
// below every other by more than 2 tol, it is the exact errors' unique least; otherwise (near
// ties, all-zero vectors) the exact errors decide. Subnormal candidates (max|x| / 127 below
// 2^-125) round coarsely enough to saturate: those take the scalar loop.
inline int int8_best_candidate(const float* x, int64_t d, const float* cand, int e) {
  alignas(64) double err[INT8_CANDIDATES];
  if (e < -124) {
    int8_candidate_errors_scalar(x, d, cand, e, err);
    return int8_argmin(err);
  }
  const __m512 k = _mm512_set1_ps(static_cast<float>(INT8_ERROR_BITS + 1 - e));
  const __m512 sv = _mm512_scalef_ps(_mm512_loadu_ps(cand), k);
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int8_each_element(x, d, k, a, [sv](__m512 xv, __m512& acc) {
    const __m512 r = int8_residuals(xv, sv);
    acc = _mm512_fmadd_ps(r, r, acc);
  });
  const __m512 rough = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
  const double lo = _mm512_reduce_min_ps(rough), hi = _mm512_reduce_max_ps(rough);
  const double tol = static_cast<double>(d) * (0.51 * _mm512_reduce_max_ps(sv) + 0.25) +
                     static_cast<double>(d + 2) * hi * 0x1p-23;
  const __mmask16 near = _mm512_cmp_ps_mask(
      rough, _mm512_set1_ps(static_cast<float>(lo + 3.0 * tol)), _CMP_LE_OQ);
  if (__builtin_popcount(near) == 1) return __builtin_ctz(near);
  int8_exact_errors(x, d, k, sv, err);
  return int8_argmin(err);
}
#else
inline int int8_best_candidate(const float* x, int64_t d, const float* cand, int e) {
  alignas(64) double err[INT8_CANDIDATES];
  int8_candidate_errors_scalar(x, d, cand, e, err);
  return int8_argmin(err);
}
#endif

// dst [d] := round(x / s) (half to even) within +-127. Writes dst.
inline void int8_round(const float* x, int64_t d, float s, int8_t* dst) {
#if defined(__AVX512F__)
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t j0 = 0; j0 < d; j0 += 16) {
    const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, d - j0)) - 1);
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + j0), sv), NEAREST);
    _mm512_mask_cvtsepi32_storeu_epi8(dst + j0, m, _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi)));
  }
#else
  for (int64_t j = 0; j < d; j++)
    dst[j] = static_cast<int8_t>(std::min(std::max(std::nearbyint(x[j] / s), -127.f), 127.f));
#endif
}

// One vector x [d] (float32) quantized to dst [d] (int8); returns its scale (0 for zeros).
inline float quantize_int8_vector(const float* x, int64_t d, int8_t* dst) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t j = 0; j < d; j++) amax = std::max(amax, std::abs(x[j]));
  const float base = amax / 127.f;
  const float safe = base > 0.f ? base : 1.f;
  int e = 0;
  std::frexp(safe, &e);
  alignas(64) float cand[INT8_CANDIDATES];
  for (int c = 0; c < INT8_CANDIDATES; c++)
    cand[c] = safe * (1.f + static_cast<float>(c + INT8_FIRST_STEP) / 256.f);
  const int best = int8_best_candidate(x, d, cand, e);
  int8_round(x, d, cand[best], dst);
  return base > 0.f ? cand[best] : 0.f;
}

void write_kv_int8_(const at::Tensor& x, at::Tensor& cache, at::Tensor& scales,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cache.is_contiguous() &&
              cache.scalar_type() == at::kChar && scales.is_contiguous() &&
              scales.scalar_type() == at::kFloat,
              "write_kv_int8_: expected x [T, KVH, D], a contiguous int8 cache, float32 scales");
  const int64_t t = x.size(0), kvh = x.size(1), d = x.size(2);
  TORCH_CHECK(d <= INT8_MAX_HEAD, "write_kv_int8_: head size ", d, " > ", INT8_MAX_HEAD);
  const int64_t slots = cache.size(1) * cache.size(2);
  auto sm = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = sm.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; i++) TORCH_CHECK(sp[i] < slots, "write_kv_int8_: slot ", sp[i], " >= ", slots);
  int8_t* cp = cache.data_ptr<int8_t>();
  float* scp = scales.data_ptr<float>();
  dispatch(x.scalar_type(), "write_kv_int8_", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> xf(d);
      for (int64_t i = begin; i < end; i++) {
        if (sp[i] < 0) continue;
        for (int64_t h = 0; h < kvh; h++) {
          const scalar_t* src = xp + i * s0 + h * s1;
          for (int64_t j = 0; j < d; j++) xf[j] = to_f(src[j]);
          const float s = quantize_int8_vector(xf.data(), d, cp + (h * slots + sp[i]) * d);
          scp[h * slots + sp[i]] = s;
        }
      }
    });
  });
}


// fp8 KV write (kv_quant.quantize_into's, scale 1, in one pass): each value of x [T, KVH, D]
// (strided rows) clamped to the cache format's finite range and rounded to it by c10's
// conversion (torch's own cast) into cache[h, slot[t]] (e4m3fn or e5m2, [KVH, NB, BS, D]).
// Slots < 0 are skipped. Mutates cache.
void write_kv_fp8_(const at::Tensor& x, at::Tensor& cache, const at::Tensor& slot_mapping) {
  const at::ScalarType ct = cache.scalar_type();
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cache.is_contiguous() && cache.dim() == 4 &&
              cache.size(0) == x.size(1) && cache.size(3) == x.size(2) &&
              (ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2),
              "write_kv_fp8_: expected x [T, KVH, D] and a contiguous fp8 cache [KVH, NB, BS, D]");
  const int64_t t = x.size(0), kvh = x.size(1), d = x.size(2);
  const int64_t slots = cache.size(1) * cache.size(2);
  auto sm = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(sm.numel() == t, "write_kv_fp8_: one slot per token");
  const int64_t* sp = sm.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; i++) TORCH_CHECK(sp[i] < slots, "write_kv_fp8_: slot ", sp[i], " >= ", slots);
  dispatch(x.scalar_type(), "write_kv_fp8_", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    auto run = [&](auto fmt) {
      using F8 = decltype(fmt);
      const float limit = static_cast<float>(std::numeric_limits<F8>::max());
      F8* cp = static_cast<F8*>(cache.data_ptr());
      at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) {
          if (sp[i] < 0) continue;
          for (int64_t h = 0; h < kvh; h++) {
            const scalar_t* src = xp + i * s0 + h * s1;
            F8* dst = cp + (h * slots + sp[i]) * d;
            for (int64_t j = 0; j < d; j++) {
              const float f = to_f(src[j]);  // NaN stays NaN, as torch's clamp leaves it
              dst[j] = F8(f > limit ? limit : f < -limit ? -limit : f);
            }
          }
        }
      });
    };
    if (ct == at::kFloat8_e4m3fn) run(c10::Float8_e4m3fn{});
    else run(c10::Float8_e5m2{});
  });
}

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
  for (int q = 0; q < P; q++) {
    const int64_t cols = std::min<int64_t>(PANEL, nc - q * PANEL);
    if (cols <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + q * PANEL) : _mm512_setzero_ps();
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


// ---- Paged prefill attention (issue 26) ------------------------------------------------
//
// Prefill chunks attend their cached prefix and themselves straight from the paged cache:
// no gathered copy of the context, no repeated K/V per query head, the causal mask (and a
// sliding window) by position. A work item is a tile of a chunk's query tokens times the query
// heads of one KV head (about PF_ROWS rows, token-major: row = token * g + head), computed
// flash-style over PF_KEYS keys at a time with an online softmax and float32 accumulators.
// The tile is held transposed, query rows in vector lanes (16 per zmm "panel"): the scores
// S^T = K Q^T come from a register-blocked kernel that broadcasts each key element straight
// from its cache row against the tile's pre-transposed Q (8 keys x 2 panels: 16 accumulators),
// the softmax's row max and sum are then lane-wise across key vectors, and O^T += V^T P^T
// broadcasts each value element against the probabilities (8 head dims x 2 panels). float32
// caches use FMAs; bfloat16 caches on AVX512-BF16 use vdpbf16ps for both products (Q and K
// in pairs of head dims, P rounded to bfloat16 and paired with V along keys, as torch's own
// flash kernel rounds P for 16-bit inputs). int8 and fp8 caches are read in place too: each
// key step widens its rows (exactly: int8 and fp8 values fit bfloat16) into per-thread scratch
// of the query dtype, and an int8 row's K scale multiplies its scores, its V scale its softmax
// weights (fp8 per-head scales are folded into q and the output by kv_quant.KVScales; e4m3's
// 2^-8 widening unit likewise per key). Items run longest first off a shared counter (the
// later tiles of a chunk see more keys). Other head sizes, dtypes and builds (AVX2: Zen 3;
// no AVX512-BF16 for bfloat16) say so through paged_prefill_supports and keep the torch path.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDKV_PREFILL 1
constexpr int64_t PF_KEYS = 64;  // keys per online-softmax step (any blocks, read in place)
constexpr int64_t PF_ROWS = 32;  // query rows per tile aimed at (tokens x g, two panels)
// int8 / fp8 caches: more rows per tile, each key step's widened rows serving more of them
// (one 2,048-token prefill, bf16 model, Zen 5: 128 rows 1.00-1.01x the bf16 cache, 64 rows
// 0.96-0.98x, 256 rows 0.96-0.98x: the tile outgrows L1).
constexpr int64_t PF_ROWS_WIDENED = 128;

// Query tokens per tile: about `rows` rows of g query heads each.
inline int64_t pf_tile_tokens(int64_t g, bool widened) {
  return std::max<int64_t>(1, (widened ? PF_ROWS_WIDENED : PF_ROWS) / g);
}
constexpr int PF_RK = 8, PF_DB = 8;  // keys (QK) and head dims (PV) per register block

// exp(x) per lane as fast_exp (Cephes' polynomial), scaled by 2^n with vscalefps.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Whether a cache of `dtype` and head size d takes the tiled kernel in this build.
template <typename T> constexpr bool pf_pairs = std::is_same_v<T, c10::BFloat16>;
bool prefill_supports(int64_t d, at::ScalarType dtype) {
  if (d != 64 && d != 128) return false;
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
  return dtype == at::kFloat;
}

// s[k * lds + p * 16 + i] = K_k . Q_(p * 16 + i) for RK keys (cache rows kr[k]) and PP panels of
// the transposed tile qt ([D][ldq] floats; bfloat16: [D / 2][ldq] head-dim pairs). Writes s.
template <typename T, int D, int RK, int PP>
inline void pf_scores(const T* const* kr, const void* qt, int64_t ldq, float* s, int64_t lds) {
  __m512 acc[RK][PP];
#pragma GCC unroll 8
  for (int k = 0; k < RK; k++)
    for (int p = 0; p < PP; p++) acc[k][p] = _mm512_setzero_ps();
  if constexpr (pf_pairs<T>) {
#if defined(__AVX512BF16__)
    const int32_t* q = static_cast<const int32_t*>(qt);
    for (int j = 0; j < D / 2; j++) {
      __m512bh qv[PP];
      for (int p = 0; p < PP; p++) qv[p] = (__m512bh)_mm512_loadu_si512(q + j * ldq + p * 16);
#pragma GCC unroll 8
      for (int k = 0; k < RK; k++) {
        int32_t pair;
        std::memcpy(&pair, kr[k] + 2 * j, sizeof(pair));
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(pair);
        for (int p = 0; p < PP; p++) acc[k][p] = _mm512_dpbf16_ps(acc[k][p], qv[p], kb);
      }
    }
#endif
  } else {
    const float* q = static_cast<const float*>(qt);
    for (int d = 0; d < D; d++) {
      __m512 qv[PP];
      for (int p = 0; p < PP; p++) qv[p] = _mm512_loadu_ps(q + d * ldq + p * 16);
#pragma GCC unroll 8
      for (int k = 0; k < RK; k++) {
        const __m512 kb = _mm512_set1_ps(kr[k][d]);
        for (int p = 0; p < PP; p++) acc[k][p] = _mm512_fmadd_ps(kb, qv[p], acc[k][p]);
      }
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < RK; k++)
    for (int p = 0; p < PP; p++) _mm512_storeu_ps(s + k * lds + p * 16, acc[k][p]);
}

// ot[(d0 + i) * ldo + p * 16 ...] = ot * corr[p] + sum over keys of V[key][d0 + i] x P^T[key]
// for PF_DB head dims and PP panels: float32, n keys (rows vr[k]) of probabilities pt [n][ldp];
// bfloat16, (n + 1) / 2 key pairs of paired probabilities pt [.][ldp] and paired values vp
// [.][D] (int32 lanes). Mutates ot.
template <typename T, int D, int PP>
inline void pf_values(const void* pt, int64_t ldp, const void* vals, int64_t n, int d0,
                      const __m512* corr, float* ot, int64_t ldo) {
  __m512 acc[PF_DB][PP];
#pragma GCC unroll 8
  for (int i = 0; i < PF_DB; i++)
    for (int p = 0; p < PP; p++)
      acc[i][p] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + i) * ldo + p * 16), corr[p]);
  if constexpr (pf_pairs<T>) {
#if defined(__AVX512BF16__)
    const int32_t* pp = static_cast<const int32_t*>(pt);
    const int32_t* vp = static_cast<const int32_t*>(vals);
    for (int64_t j = 0; j < (n + 1) / 2; j++) {
      __m512bh pv[PP];
      for (int p = 0; p < PP; p++) pv[p] = (__m512bh)_mm512_loadu_si512(pp + j * ldp + p * 16);
#pragma GCC unroll 8
      for (int i = 0; i < PF_DB; i++) {
        const __m512bh vb = (__m512bh)_mm512_set1_epi32(vp[j * D + d0 + i]);
        for (int p = 0; p < PP; p++) acc[i][p] = _mm512_dpbf16_ps(acc[i][p], pv[p], vb);
      }
    }
#endif
  } else {
    const float* pf = static_cast<const float*>(pt);
    const float* const* vr = static_cast<const float* const*>(vals);
    for (int64_t k = 0; k < n; k++) {
      __m512 pv[PP];
      for (int p = 0; p < PP; p++) pv[p] = _mm512_loadu_ps(pf + k * ldp + p * 16);
      const float* v = vr[k] + d0;
#pragma GCC unroll 8
      for (int i = 0; i < PF_DB; i++) {
        const __m512 vb = _mm512_set1_ps(v[i]);
        for (int p = 0; p < PP; p++) acc[i][p] = _mm512_fmadd_ps(vb, pv[p], acc[i][p]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < PF_DB; i++)
    for (int p = 0; p < PP; p++) _mm512_storeu_ps(ot + (d0 + i) * ldo + p * 16, acc[i][p]);
}

// The scores of rk (1 .. PF_RK) keys, PP panels: pf_scores with the key count a template.
template <typename T, int D, int PP, int... I>
constexpr auto pf_scores_table(std::integer_sequence<int, I...>) {
  return std::array<void (*)(const T* const*, const void*, int64_t, float*, int64_t), sizeof...(I)>{
      &pf_scores<T, D, I + 1, PP>...};
}

// One online-softmax step of one panel (16 query rows) over n scored keys s [n][lds] (rows in
// lanes) at positions k0 ..: a row sees keys first[row] .. pos[row], key k's scores scaled by
// key_scale[k] (the softmax scale, times an int8 row's K scale). Leaves exp(s - max) in s
// (0 where hidden); returns the factor the panel's accumulators must be scaled by. Mutates s,
// m and l (16 each).
inline __m512 pf_softmax(float* s, int64_t lds, int64_t n, int64_t k0, __m512i pos, __m512i first,
                         const float* key_scale, float* m, float* l) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 m_old = _mm512_loadu_ps(m);
  __m512 mx = m_old;
  for (int64_t k = 0; k < n; k++) {
    const __m512i kp = _mm512_set1_epi32(static_cast<int32_t>(k0 + k));
    const __mmask16 seen = _mm512_cmple_epi32_mask(kp, pos) & _mm512_cmpge_epi32_mask(kp, first);
    const __m512 v = _mm512_mask_mul_ps(neg_inf, seen, _mm512_loadu_ps(s + k * lds),
                                        _mm512_set1_ps(key_scale[k]));
    _mm512_storeu_ps(s + k * lds, v);
    mx = _mm512_max_ps(mx, v);
  }
  // Rows that have seen nothing yet keep m = -inf; they subtract 0 (no inf - inf).
  const __m512 base = _mm512_mask_mov_ps(mx, _mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ),
                                         _mm512_setzero_ps());
  const __m512 corr = exp16(_mm512_sub_ps(m_old, base));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k++) {
    const __m512 v = _mm512_loadu_ps(s + k * lds);
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, neg_inf, _CMP_NEQ_OQ),
                                         exp16(_mm512_sub_ps(v, base)));
    _mm512_storeu_ps(s + k * lds, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), corr, sum));
  _mm512_storeu_ps(m, mx);
  return corr;
}

#if defined(__AVX512BF16__)
// Key pairs for vdpbf16ps: pp[j][ldp] := the probabilities of keys 2j, 2j + 1 (s [n][lds]) as
// bfloat16 pairs per row; vp[j][D] := their value rows' elements paired (a zero row past n).
// Writes pp and vp.
template <int D>
void pf_pair_keys(const float* s, int64_t lds, int64_t panels, const c10::BFloat16* const* vr,
                  int64_t n, int32_t* pp, int32_t* vp) {
  alignas(64) static constexpr int16_t kRows[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  alignas(64) static constexpr int16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i rows = _mm512_load_si512(kRows), lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int64_t j = 0; j < (n + 1) / 2; j++) {
    const bool two = 2 * j + 1 < n;
    for (int64_t p = 0; p < panels; p++) {
      const __m512 a = _mm512_loadu_ps(s + 2 * j * lds + p * 16);
      const __m512 b = two ? _mm512_loadu_ps(s + (2 * j + 1) * lds + p * 16) : _mm512_setzero_ps();
      const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in the low half, b high
      _mm512_storeu_si512(pp + j * lds + p * 16, _mm512_permutexvar_epi16(rows, ab));
    }
    for (int c = 0; c < D; c += 32) {
      const __m512i a = _mm512_loadu_si512(vr[2 * j] + c);
      const __m512i b = two ? _mm512_loadu_si512(vr[2 * j + 1] + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + j * D + c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vp + j * D + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}
#endif

// One work item: tokens tok0 .. tok0 + ntok - 1 of a chunk (positions pos0 ..), the g query
// heads of KV head kh, over `keys` keys (the last ending at its last token's position, or, not
// causal, at the chunk's length - 1).
struct PrefillItem { int64_t chunk, tok0, ntok, kh, keys; };

// A call's inputs: q [T, H, D] (rows sq apart), caches [KVH, NB, BS, D] of Fmt's storage
// (int8: scales ks, vs [KVH, NB, BS], else null), per chunk its first query row, its block
// table row (width ids) and its length; window (0: none), the scale; out; causal (else every
// row of a chunk sees all its keys); lse [T, H] (null: not wanted).
template <typename T, typename Fmt> struct PrefillArgs {
  using storage = typename Fmt::storage;
  const T* q;
  int64_t sq, heads, kvh, nb, bs, g, width, window;
  const storage *kc, *vc;
  const float *ks, *vs;
  const int64_t *starts, *ends, *lens, *tables;
  float scale;
  T* out;
  bool causal;
  float* lse;
};

// Per-thread scratch of one tile: the transposed queries, scores, accumulators and row state;
// the key step's rows (kr, vr: in the cache, or widened into kw, vw) and per-key scales.
template <typename T, int D> struct PrefillScratch {
  std::vector<float> qt, s, ot, m, l, ksc, vsc;
  std::vector<int32_t> pos, first, pp, vp;
  std::vector<const T*> kr, vr;
  std::vector<T> kw, vw;
  PrefillScratch(int64_t ld, bool widen)
      : qt(D * ld), s(PF_KEYS * ld), ot(D * ld), m(ld), l(ld), ksc(PF_KEYS), vsc(PF_KEYS),
        pos(ld), first(ld), pp(PF_KEYS / 2 * ld), vp(PF_KEYS / 2 * D), kr(PF_KEYS), vr(PF_KEYS),
        kw(widen ? PF_KEYS * D : 0), vw(widen ? PF_KEYS * D : 0) {}
};

// One cache row of D Fmt values widened to T (exactly: int8 and fp8 fit bfloat16; e4m3 as
// 2^-8 of its values, fmt_unit). Writes dst.
template <typename T, typename Fmt, int D>
inline void pf_widen(const typename Fmt::storage* src, T* dst) {
  if constexpr (pf_pairs<T>) {
#if defined(__AVX512BF16__)
    for (int j = 0; j < D; j += 32) {
      const __m512bh h = _mm512_cvtne2ps_pbh((__m512)fmt_vec<Fmt>(src + j + 16),
                                             (__m512)fmt_vec<Fmt>(src + j));
      _mm512_storeu_si512(dst + j, (__m512i)h);
    }
#endif
  } else {
    for (int j = 0; j < D; j += 16) _mm512_storeu_ps(dst + j, (__m512)fmt_vec<Fmt>(src + j));
  }
}

// The rows of keys k0 .. k0 + n - 1 of item `it` (table: its chunk's): pointers into the cache
// (the model-dtype cache), or widened into w.kw / w.vw; w.ksc := the softmax scale per key
// (times an int8 row's K scale, e4m3's unit), w.vsc := the factor on each key's softmax weight.
// Mutates w's kr, vr, kw, vw, ksc, vsc.
template <typename T, typename Fmt, int D>
inline void pf_gather_keys(const PrefillArgs<T, Fmt>& a, const PrefillItem& it,
                           const int64_t* table, int64_t k0, int64_t n, PrefillScratch<T, D>& w) {
  constexpr bool same = std::is_same_v<typename Fmt::storage, T>;
  for (int64_t k = 0; k < n; k++) {
    const int64_t kp = k0 + k;
    const int64_t row = (it.kh * a.nb + table[kp / a.bs]) * a.bs + kp % a.bs;
    if constexpr (same) {
      w.kr[k] = a.kc + row * D;
      w.vr[k] = a.vc + row * D;
      w.ksc[k] = a.scale;
    } else {
      pf_widen<T, Fmt, D>(a.kc + row * D, w.kw.data() + k * D);
      pf_widen<T, Fmt, D>(a.vc + row * D, w.vw.data() + k * D);
      w.kr[k] = w.kw.data() + k * D;
      w.vr[k] = w.vw.data() + k * D;
      w.ksc[k] = a.scale * fmt_unit<Fmt> * (a.ks ? a.ks[row] : 1.f);
      w.vsc[k] = fmt_unit<Fmt> * (a.vs ? a.vs[row] : 1.f);
    }
  }
}

// The softmax weights s [n][lds] (panels of 16 rows) of each key times vsc[k]. Mutates s.
inline void pf_weigh_keys(float* s, int64_t lds, int64_t panels, int64_t n, const float* vsc) {
  for (int64_t k = 0; k < n; k++) {
    const __m512 f = _mm512_set1_ps(vsc[k]);
    for (int64_t p = 0; p < panels; p++)
      _mm512_storeu_ps(s + k * lds + p * 16, _mm512_mul_ps(_mm512_loadu_ps(s + k * lds + p * 16), f));
  }
}

// Attends one item (see the section comment); writes its rows of out.
template <typename T, typename Fmt, int D>
void pf_item(const PrefillArgs<T, Fmt>& a, const PrefillItem& it, PrefillScratch<T, D>& w) {
  using storage = typename Fmt::storage;
  constexpr bool weigh = !std::is_same_v<storage, T> && !std::is_same_v<Fmt, E5M2Fmt>;
  const int64_t g = a.g, rows = it.ntok * g, panels = (rows + 15) / 16, ld = panels * 16;
  const int64_t qlen = a.ends[it.chunk] - a.starts[it.chunk];
  const int64_t pos0 = a.lens[it.chunk] - qlen + it.tok0;
  const int64_t* table = a.tables + it.chunk * a.width;
  // Q^T: floats [D][ld], or bfloat16 head-dim pairs [D / 2][ld]; padding rows zero, unseeing.
  std::fill(w.qt.begin(), w.qt.begin() + D * ld, 0.f);
  std::fill(w.ot.begin(), w.ot.begin() + D * ld, 0.f);
  for (int64_t r = 0; r < ld; r++) {
    const bool real = r < rows;
    const int64_t pos = a.causal ? pos0 + r / g : a.lens[it.chunk] - 1;
    w.pos[r] = real ? static_cast<int32_t>(pos) : -1;
    w.first[r] = real && a.window > 0 ? static_cast<int32_t>(std::max<int64_t>(0, pos - a.window + 1)) : 0;
    w.m[r] = -std::numeric_limits<float>::infinity();
    w.l[r] = 0.f;
    if (!real) continue;
    const T* qr = a.q + (a.starts[it.chunk] + it.tok0 + r / g) * a.sq + (it.kh * g + r % g) * D;
    if constexpr (pf_pairs<T>) {
      int32_t* qt = reinterpret_cast<int32_t*>(w.qt.data());
      for (int j = 0; j < D / 2; j++) std::memcpy(qt + j * ld + r, qr + 2 * j, sizeof(int32_t));
    } else {
      for (int d = 0; d < D; d++) w.qt[d * ld + r] = qr[d];
    }
  }
  static constexpr auto one = pf_scores_table<T, D, 1>(std::make_integer_sequence<int, PF_RK>{});
  static constexpr auto two = pf_scores_table<T, D, 2>(std::make_integer_sequence<int, PF_RK>{});
  const int64_t k_end = a.causal ? pos0 + it.ntok : a.lens[it.chunk], k_begin = k_end - it.keys;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += PF_KEYS) {
    const int64_t n = std::min(PF_KEYS, k_end - k0);
    pf_gather_keys<T, Fmt, D>(a, it, table, k0, n, w);
    // The next step's rows into L2 while this one computes: the kernel reads 8 rows at a time
    // a line of each per head-dim stride, which the hardware prefetchers do not follow (a
    // prefix out of cache, as decodes read it, ran at a third of the in-cache speed).
    for (int64_t kp = k0 + n; kp < std::min(k_end, k0 + n + PF_KEYS); kp++) {
      const int64_t row = (it.kh * a.nb + table[kp / a.bs]) * a.bs + kp % a.bs;
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(storage)); b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(a.kc + row * D) + b, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(a.vc + row * D) + b, _MM_HINT_T1);
      }
    }
    for (int64_t p = 0; p < panels; p += 2) {
      const auto& table_p = panels - p >= 2 ? two : one;
      for (int64_t k = 0; k < n; k += PF_RK)
        table_p[std::min<int64_t>(PF_RK, n - k) - 1](w.kr.data() + k, w.qt.data() + p * 16, ld,
                                                       w.s.data() + k * ld + p * 16, ld);
    }
    __m512 corr[64];
    for (int64_t p = 0; p < panels; p++)
      corr[p] = pf_softmax(w.s.data() + p * 16, ld, n, k0,
                           _mm512_loadu_si512(w.pos.data() + p * 16),
                           _mm512_loadu_si512(w.first.data() + p * 16), w.ksc.data(),
                           w.m.data() + p * 16, w.l.data() + p * 16);
    if constexpr (weigh) pf_weigh_keys(w.s.data(), ld, panels, n, w.vsc.data());
    const void* probs = w.s.data();
    const void* vals = w.vr.data();
    if constexpr (pf_pairs<T>) {
#if defined(__AVX512BF16__)
      pf_pair_keys<D>(w.s.data(), ld, panels, w.vr.data(), n, w.pp.data(), w.vp.data());
      probs = w.pp.data();
      vals = w.vp.data();
#endif
    }
    for (int64_t p = 0; p < panels; p += 2)
      for (int d0 = 0; d0 < D; d0 += PF_DB) {
        if (panels - p >= 2)
          pf_values<T, D, 2>(static_cast<const float*>(probs) + p * 16, ld, vals, n, d0,
                             corr + p, w.ot.data() + p * 16, ld);
        else
          pf_values<T, D, 1>(static_cast<const float*>(probs) + p * 16, ld, vals, n, d0,
                             corr + p, w.ot.data() + p * 16, ld);
      }
  }
  for (int64_t r = 0; r < rows; r++) {
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    const int64_t at = (a.starts[it.chunk] + it.tok0 + r / g) * a.heads + it.kh * g + r % g;
    T* o = a.out + at * D;
    for (int d = 0; d < D; d++) o[d] = from_f<T>(w.ot[d * ld + r] * inv);
    if (a.lse)
      a.lse[at] = w.l[r] > 0.f ? w.m[r] + std::log(w.l[r]) : -std::numeric_limits<float>::infinity();
  }
}

// Every item of the call (`tile` query tokens at most), longest (most keys) first.
std::vector<PrefillItem> prefill_items(const int64_t* starts, const int64_t* ends,
                                       const int64_t* lens, int64_t chunks, int64_t kvh,
                                       int64_t tile, int64_t window, bool causal) {
  std::vector<PrefillItem> items;
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t qlen = ends[c] - starts[c];
    for (int64_t t0 = 0; t0 < qlen; t0 += tile) {
      const int64_t ntok = std::min(tile, qlen - t0);
      const int64_t last = causal ? lens[c] - qlen + t0 + ntok - 1 : lens[c] - 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - ntok + 1 - window + 1) : 0;
      for (int64_t kh = 0; kh < kvh; kh++) items.push_back({c, t0, ntok, kh, last + 1 - first});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const PrefillItem& x, const PrefillItem& y) { return x.keys > y.keys; });
  return items;
}

template <typename T, typename Fmt, int D>
void prefill_run(const PrefillArgs<T, Fmt>& a, const std::vector<PrefillItem>& items,
                 int64_t tile) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t ld = (tile * a.g + 15) / 16 * 16;
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t b, int64_t e) {
    PrefillScratch<T, D> w(ld, !std::is_same_v<typename Fmt::storage, T>);
    for (int64_t i = next++; i < n; i = next++) pf_item<T, Fmt, D>(a, items[i], w);
    (void)b;
    (void)e;
  });
}
#else
#define PAGEDKV_PREFILL 0
bool prefill_supports(int64_t, at::ScalarType) { return false; }
#endif  // __AVX512F__ && __AVX512BW__

bool paged_prefill_supports(int64_t head_dim, at::ScalarType dtype) {
  return prefill_supports(head_dim, dtype);
}

// Causal attention of prefill chunks over their paged K/V (already in the cache, the chunk's
// own keys included): chunk c is q rows starts[c] .. ends[c] - 1 at positions lens[c] -
// (ends[c] - starts[c]) .. lens[c] - 1, its blocks block_tables[c]; window > 0: a token at p
// sees p - window + 1 .. p. Not causal (window 0): every row of chunk c sees keys 0 ..
// lens[c] - 1 (decodes over a shared prefix: cascade attention's first part). q [T, H, D]
// (contiguous heads), caches [KVH, NB, BS, D] of q's dtype, int8 (with k_scales and v_scales
// [KVH, NB, BS] float32: a stored value times its token's scale) or fp8 (e4m3fn, e5m2; their
// scales folded in by the caller); writes those rows of out [T, H, D] and, when given, of lse
// [T, H] float32 (log-sum-exp of each row's scaled scores). Only where
// paged_prefill_supports(D, q's dtype).
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& starts, const at::Tensor& ends,
                             const at::Tensor& seq_lens, int64_t window, double scale,
                             at::Tensor& out, bool causal, const c10::optional<at::Tensor>& lse,
                             const c10::optional<at::Tensor>& k_scales,
                             const c10::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
              out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "paged_prefill_attention: q must be [T, H, D] with contiguous heads, out like q");
  const at::ScalarType cache_t = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == cache_t &&
              k_cache.size(3) == q.size(2) &&
              (cache_t == q.scalar_type() || cache_t == at::kChar ||
               cache_t == at::kFloat8_e4m3fn || cache_t == at::kFloat8_e5m2),
              "paged_prefill_attention: caches must be contiguous [KVH, NB, BS, D] of one dtype: "
              "q's, int8 or fp8");
  TORCH_CHECK(k_scales.has_value() == v_scales.has_value() &&
              k_scales.has_value() == (cache_t == at::kChar),
              "paged_prefill_attention: int8 caches need k_scales and v_scales, others none");
  check_scales(k_scales, k_cache, "k_scales", "paged_prefill_attention");
  check_scales(v_scales, v_cache, "v_scales", "paged_prefill_attention");
  const int64_t d = q.size(2), kvh = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(prefill_supports(d, q.scalar_type()), "paged_prefill_attention: head size ", d,
              " in ", q.scalar_type(), " is not supported by this build");
  TORCH_CHECK(q.size(1) % kvh == 0, "paged_prefill_attention: ", q.size(1),
              " query heads over ", kvh, " KV heads");
  TORCH_CHECK(causal || window <= 0, "paged_prefill_attention: a window needs causal rows");
  float* lsep = nullptr;
  if (lse.has_value()) {
    TORCH_CHECK(lse->is_contiguous() && lse->scalar_type() == at::kFloat && lse->dim() == 2 &&
                lse->size(0) == q.size(0) && lse->size(1) == q.size(1),
                "paged_prefill_attention: lse must be contiguous float32 [T, H]");
    lsep = lse->data_ptr<float>();
  }
  auto bt = block_tables.to(at::kLong).contiguous();
  auto st = starts.to(at::kLong).contiguous(), en = ends.to(at::kLong).contiguous();
  auto sl = seq_lens.to(at::kLong).contiguous();
  const int64_t chunks = st.numel(), width = bt.dim() == 2 ? bt.size(1) : 0;
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == chunks && en.numel() == chunks && sl.numel() == chunks,
              "paged_prefill_attention: one table row, start, end and length per chunk");
  const int64_t *btp = bt.data_ptr<int64_t>(), *stp = st.data_ptr<int64_t>();
  const int64_t *enp = en.data_ptr<int64_t>(), *slp = sl.data_ptr<int64_t>();
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t qlen = enp[c] - stp[c];
    TORCH_CHECK(stp[c] >= 0 && qlen >= 0 && enp[c] <= q.size(0) && (!causal || qlen <= slp[c]) &&
                slp[c] <= width * bs, "paged_prefill_attention: chunk ", c, " (rows ", stp[c],
                " .. ", enp[c], ", length ", slp[c], ") does not fit q or its block table");
    const int64_t first = window > 0 ? std::max<int64_t>(0, slp[c] - qlen - window + 1) : 0;
    for (int64_t b = first / bs; b * bs < slp[c]; b++)
      TORCH_CHECK(btp[c * width + b] >= 0 && btp[c * width + b] < nb,
                  "paged_prefill_attention: block id ", btp[c * width + b], " out of range");
  }
#if PAGEDKV_PREFILL
  const int64_t g = q.size(1) / kvh;
  const int64_t tile = pf_tile_tokens(g, cache_t != q.scalar_type());
  const auto items = prefill_items(stp, enp, slp, chunks, kvh, tile, window, causal);
  const float* ksp = k_scales ? k_scales->data_ptr<float>() : nullptr;
  const float* vsp = v_scales ? v_scales->data_ptr<float>() : nullptr;
  dispatch(q.scalar_type(), "paged_prefill_attention", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
      auto run = [&](auto fmt) {
        using Fmt = decltype(fmt);
        using storage = typename Fmt::storage;
        const PrefillArgs<T, Fmt> a{q.data_ptr<T>(), q.stride(0), q.size(1), kvh, nb, bs, g,
                                    width, window,
                                    static_cast<const storage*>(k_cache.data_ptr()),
                                    static_cast<const storage*>(v_cache.data_ptr()), ksp, vsp,
                                    stp, enp, slp, btp, static_cast<float>(scale),
                                    out.data_ptr<T>(), causal, lsep};
        if (d == 64) prefill_run<T, Fmt, 64>(a, items, tile);
        else prefill_run<T, Fmt, 128>(a, items, tile);
      };
      switch (cache_t) {
        case at::kChar: run(Int8Fmt{}); break;
        case at::kFloat8_e4m3fn: run(E4M3Fmt{}); break;
        case at::kFloat8_e5m2: run(E5M2Fmt{}); break;
        default: run(SameFmt<T>{}); break;
      }
    }
  });
#else
  (void)k_scales;
  (void)v_scales;
#endif
}

}  // namespace
}  // namespace pagedkv_cpu

TORCH_LIBRARY(pagedkv_cpu, m) {
  using namespace pagedkv_cpu;
  m.def("pack_panels(Tensor w) -> Tensor", &pack_panels);
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor", &panel_linear);
  m.def("panel_isa() -> str", &panel_isa);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor",
        &add_rms_norm_);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()", &rope_);
  m.def("write_kv_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &write_kv_);
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor first_pos, Tensor seq_lens, float scale, Tensor(a!) out, Tensor(b!)? lse) -> ()",
        &paged_decode_attention);
  m.def("paged_decode_attention_q(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scales, "
        "Tensor? v_scales, Tensor block_tables, Tensor first_pos, Tensor seq_lens, float scale, "
        "Tensor(a!) out, Tensor(b!)? lse) -> ()", &paged_decode_attention_q);
  m.def("write_kv_int8_(Tensor x, Tensor(a!) cache, Tensor(b!) scales, Tensor slot_mapping) -> ()",
        &write_kv_int8_);
  m.def("write_kv_fp8_(Tensor x, Tensor(a!) cache, Tensor slot_mapping) -> ()", &write_kv_fp8_);
  m.def("paged_prefill_supports(int head_dim, ScalarType dtype) -> bool", &paged_prefill_supports);
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor starts, Tensor ends, Tensor seq_lens, int window, float scale, Tensor(a!) out, "
        "bool causal=True, Tensor(b!)? lse=None, Tensor? k_scales=None, "
        "Tensor? v_scales=None) -> ()",
        &paged_prefill_attention);
}
