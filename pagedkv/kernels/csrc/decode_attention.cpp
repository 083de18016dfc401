// Paged decode attention: one query row per sequence (or per token of a chunk laid out as
// rows) over its keys in the paged cache, read in place in any of kv_formats.h's formats.
// decode_impl takes any head size; decode_fixed, head sizes 64 and 128 with the rows in tiles.
#include <numeric>

#include "common.h"
#include "kv_formats.h"
#include "ops.h"
#include "simd.h"

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

// One block of n scores p of one query head through the online softmax: p becomes
// exp(p - max), the running max m and sum l take the block in; returns the factor the head's
// earlier output accumulator must be scaled by (0 on the first block, m = -inf). Mutates p, m, l.
inline float softmax_block(float* p, int64_t n, float& m, float& l) {
#if PAGEDKV_QW == 16
  // The same steps 16 lanes at a time (exp16: fast_exp's polynomial), the tail masked.
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax = neg_inf;
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, k, p + t));
  }
  const float mx = std::max(m, _mm512_reduce_max_ps(vmax));
  const float corr = m == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(m - mx);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + t), vmx));
    _mm512_mask_storeu_ps(p + t, k, e);
    vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
  }
  l = l * corr + _mm512_reduce_add_ps(vsum);
  m = mx;
  return corr;
#else
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
#endif
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

// Key positions a part of a split range holds at least (below, a range is not split): a lone
// decode of SmolLM2's shape on two Zen 4 threads, 3 KV heads, gains 1.02x at 130 keys, 1.11x at
// 250, 1.15x at 450 and 1.3x from 600.
constexpr int64_t kMinPartRows = 64;

// Parts each key range of a call is cut into: 1 unless the call's items (sequences or tiles,
// times KV heads) are fewer than twice the threads, as a lone decode's are (SmolLM2's 3 KV
// heads on 2 threads: one thread read two heads' keys while the other waited; on 16 threads
// 13 waited); then enough parts that the items divide evenly over the threads, each at least
// kMinPartRows of the longest range. Each part keeps its own online softmax and hands its
// state to `put`; `finish` merges a row's parts by their maxima once all are in (split-K,
// "flash decoding"). With one part `put` finishes the heads at once: the unsplit kernel.
class KeyParts {
 public:
  int64_t parts = 1;

  // A call of `rows` query rows over `kvh` KV heads of g query heads of d values each, its
  // longest key range `longest` keys, on `threads` threads; `unit`: finish_heads'.
  KeyParts(int64_t items, int64_t longest, int64_t threads, int64_t rows, int64_t kvh, int64_t g,
           int64_t d, float unit)
      : kvh_(kvh), g_(g), d_(d), unit_(unit) {
    if (threads > 1 && items > 0 && items < 2 * threads)
      parts = std::max<int64_t>(
          1, std::min(threads / std::gcd(items, threads), longest / kMinPartRows));
    if (parts > 1) states_.resize(rows * kvh * parts * state_floats());
  }

  // Part `part` of the key range [first, len): whole blocks of `bs` from first, the last part
  // the rest (empty where the range is short).
  std::pair<int64_t, int64_t> range(int64_t first, int64_t len, int64_t part, int64_t bs) const {
    const int64_t per = ((len - first + parts - 1) / parts + bs - 1) / bs * bs;
    const int64_t lo = std::min(len, first + part * per);
    return {lo, part + 1 == parts ? len : std::min(len, lo + per)};
  }

  // Row r's g heads of KV head kh over part `part` of its keys: their accumulators acc [g, d],
  // maxima m and sums l (the online softmax's state). One part: finished into out / lse (the
  // call's [rows, heads, d] and [rows, heads]); more: kept for `finish`. Writes one or the
  // other (threads write distinct items).
  template <typename scalar_t>
  void put(int64_t r, int64_t kh, int64_t part, const float* acc, const float* m, const float* l,
           scalar_t* out, float* lse) {
    if (parts == 1) {
      const int64_t at = r * kvh_ * g_ + kh * g_;
      finish_heads(acc, m, l, g_, d_, unit_, out + at * d_, lse ? lse + at : nullptr);
      return;
    }
    float* state = states_.data() + ((r * kvh_ + kh) * parts + part) * state_floats();
    std::memcpy(state, acc, g_ * d_ * sizeof(float));
    std::memcpy(state + g_ * d_, m, g_ * sizeof(float));
    std::memcpy(state + g_ * d_ + g_, l, g_ * sizeof(float));
  }

