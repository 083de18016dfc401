// Packed 4-bit group-32 weights (pagedkv/model/quant/int4_blocks.py: GGUF Q4_0, Q4_1, Q4_K):
// - `int4_expand`, what the packed linear runs beyond decode sizes (a prefill's hundreds of
//   rows): the dense weight, for oneDNN's matmul, which beats any int4 kernel there. Its
//   decode-sized calls run torch's _weight_int4pack_mm_for_cpu (model/quant/int4_linear.py).
// - `int4_gemv`: integer dot products on the packed codes (scales and zeros laid [N, K/32, 2],
//   a row's together), measured against torch's int4 kernel by benchmarks/
//   bench_quant_linear.py (`int4gemv`): on par at one row, slower from four rows and on a
//   busy machine (model/quant/int4_linear.py), so the linear keeps torch's.
//   Each activation row is quantized once per call to int16 per group of 32 (q = round(x / d),
//   d = max|x| / 32767; the group's exact float sum kept beside), then per weight row and group:
//   scale * d * sum(code * q) + (zero - 8 * scale) * sum(x), the integer sum with AVX-512 VNNI
//   (vpdpwssd, 4 groups a register) or AVX2 (vpmaddwd), float32 across groups. (int8
//   activations, llama.cpp's, flip close greedy choices of the tiny test models.)
// - `int8_gemv`: int8 codes with one scale per weight row (the LM head's copy, model/quant/
//   packed_head.py) against activations quantized to int16 per row (vpdpwssd, or AVX2's
//   vpmaddwd): the head's logits see less than a bfloat16 rounding of the activations.
// Output rows are split over threads in blocks of 16, and each block's weights are read once
// for every 4 activation rows (the later reads hit the L1/L2 cache).
// Registered as a fragment of the pagedkv_cpu library (bindings.cpp holds the rest).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDKV_INT_VNNI 1
#endif

namespace pagedkv_cpu {
namespace {

constexpr int64_t kInt4Group = 32;

// A group's 32 values, rounded once to T.
template <typename T>
inline void store_group(const float* lo, const float* hi, T* o) {
  for (int j = 0; j < 16; ++j) {
    o[j] = static_cast<T>(lo[j]);
    o[16 + j] = static_cast<T>(hi[j]);
  }
}

// bfloat16: round to nearest even on the bits (the values are finite), which the compiler
// vectorizes (c10::BFloat16's conversion, with its NaN branch, it does not: 4x slower).
inline uint16_t int4_to_bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

template <>
inline void store_group<c10::BFloat16>(const float* lo, const float* hi, c10::BFloat16* o) {
  uint16_t* out = reinterpret_cast<uint16_t*>(o);
  for (int j = 0; j < 16; ++j) {
    out[j] = int4_to_bf16_bits(lo[j]);
    out[16 + j] = int4_to_bf16_bits(hi[j]);
  }
}

// Row n of the weight: out[g*32 + j] = (code - 8) * scale + zero for the group's codes, where
// byte j of a group holds code j (low nibble) and code j + 16 (high nibble).
#if defined(__AVX512BF16__)
// bfloat16 rows with AVX512-BF16: 16 codes a register, one fused multiply-add, vcvtneps2bf16
// (round to nearest even, as the scalar path).
inline void int4_expand_row_bf16(const uint8_t* nib, const c10::BFloat16* sz, int64_t n_rows,
                                 int64_t groups, c10::BFloat16* out) {
  const __m512i low4 = _mm512_set1_epi32(15);
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = static_cast<float>(sz[2 * (g * n_rows)]);
    const __m512 s = _mm512_set1_ps(scale);
    const __m512 z = _mm512_set1_ps(static_cast<float>(sz[2 * (g * n_rows) + 1]) - 8.0f * scale);
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + g * (kInt4Group / 2))));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), s, z);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, z);
    __m256i* o = reinterpret_cast<__m256i*>(out + g * kInt4Group);
    _mm256_storeu_si256(o, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
    _mm256_storeu_si256(o + 1, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
  }
}
#endif

