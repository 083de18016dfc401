// Paged prefill attention: chunks of query tokens over their cached prefix and themselves,
// straight from the paged cache (flash-style tiles, AVX-512 builds; paged_prefill_supports says
// which head sizes and dtypes).
#include <array>
#include <atomic>
#include <utility>

#include "common.h"
#include "kv_formats.h"
#include "ops.h"
#include "simd.h"

namespace pagedkv_cpu {

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
namespace {

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
  // Row r of the tile is query head kh * g + r % g of token tok0 + r / g.
  auto row_of = [&](int64_t r) { return (a.starts[it.chunk] + it.tok0 + r / g) * a.heads + it.kh * g + r % g; };
  std::fill(w.ot.begin(), w.ot.begin() + D * ld, 0.f);
  for (int64_t r = 0; r < ld; r++) {
    const bool real = r < rows;
    const int64_t pos = a.causal ? pos0 + r / g : a.lens[it.chunk] - 1;
    w.pos[r] = real ? static_cast<int32_t>(pos) : -1;
    w.first[r] = real && a.window > 0 ? static_cast<int32_t>(std::max<int64_t>(0, pos - a.window + 1)) : 0;
    w.m[r] = -std::numeric_limits<float>::infinity();
    w.l[r] = 0.f;
  }
  // Q^T: floats [D][ld], or bfloat16 head-dim pairs [D / 2][ld] (32 bits a lane either way),
  // 16 rows x 16 lanes at a time through registers; padding rows zero, unseeing.
  constexpr int64_t q_blocks = D * static_cast<int64_t>(sizeof(T)) / 64;  // 64 bytes of a row
  for (int64_t p = 0; p < panels; p++)
    for (int64_t b = 0; b < q_blocks; b++) {
      __m512i x[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; i++) {
        const int64_t r = p * 16 + i;
        x[i] = r < rows ? _mm512_loadu_si512(reinterpret_cast<const char*>(
                              a.q + (a.starts[it.chunk] + it.tok0 + r / g) * a.sq +
                              (it.kh * g + r % g) * D) + 64 * b)
                        : _mm512_setzero_si512();
      }
      transpose16(x);
      int32_t* qt = reinterpret_cast<int32_t*>(w.qt.data());
#pragma GCC unroll 16
      for (int l = 0; l < 16; l++) _mm512_storeu_si512(qt + (b * 16 + l) * ld + p * 16, x[l]);
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
  // out = O^T / l, transposed back 16 rows x 16 head dims at a time (rows with l = 0: zero;
  // bfloat16 rounded to nearest even by vcvtneps2bf16, which reads float32 subnormals as zero:
  // far below any output's last place).
  for (int64_t p = 0; p < panels; p++) {
    const __m512 l = _mm512_loadu_ps(w.l.data() + p * 16);
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ),
                                           _mm512_set1_ps(1.f), l);
    for (int64_t b = 0; b < D / 16; b++) {
      __m512i x[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; i++)
        x[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(w.ot.data() + (b * 16 + i) * ld + p * 16), inv));
      transpose16(x);
#pragma GCC unroll 16
      for (int i = 0; i < 16; i++) {
        if (p * 16 + i >= rows) break;
        T* o = a.out + row_of(p * 16 + i) * D + b * 16;
        if constexpr (pf_pairs<T>) {
#if defined(__AVX512BF16__)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(x[i])));
#endif
        } else {
          _mm512_storeu_ps(o, _mm512_castsi512_ps(x[i]));
        }
      }
    }
  }
  if (a.lse)
    for (int64_t r = 0; r < rows; r++)
      a.lse[row_of(r)] = w.l[r] > 0.f ? w.m[r] + std::log(w.l[r]) : -std::numeric_limits<float>::infinity();
}

// Prefetches item `it`'s query rows into L2.
template <typename T, typename Fmt, int D>
void pf_prefetch_queries(const PrefillArgs<T, Fmt>& a, const PrefillItem& it) {
  for (int64_t t = 0; t < it.ntok; t++) {
    const char* q = reinterpret_cast<const char*>(a.q + (a.starts[it.chunk] + it.tok0 + t) * a.sq +
                                                  it.kh * a.g * D);
    for (int64_t b = 0; b < a.g * D * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(q + b, _MM_HINT_T1);
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
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    PrefillScratch<T, D> w(ld, !std::is_same_v<typename Fmt::storage, T>);
    // Each thread claims its next item one ahead and fetches that item's query rows into L2
    // while it attends this one (they come from the QKV projection, out of L2 by now: their
    // loads were an eighth of a 256-token prompt's attention on Zen 4); not in the last
    // `threads` items, so that a claimed item never waits while another thread has none.
    for (int64_t i = next++; i < n;) {
      int64_t j = n;
      if (next.load(std::memory_order_relaxed) + threads < n) {
        j = next++;
        if (j < n) pf_prefetch_queries<T, Fmt, D>(a, items[j]);
      }
      pf_item<T, Fmt, D>(a, items[i], w);
      i = j < n ? j : next++;
    }
    (void)b;
    (void)e;
  });
}
#else
#define PAGEDKV_PREFILL 0
bool prefill_supports(int64_t, at::ScalarType) { return false; }
#endif  // __AVX512F__ && __AVX512BW__

}  // namespace

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

}  // namespace pagedkv_cpu