  // Every row's heads from their parts' states (nothing with one part): the states merged by
  // their maxima (m = -inf where a part saw no key), then finished. Writes out and lse.
  template <typename scalar_t>
  void finish(scalar_t* out, float* lse) const {
    if (parts == 1) return;
    constexpr float none = -std::numeric_limits<float>::infinity();
    const int64_t g = g_, d = d_, stride = state_floats();
    std::vector<float> acc(g * d), m(g), l(g);
    for (int64_t item = 0; item < static_cast<int64_t>(states_.size()) / (parts * stride);
         item++) {
      const float* states = states_.data() + item * parts * stride;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t h = 0; h < g; h++) {
        float top = none;
        for (int64_t p = 0; p < parts; p++) top = std::max(top, states[p * stride + g * d + h]);
        m[h] = top;
        for (int64_t p = 0; p < parts && top != none; p++) {
          const float* part = states + p * stride;
          if (part[g * d + h] == none) continue;
          const float w = std::exp(part[g * d + h] - top);
          l[h] += part[g * d + g + h] * w;
          for (int64_t j = 0; j < d; j++) acc[h * d + j] += part[h * d + j] * w;
        }
      }
      // item = r * kvh + kh: its heads start at (r * kvh + kh) * g of the call's heads
      finish_heads(acc.data(), m.data(), l.data(), g, d, unit_, out + item * g * d,
                   lse ? lse + item * g : nullptr);
    }
  }

 private:
  int64_t kvh_, g_, d_;
  float unit_;
  std::vector<float> states_;  // ((r * kvh + kh) * parts + part) * state_floats()

  int64_t state_floats() const { return g_ * (d_ + 2); }
};

// The threads a call's items are shared over (1 within another parallel region).
inline int64_t call_threads() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

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
  const int64_t s_n = a.s_n, d = q.size(2), kvh = a.kvh, nb = a.nb, bs = a.bs;
  const int64_t g = a.g, sq = a.sq;
  const scalar_t* qp = a.qp;
  const storage *kc = a.kc, *vc = a.vc;
  int64_t longest = 0;
  for (int64_t s = 0; s < s_n; s++) longest = std::max(longest, slp[s] - fpp[s]);
  KeyParts split(s_n * kvh, longest, call_threads(), s_n, kvh, g, d, 1.f);
  const int64_t parts = split.parts;
  at::parallel_for(0, s_n * kvh * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), kf(bs * d), vf(bs * d), p(g * bs), m(g), l(g);
    for (int64_t item = begin; item < end; item++) {
      const int64_t s = item / (kvh * parts), kh = item / parts % kvh, part = item % parts;
      const auto [first, len] = split.range(fpp[s], slp[s], part, bs);
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
      split.put(s, kh, part, acc.data(), m.data(), l.data(), a.op, lsep);
    }
  });
  split.finish(a.op, lsep);
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