template <typename T>
void int4_expand_row(const uint8_t* nib, const c10::BFloat16* sz, int64_t n_rows, int64_t groups,
                     T* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = static_cast<float>(sz[2 * (g * n_rows)]);
    const float zero = static_cast<float>(sz[2 * (g * n_rows) + 1]) - 8.0f * scale;
    const uint8_t* b = nib + g * (kInt4Group / 2);
    T* o = out + g * kInt4Group;
    float lo[16], hi[16];
    for (int j = 0; j < 16; ++j) {
      lo[j] = static_cast<float>(b[j] & 15) * scale + zero;
      hi[j] = static_cast<float>(b[j] >> 4) * scale + zero;
    }
    store_group(lo, hi, o);
  }
}

template <typename T>
void int4_expand_as(const at::Tensor& nibbles, const at::Tensor& scale_zero, at::Tensor& out) {
  const int64_t n = nibbles.size(0), half_k = nibbles.size(1), groups = 2 * half_k / kInt4Group;
  const uint8_t* nib = nibbles.data_ptr<uint8_t>();
  const c10::BFloat16* sz = scale_zero.data_ptr<c10::BFloat16>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        int4_expand_row_bf16(nib + r * half_k, sz + 2 * r, n, groups, dst + r * 2 * half_k);
        continue;
      }
#endif
      int4_expand_row<T>(nib + r * half_k, sz + 2 * r, n, groups, dst + r * 2 * half_k);
    }
  });
}

// nibbles: uint8 [N, K/2]; scale_zero: bfloat16 [K/32, N, 2] (torch's int4pack scales);
// returns W [N, K] in `dtype` (float32, bfloat16 or float16), each value rounded once.
at::Tensor int4_expand(const at::Tensor& nibbles, const at::Tensor& scale_zero,
                       at::ScalarType dtype) {
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte && nibbles.is_contiguous(),
              "int4_expand: nibbles must be a contiguous uint8 [N, K/2]");
  const int64_t n = nibbles.size(0), k = 2 * nibbles.size(1);
  TORCH_CHECK(k % kInt4Group == 0, "int4_expand: K must be a multiple of 32, got ", k);
  TORCH_CHECK(scale_zero.scalar_type() == at::kBFloat16 && scale_zero.is_contiguous() &&
                  scale_zero.dim() == 3 && scale_zero.size(0) == k / kInt4Group &&
                  scale_zero.size(1) == n && scale_zero.size(2) == 2,
              "int4_expand: scale_zero must be a contiguous bfloat16 [K/32, N, 2]");
  at::Tensor out = at::empty({n, k}, nibbles.options().dtype(dtype));
  switch (dtype) {
    case at::kFloat: int4_expand_as<float>(nibbles, scale_zero, out); break;
    case at::kBFloat16: int4_expand_as<c10::BFloat16>(nibbles, scale_zero, out); break;
    case at::kHalf: int4_expand_as<c10::Half>(nibbles, scale_zero, out); break;
    default: TORCH_CHECK(false, "int4_expand: dtype must be float32, bfloat16 or float16");
  }
  return out;
}


// ---- decode-sized products on the packed codes ----

constexpr int64_t kGemvBlock = 16;  // weight rows a task takes at a time
constexpr int kGemvRows = 4;        // activation rows one pass over a weight block computes
constexpr int kGemvCols = 4;        // weight rows one call computes together (independent sums)

// Activation rows quantized per group of 32: q[m][g * 32 + j] (int16), d[m][g] (the step),
// sum[m][g] (the group's float sum of x).
struct GroupRows {
  int64_t rows = 0, groups = 0;
  std::vector<int16_t> q;
  std::vector<float> d, sum;
};

template <typename T>
GroupRows quantize_groups(const T* x, int64_t rows, int64_t k) {
  GroupRows a;
  a.rows = rows;
  a.groups = k / kInt4Group;
  a.q.resize(rows * k);
  a.d.resize(rows * a.groups);
  a.sum.resize(rows * a.groups);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < a.groups; ++g) {
      const T* src = x + m * k + g * kInt4Group;
      float v[kInt4Group], amax = 0.f, total = 0.f;
      for (int j = 0; j < kInt4Group; ++j) {
        v[j] = static_cast<float>(src[j]);
        amax = std::max(amax, std::fabs(v[j]));
        total += v[j];
      }
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      int16_t* q = a.q.data() + m * k + g * kInt4Group;
      for (int j = 0; j < kInt4Group; ++j) q[j] = static_cast<int16_t>(std::nearbyint(v[j] * inv));
      a.d[m * a.groups + g] = amax / 32767.f;
      a.sum[m * a.groups + g] = total;
    }
  }
  return a;
}

