// A step's new keys and values into their cache slots: in the model's dtype (write_kv_), as
// int8 with a scale per token and head (write_kv_int8_) or as fp8 (write_kv_fp8_).
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include "common.h"
#include "ops.h"
#include "simd.h"

namespace pagedkv_cpu {

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
    const size_t row_bytes = static_cast<size_t>(d) * sizeof(scalar_t);
    // One head of one tensor at a time: the writes stream through that head's cache blocks
    // (a prompt's slots run along its blocks), the reads along the strided rows.
    auto copy_rows = [&](scalar_t* cache, const scalar_t* x, int64_t s0, int64_t s1, int64_t h,
                         int64_t b, int64_t e) {
      scalar_t* head = cache + h * slots * d;
      const scalar_t* src = x + h * s1;
      for (int64_t i = b; i < e; i++)
        if (sp[i] >= 0) std::memcpy(head + sp[i] * d, src + i * s0, row_bytes);
    };
    at::parallel_for(0, t, 64, [&](int64_t b, int64_t e) {
      for (int64_t h = 0; h < kvh; h++) {
        copy_rows(kc, kp, sk0, sk1, h, b, e);
        copy_rows(vc, vp, sv0, sv1, h, b, e);
      }
    });
  });
}

namespace {

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

}  // namespace

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

}  // namespace pagedkv_cpu