// The next block's rows, asked for into the cache a row at a time as the rows of the block in
// hand are used (k_row while its keys are scored, v_row while its values are weighed), so
// that memory works while the core computes: prefetching a whole block at once filled the
// core's miss buffers and stalled it until the block came in. Into L2 on AMD's cores, L1 on
// others (prefetch_lines, common.h: on a Zen 4 the L1 prefetches left scattered blocks read at
// 8-9 GB/s a core, the L2 ones at 19-21; bench_decode_kernel.py). Empty (k, v null): nothing.
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t row_bytes = 0;
  void k_row(int64_t t) const { if (k) row(k, t); }
  void v_row(int64_t t) const { if (v) row(v, t); }
  void row(const char* base, int64_t t) const {
    prefetch_lines(base + t * row_bytes, row_bytes);
  }
};

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
                         int64_t ps, const Prefetch& pf) {
  constexpr int C = D / QW;
  rows_scores<G>(n, p, ps, 1.f, [&](int64_t t, vqf* a) {
    pf.k_row(t);
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
                              float* p, int64_t ps, float scale, const Prefetch& pf) {
  constexpr int C2 = D / 32;
  __m512bh q[G * C2];
  for (int i = 0; i < G * C2; i++) q[i] = (__m512bh)_mm512_loadu_si512(qb + i * 32);
  rows_scores<G>(n, p, ps, scale, [&](int64_t t, vqf* a) {
    pf.k_row(t);
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
  prefetch_lines(a, bytes);
  prefetch_lines(b, bytes);
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
  // Room for n row-heads (grown, never shrunk; the contents are each item's to set).
  void fit(int64_t n, bool with_qb) {
    if (static_cast<int64_t>(m.size()) >= n &&
        (!with_qb || static_cast<int64_t>(qb.size()) >= n * D))
      return;
    qf.resize(n * C), acc.resize(n * C), q16.resize(n * C / 2), qscale.resize(n), m.resize(n),
        l.resize(n);
    if (with_qb) qb.resize(n * D);
  }
};

// acc[h] = acc[h] * corr[h] + sum_t w[h][t] * v[t] for H query heads (acc: C vectors each;
// w: H rows of n weights, ws apart) over the n value rows at vb: H * C accumulators stay in
// registers and each value vector is widened once for all H heads. With one head, even and
// odd rows go to two partial sums, so that 2C chains of FMAs are in flight rather than C (a
// chain waits out each FMA's latency). Mutates acc.
template <typename VFmt, int D, int H>
inline void weigh_values(vqf* acc, const float* corr, const float* w, int64_t ws,
                         const typename VFmt::storage* vb, int64_t n, const Prefetch& pf) {
  constexpr int C = D / QW, U = H == 1 ? 2 : 1;
  vqf a[U][H][C];
  for (int h = 0; h < H; h++)
    for (int c = 0; c < C; c++) {
      a[0][h][c] = acc[h * C + c] * corr[h];
      if constexpr (U == 2) a[1][h][c] = vqf{};
    }
  auto row = [&](int u, int64_t t) {
    pf.v_row(t);
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
                        int64_t n, float* p, int64_t ps, float scale, const Prefetch& pf) {
  if constexpr (bf16_dot<KFmt>) {
#if PAGEDKV_BF16_DOT
    block_scores_bf16<D, G>(st.qb.data() + i * D, kb, n, p, ps, scale, pf);
#endif
  } else {
    (void)scale;
    block_scores<KFmt, D, G>(st.qf.data() + i * (D / QW), kb, n, p, ps, pf);
  }
}

// The g query heads i0 .. i0 + g - 1 of one row attend the n rows of one block at kb / vb
// (KFmt / VFmt: the cache's format read in place, or a tile's widened copy); ks / vs: the rows'
// int8 scales (null otherwise); p: g rows of ps >= n scores, corr: g factors, dots: g rows of
// DOTS values (scratch); scale: the softmax scale (head_scores). Key rows are scored for a pair of
// heads at once (head_scores), value rows weighed for up to 16 / C heads at once
// (weigh_values). `pf`: the next block's first n rows, prefetched as these are used (an int8
// cache's keys at once). Mutates the heads' m, l and accumulators.
template <typename KFmt, typename VFmt, bool int8, int D>
inline void attend_row(RowHeads<D>& st, int64_t i0, int64_t g, const typename KFmt::storage* kb,
                       const typename VFmt::storage* vb, const float* ks, const float* vs,
                       int64_t n, int64_t ps, float* p, float* corr, int32_t* dots, float scale,
                       const Prefetch& pf = {}) {
  constexpr int C = D / QW;
  constexpr int HB = C >= 16 ? 1 : C >= 8 ? 2 : 4;
  if constexpr (int8) {  // int8 keys: a pair of heads' dot products per key widened
    const vqs16* q16 = st.q16.data() + i0 * C / 2;
    for (int64_t t = 0; t < n; t++) pf.k_row(t);
    int64_t h = 0;
    for (; h + 2 <= g; h += 2) block_dots_int8<D, 2>(q16 + h * C / 2, kb, n, dots + h * DOTS);
    if (h < g) block_dots_int8<D, 1>(q16 + h * C / 2, kb, n, dots + h * DOTS);
  } else {
    int64_t h = 0;
    for (; h + 2 <= g; h += 2)
      head_scores<KFmt, D, 2>(st, i0 + h, kb, n, p + h * ps, ps, scale, h == 0 ? pf : Prefetch{});
    if (h < g)
      head_scores<KFmt, D, 1>(st, i0 + h, kb, n, p + h * ps, ps, scale, h == 0 ? pf : Prefetch{});
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
    const Prefetch& vpf = h == 0 ? pf : Prefetch{};
    switch (std::min<int64_t>(HB, g - h)) {
      case 1: weigh_values<VFmt, D, 1>(acc, corr + h, p + h * ps, ps, vb, n, vpf); break;
      case 2: weigh_values<VFmt, D, 2>(acc, corr + h, p + h * ps, ps, vb, n, vpf); break;
      case 3: weigh_values<VFmt, D, 3>(acc, corr + h, p + h * ps, ps, vb, n, vpf); break;
      default: weigh_values<VFmt, D, 4>(acc, corr + h, p + h * ps, ps, vb, n, vpf); break;
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
    // The next block (its own place in memory: no stream for the hardware to follow), or on
    // the last one the next item's first: its rows prefetched as this block's are used (pf),
    // the rest of them after.
    NextBlock ahead = after;
    if (pos + n < len)
      ahead = {(kh * nb + btp[lead_row * width + b + 1]) * bs, std::min(bs, len - pos - n)};
    else if (after.rows == 0)
      ahead = {};
    Prefetch pf;
    if (ahead.rows > 0) {
      pf = {reinterpret_cast<const char*>(a.kc + ahead.row * D),
            reinterpret_cast<const char*>(a.vc + ahead.row * D),
            static_cast<int64_t>(D * sizeof(storage))};
      if constexpr (int8) prefetch_rows(in.ksp + ahead.row, in.vsp + ahead.row, ahead.rows * sizeof(float));
    }
    int64_t fetched = 0;  // rows of `ahead` asked for so far
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
      const Prefetch& here = fetched == 0 ? pf : Prefetch{};
      if (widen && blk == lead)
        attend_row<KScratchFmt, SameFmt<float>, int8, D>(
            st, (r - r0) * g, g, sc.k.data() + lo * D, sc.v.data() + lo * D, ks, vs, hi - lo,
            SPAN, p, corr, dots, in.scale, here);
      else
        attend_row<Fmt, Fmt, int8, D>(st, (r - r0) * g, g, a.kc + row0 * D, a.vc + row0 * D,
                                      ks, vs, hi - lo, SPAN, p, corr, dots, in.scale, here);
      if (fetched == 0) fetched = std::min(hi - lo, ahead.rows);
    }
    for (int64_t t = fetched; t < ahead.rows; t++) {
      pf.k_row(t);
      pf.v_row(t);
    }
    pos += n;
  }
}

// A thread's scratch for decode_fixed's items, kept between calls (a call's few items would
// otherwise allocate and zero about 100 KB a thread each time: about a quarter of a lone
// 100-token decode's attention): grown to g query heads a KV head, never cleared (each item
// sets what it reads).
template <typename Fmt, int D> struct ItemScratch {
  RowHeads<D> st;
  TileScratch<Fmt, D> tile;
  std::vector<float> p, corr;
  std::vector<int32_t> dots;

  static ItemScratch& mine(int64_t g, bool with_qb) {
    static thread_local ItemScratch s;
    s.st.fit(TILE_ROWS * g, with_qb);
    if (static_cast<int64_t>(s.corr.size()) < g) {
      s.p.resize(g * SPAN);
      s.corr.resize(g);
      s.dots.resize(g * DOTS);
    }
    return s;
  }
};

// decode_impl for a compile-time head size D (a multiple of 2 * QW); same arguments, except
// that rows are taken in tiles (above): a tile on one block table (a prefill chunk) through
// attend_spans, others (decodes) through attend_blocks; a call of few tiles cuts their key
// ranges into parts (KeyParts) merged at the end.
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
  const int64_t kvh = a.kvh, g = a.g, sq = a.sq;
  const scalar_t* qp = a.qp;
  const std::vector<int64_t> tiles = row_tiles(btp, a.s_n, width);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) - 1;
  // Each tile's key range: [first, len) over its rows.
  std::vector<int64_t> firsts(std::max<int64_t>(num_tiles, 0)), lens(firsts.size());
  int64_t longest = 0;
  for (int64_t t = 0; t < num_tiles; t++) {
    int64_t first = std::numeric_limits<int64_t>::max(), len = 0;
    for (int64_t r = tiles[t]; r < tiles[t + 1]; r++) {
      first = std::min(first, fpp[r]);
      len = std::max(len, slp[r]);
    }
    firsts[t] = first, lens[t] = len;
    longest = std::max(longest, len - first);
  }
  KeyParts split(num_tiles * kvh, longest, call_threads(), a.s_n, kvh, g, D, fmt_unit<Fmt>);
  const int64_t parts = split.parts;
  auto part_range = [&](int64_t t, int64_t part) {
    return split.range(firsts[t], lens[t], part, a.bs);
  };
  // Item it's tile, KV head and part: a tile's parts side by side, tiles in zigzag order.
  struct Item { int64_t tile, kh, part; };
  auto item_of = [&](int64_t it) {
    const int64_t rest = it / parts;
    return Item{zigzag(rest / kvh, num_tiles), rest % kvh, it % parts};
  };
  // The first block item `it` reads (its tile's first row's), for prefetching.
  auto first_block = [&](int64_t it) {
    const Item w = item_of(it);
    const int64_t r = tiles[w.tile];
    const auto [lo, hi] = part_range(w.tile, w.part);
    const int64_t pos = std::max(fpp[r], lo);
    if (pos >= std::min(slp[r], hi)) return NextBlock{};
    const int64_t row = (w.kh * a.nb + btp[r * width + pos / a.bs]) * a.bs + pos % a.bs;
    return NextBlock{row, std::min(a.bs - pos % a.bs, std::min(slp[r], hi) - pos)};
  };
  const int64_t items = std::max<int64_t>(num_tiles, 0) * kvh * parts;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    auto& scratch = ItemScratch<Fmt, D>::mine(g, bf16_dot<Fmt>);
    RowHeads<D>& st = scratch.st;
    for (int64_t item = begin; item < end; item++) {
      const auto [tile, kh, part] = item_of(item);
      const int64_t r0 = tiles[tile], nr = tiles[tile + 1] - r0;
      const auto [lo, hi] = part_range(tile, part);
      const int64_t first = std::max(firsts[tile], lo), len = std::min(lens[tile], hi);
      bool one_table = true;
      for (int64_t r = r0; r < r0 + nr; r++) {
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
      if (first >= len) {
        // nothing to read (an empty part, or rows past their range)
      } else if (nr > 1 && one_table && !in_place_only) {
        attend_spans<scalar_t, Fmt, D>(in, st, scratch.tile, kh, r0, nr, first, len,
                                       scratch.p.data(), scratch.corr.data(),
                                       scratch.dots.data());
      } else {
        attend_blocks<scalar_t, Fmt, D>(in, st, scratch.tile, kh, r0, nr, first, len,
                                        scratch.p.data(), scratch.corr.data(),
                                        scratch.dots.data(),
                                        item + 1 < end ? first_block(item + 1) : NextBlock{});
      }
      for (int64_t r = r0; r < r0 + nr; r++)
        split.put(r, kh, part, reinterpret_cast<const float*>(st.acc.data() + (r - r0) * g * C),
                  st.m.data() + (r - r0) * g, st.l.data() + (r - r0) * g, a.op, lsep);
    }
  });
  split.finish(a.op, lsep);
}

}  // namespace

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

}  // namespace pagedkv_cpu