// Runs row_fn(r, nr, m0, mr, y) for every run of nr (kGemvCols, or 1 at the end) weight rows
// from r and of mr (up to kGemvRows) activation rows from m0 (y[i * nr + j]: activation row
// m0 + i, weight row r + j), weight rows split over threads in blocks of kGemvBlock.
template <typename RowFn>
void for_each_output(int64_t n, int64_t m, RowFn row_fn) {
  const int64_t blocks = (n + kGemvBlock - 1) / kGemvBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    float y[kGemvRows * kGemvCols];
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t r_end = std::min(n, (blk + 1) * kGemvBlock);
      for (int64_t m0 = 0; m0 < m; m0 += kGemvRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kGemvRows, m - m0));
        for (int64_t r = blk * kGemvBlock; r < r_end;) {
          const int nr = r + kGemvCols <= r_end ? kGemvCols : 1;
          row_fn(r, nr, m0, mr, y);
          r += nr;
        }
      }
    }
  });
}

#if defined(PAGEDKV_INT_VNNI)
// The int4 product's activations re-laid for vpdpwssd: per chunk of 4 groups (what 64 code
// bytes hold), four registers of 32 int16: values 0-15 of groups 0 and 1, of groups 2 and 3
// (what the low nibbles pair with), then values 16-31 of the same (the high nibbles); per
// chunk and lane the step (8 lanes a group: groups 0, 1 and 2, 3 as the integer sums lie) and
// a quarter of the group's sum (4 lanes a group, in order). Groups past the last are zeros.
struct Int4Act {
  int64_t chunks = 0;
  std::vector<int16_t> q;
  std::vector<float> d, quarter_sum;
};

Int4Act int4_act(const GroupRows& a) {
  Int4Act p;
  p.chunks = (a.groups + 3) / 4;
  p.q.assign(a.rows * p.chunks * 128, 0);
  p.d.assign(a.rows * p.chunks * 32, 0.f);
  p.quarter_sum.assign(a.rows * p.chunks * 16, 0.f);
  for (int64_t m = 0; m < a.rows; ++m) {
    for (int64_t g = 0; g < a.groups; ++g) {
      const int64_t c = m * p.chunks + g / 4, slot = g % 4;
      const int16_t* q = a.q.data() + (m * a.groups + g) * kInt4Group;
      std::memcpy(p.q.data() + c * 128 + slot * 16, q, 16 * sizeof(int16_t));
      std::memcpy(p.q.data() + c * 128 + 64 + slot * 16, q + 16, 16 * sizeof(int16_t));
      const float d = a.d[m * a.groups + g];
      for (int l = 0; l < 8; ++l) p.d[c * 32 + (slot / 2) * 16 + (slot % 2) * 8 + l] = d;
      for (int l = 0; l < 4; ++l)
        p.quarter_sum[c * 16 + slot * 4 + l] = 0.25f * a.sum[m * a.groups + g];
    }
  }
  return p;
}

// Weight rows r .. r + NR - 1 (nib, sz at row r) against activation rows m0 .. m0 + MR - 1:
// y[i * NR + j]. NR rows at once keep NR * MR independent sums in flight.
template <int MR, int NR>
inline void int4_rows(const uint8_t* nib, const uint16_t* sz, int64_t groups, const Int4Act& a,
                      int64_t m0, float* y) {
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i idx_01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i idx_23 = _mm512_add_epi32(idx_01, _mm512_set1_epi32(4));
  const __m512i idx_z = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);
  const __m512i idx_s = _mm512_sub_epi32(idx_z, _mm512_set1_epi32(1));
  const int64_t row_bytes = groups * (kInt4Group / 2), row_sz = 2 * groups;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < a.chunks; ++c) {
    const int64_t rem = std::min<int64_t>(4, groups - 4 * c);
    const __mmask64 wmask = rem == 4 ? ~0ULL : (1ULL << (16 * rem)) - 1;
    const __mmask8 smask = static_cast<__mmask8>(rem == 4 ? 0xFF : (1u << (2 * rem)) - 1);
    for (int j = 0; j < NR; ++j) {
      const __m512i w = _mm512_maskz_loadu_epi8(wmask, nib + j * row_bytes + 64 * c);
      const __m512i lo = _mm512_and_si512(w, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      const __m512i lo01 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo));
      const __m512i lo23 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1));
      const __m512i hi01 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi));
      const __m512i hi23 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1));
      const __m128i szb = _mm_maskz_loadu_epi16(smask, sz + j * row_sz + 8 * c);
      const __m512 f = _mm512_castsi512_ps(
          _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_cvtepu16_epi32(szb), 16)));
      const __m512 s01 = _mm512_permutexvar_ps(idx_01, f);
      const __m512 s23 = _mm512_permutexvar_ps(idx_23, f);
      const __m512 z = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), _mm512_permutexvar_ps(idx_s, f),
                                        _mm512_permutexvar_ps(idx_z, f));
      for (int i = 0; i < MR; ++i) {
        const int64_t at = (m0 + i) * a.chunks + c;
        const int16_t* q = a.q.data() + at * 128;
        __m512i d01 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo01, _mm512_loadu_si512(q));
        d01 = _mm512_dpwssd_epi32(d01, hi01, _mm512_loadu_si512(q + 64));
        __m512i d23 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo23,
                                          _mm512_loadu_si512(q + 32));
        d23 = _mm512_dpwssd_epi32(d23, hi23, _mm512_loadu_si512(q + 96));
        const float* d = a.d.data() + at * 32;
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d01),
                                    _mm512_mul_ps(s01, _mm512_loadu_ps(d)), acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d23),
                                    _mm512_mul_ps(s23, _mm512_loadu_ps(d + 16)), acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(z, _mm512_loadu_ps(a.quarter_sum.data() + at * 16),
                                    acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#else
using Int4Act = GroupRows;
inline const GroupRows& int4_act(const GroupRows& a) { return a; }

// One group's sum(code * q): AVX2's vpmaddwd on the codes widened to int16.
inline int32_t int4_group_dot(const uint8_t* nib, const int16_t* q) {
#if defined(__AVX2__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib));
  const __m128i low4 = _mm_set1_epi8(15);
  const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(v, low4));
  const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low4));
  const __m256i quads = _mm256_add_epi32(
      _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
      _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16))));
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(quads),
                                  _mm256_extracti128_si256(quads, 1));
  const __m128i h2 = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
  return _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 1)));
#else
  int32_t total = 0;
  for (int j = 0; j < 16; ++j) total += (nib[j] & 15) * q[j] + (nib[j] >> 4) * q[16 + j];
  return total;
#endif
}

template <int MR, int NR>
inline void int4_rows(const uint8_t* nib, const uint16_t* sz, int64_t groups, const GroupRows& a,
                      int64_t m0, float* y) {
  for (int j = 0; j < NR; ++j) {
    const uint8_t* nib_j = nib + j * groups * (kInt4Group / 2);
    const uint16_t* sz_j = sz + j * 2 * groups;
    float acc[MR] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const float s = c10::BFloat16(sz_j[2 * g], c10::BFloat16::from_bits());
      const float z0 = c10::BFloat16(sz_j[2 * g + 1], c10::BFloat16::from_bits());
      const float z = z0 - 8.f * s;
      for (int i = 0; i < MR; ++i) {
        const int64_t at = (m0 + i) * groups + g;
        const int32_t dot = int4_group_dot(nib_j + g * (kInt4Group / 2),
                                           a.q.data() + at * kInt4Group);
        acc[i] += static_cast<float>(dot) * (s * a.d[at]) + z * a.sum[at];
      }
    }
    for (int i = 0; i < MR; ++i) y[i * NR + j] = acc[i];
  }
}
#endif

// The int8 product's activations: int16 per row (q = round(x / d), d = max|x| / 32767), so the
// activation rounding stays below a bfloat16 rounding of x (an LM head's logits are compared
// to the last digit by a greedy sampler).
struct Int16Act {
  int64_t k = 0;
  std::vector<int16_t> q;
  std::vector<float> d;
};

template <typename T>
Int16Act quantize_rows16(const T* x, int64_t rows, int64_t k) {
  Int16Act a;
  a.k = k;
  a.q.resize(rows * k);
  a.d.resize(rows);
  for (int64_t m = 0; m < rows; ++m) {
    float amax = 0.f;
    for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(static_cast<float>(x[m * k + j])));
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int64_t j = 0; j < k; ++j)
      a.q[m * k + j] = static_cast<int16_t>(std::nearbyint(static_cast<float>(x[m * k + j]) * inv));
    a.d[m] = amax / 32767.f;
  }
  return a;
}

// Groups of 32 an int32 lane sums before it is moved to float32 (a group adds at most
// 4 * 32767 * 127 < 2^24 to a lane, AVX2's 8 lanes: 64 groups stay below 2^30).
constexpr int64_t kInt16Flush = 64;

// Weight rows r .. r + NR - 1 (w at row r) against activation rows m0 .. m0 + MR - 1:
// y[i * NR + j] = sum(w * q), before the rows' and the activations' scales.
template <int MR, int NR>
inline void int8_rows(const int8_t* w, const Int16Act& a, int64_t m0, float* y) {
  const int64_t k = a.k, groups = k / kInt4Group;
#if defined(PAGEDKV_INT_VNNI)
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += kInt16Flush) {
    const int64_t g_end = std::min(groups, g0 + kInt16Flush);
    __m512i part[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) part[i][j] = _mm512_setzero_si512();
    for (int64_t g = g0; g < g_end; ++g) {
      for (int j = 0; j < NR; ++j) {
        const __m512i wv = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * k + g * kInt4Group)));
        for (int i = 0; i < MR; ++i)
          part[i][j] = _mm512_dpwssd_epi32(
              part[i][j], wv, _mm512_loadu_si512(a.q.data() + (m0 + i) * k + g * kInt4Group));
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_cvtepi32_ps(part[i][j]));
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
#else
  for (int j = 0; j < NR; ++j) {
    for (int i = 0; i < MR; ++i) {
      const int16_t* q = a.q.data() + (m0 + i) * k;
      const int8_t* w_j = w + j * k;
      float total = 0.f;
      for (int64_t g0 = 0; g0 < groups; g0 += kInt16Flush) {
        const int64_t end = std::min(groups, g0 + kInt16Flush) * kInt4Group;
#if defined(__AVX2__)
        __m256i part = _mm256_setzero_si256();
        for (int64_t c = g0 * kInt4Group; c < end; c += 16)
          part = _mm256_add_epi32(part, _mm256_madd_epi16(
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w_j + c))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c))));
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), part);
        for (int l = 0; l < 8; ++l) total += static_cast<float>(lanes[l]);
#else
        int32_t part = 0;
        for (int64_t c = g0 * kInt4Group; c < end; ++c) part += w_j[c] * q[c];
        total += static_cast<float>(part);
#endif
      }
      y[i * NR + j] = total;
    }
  }
#endif
}

// kernel(mr, nr) with mr (1..kGemvRows) and nr (1 or kGemvCols) as compile-time constants.
template <typename Kernel>
inline void dispatch_rows(int mr, int nr, Kernel kernel) {
  auto with_nr = [&](auto m_c) {
    if (nr == kGemvCols) kernel(m_c, std::integral_constant<int, kGemvCols>{});
    else kernel(m_c, std::integral_constant<int, 1>{});
  };
  switch (mr) {
    case 1: with_nr(std::integral_constant<int, 1>{}); break;
    case 2: with_nr(std::integral_constant<int, 2>{}); break;
    case 3: with_nr(std::integral_constant<int, 3>{}); break;
    default: with_nr(std::integral_constant<int, 4>{}); break;
  }
}

GroupRows quantize_input(const at::Tensor& x, int64_t k) {
  switch (x.scalar_type()) {
    case at::kFloat: return quantize_groups(x.data_ptr<float>(), x.size(0), k);
    case at::kBFloat16: return quantize_groups(x.data_ptr<c10::BFloat16>(), x.size(0), k);
    case at::kHalf: return quantize_groups(x.data_ptr<c10::Half>(), x.size(0), k);
    default: TORCH_CHECK(false, "int gemv: x must be float32, bfloat16 or float16");
  }
}

// out[m0 + i][r + j] = y[i * nr + j] (+ bias[r + j]) in out's dtype.
template <typename T>
inline void store_out(T* out, int64_t n, int64_t r, int nr, int64_t m0, int mr, const float* y,
                      const float* bias) {
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j)
      out[(m0 + i) * n + r + j] = static_cast<T>(y[i * nr + j] + (bias ? bias[r + j] : 0.f));
}

template <typename RowY>
at::Tensor gemv_out(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias,
                    RowY row_y) {
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int_gemv", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    for_each_output(n, m, [&](int64_t r, int nr, int64_t m0, int mr, float* y) {
      row_y(r, nr, m0, mr, y);
      store_out(o, n, r, nr, m0, mr, y, bp);
    });
  });
  return out;
}

void check_gemv_input(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k, op,
              ": x must be a contiguous [M, ", k, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf, op, ": x must be float32, bfloat16 or float16");
  TORCH_CHECK(k % kInt4Group == 0, op, ": K must be a multiple of 32, got ", k);
}

// x [M, K] (float32, bfloat16 or float16); nibbles uint8 [N, K/2]; scale_zero bfloat16
// [N, K/32, 2]; bias [N] or None. Returns x W^T (+ bias) [M, N] in x's dtype.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scale_zero,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte && nibbles.is_contiguous(),
              "int4_gemv: nibbles must be a contiguous uint8 [N, K/2]");
  const int64_t n = nibbles.size(0), k = 2 * nibbles.size(1), groups = k / kInt4Group;
  check_gemv_input(x, k, "int4_gemv");
  TORCH_CHECK(scale_zero.scalar_type() == at::kBFloat16 && scale_zero.is_contiguous() &&
                  scale_zero.dim() == 3 && scale_zero.size(0) == n &&
                  scale_zero.size(1) == groups && scale_zero.size(2) == 2,
              "int4_gemv: scale_zero must be a contiguous bfloat16 [N, K/32, 2]");
  const GroupRows rows = quantize_input(x, k);
  const auto& act = int4_act(rows);
  const uint8_t* nib = nibbles.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<c10::BFloat16>());
  return gemv_out(x, n, bias, [&](int64_t r, int nr, int64_t m0, int mr, float* y) {
    dispatch_rows(mr, nr, [&](auto mr_c, auto nr_c) {
      int4_rows<decltype(mr_c)::value, decltype(nr_c)::value>(
          nib + r * (k / 2), sz + 2 * r * groups, groups, act, m0, y);
    });
  });
}

// x [M, K]; codes int8 [N, K] with one bfloat16 scale a row, scale [N]; bias [N] or None.
// Returns x W^T (+ bias) [M, N] in x's dtype, W = codes * scale.
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "int8_gemv: codes must be a contiguous int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1);
  check_gemv_input(x, k, "int8_gemv");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == n, "int8_gemv: scale must be [N]");
  const at::Tensor s = scale.to(at::kFloat).contiguous();
  const float* sp = s.data_ptr<float>();
  Int16Act act;
  switch (x.scalar_type()) {
    case at::kFloat: act = quantize_rows16(x.data_ptr<float>(), x.size(0), k); break;
    case at::kBFloat16: act = quantize_rows16(x.data_ptr<c10::BFloat16>(), x.size(0), k); break;
    default: act = quantize_rows16(x.data_ptr<c10::Half>(), x.size(0), k); break;
  }
  const int8_t* w = codes.data_ptr<int8_t>();
  return gemv_out(x, n, bias, [&](int64_t r, int nr, int64_t m0, int mr, float* y) {
    dispatch_rows(mr, nr, [&](auto mr_c, auto nr_c) {
      int8_rows<decltype(mr_c)::value, decltype(nr_c)::value>(w + r * k, act, m0, y);
    });
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) y[i * nr + j] *= sp[r + j] * act.d[m0 + i];
  });
}

// Which integer dot product int4_gemv / int8_gemv run in this build.
std::string int_gemv_isa() {
#if defined(PAGEDKV_INT_VNNI)
  return "avx512_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace
}  // namespace pagedkv_cpu

TORCH_LIBRARY_FRAGMENT(pagedkv_cpu, m) {
  m.def("int4_expand(Tensor nibbles, Tensor scale_zero, ScalarType dtype) -> Tensor",
        &pagedkv_cpu::int4_expand);
  m.def("int4_gemv(Tensor x, Tensor nibbles, Tensor scale_zero, Tensor? bias) -> Tensor",
        &pagedkv_cpu::int4_gemv);
  m.def("int8_gemv(Tensor x, Tensor codes, Tensor scale, Tensor? bias) -> Tensor",
        &pagedkv_cpu::int8_gemv);
  m.def("int_gemv_isa() -> str", &pagedkv_cpu::int_gemv_isa);
}
