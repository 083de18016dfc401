// Packed 4- and 5-bit group-32 weights (pagedkv/model/quant/int4_blocks.py: GGUF Q4_0, Q4_1,
// Q4_K, Q5_1, Q5_K) as two tensors: the codes, uint8 [N, K/2] (byte j of a group holds code j
// in its low nibble and code j + 16 in its high one, the files' own order), with 5-bit codes a
// row's nibbles followed by its high bits (K/8 bytes: group g's code j has bit j of the row's
// uint32 g, Q5_1's own qh; uint8 [N, K/2 + K/8], Int4Shape), and per row the groups' scales then
// their offsets, [N, 2 * K/32] in float16 (Q4_0, Q4_1, Q5_1: the file's own values, exact) or
// float32 (their products, for the K-quants), or Q4_K's and Q5_K's two levels as the file has
// them (uint8 [N, 2.5 * K/32]: TwoLevel below): weight = code * scale + offset. A 5-bit code
// (0..31) is as much an unsigned operand of the integer dot products as a 4-bit one: each path
// adds 16 where its high bit is set once the nibbles are unpacked (AMX tiles excepted: 5-bit
// weights run the VNNI panel product there).
// - `int4_gemv`, what the packed linear runs at decode sizes: as llama.cpp's Q4_1 x Q8_1 dot,
//   each activation row is quantized once per call to int8 per group of 32 (step = max|x| /
//   127, round to nearest even; step * sum(q) kept beside for the offsets), then per weight
//   row: sum over groups of scale * step * sum(code * q) + offset * step * sum(q): the weight's
//   exact product with the quantized activations, up to float32 rounding. The integer
//   sums with AVX-512 VNNI (vpdpbusd: the codes as the unsigned operand, 4 groups a register),
//   or AVX2 (vpmaddubsw + vpmaddwd, 2 groups a register), float32 across groups. Each weight
//   row's codes and scales are read once, front to back, for up to 4 activation rows.
//   From 4 activation rows, AVX-512 VNNI runs the panel product instead (q4_panel_columns: 16
//   weight rows' codes unpacked and laid out per call so that a group's whole dot sums in an
//   int32 lane), and from 10, where the build and CPU have AMX-INT8, the same product runs on
//   tiles (quant_int4_amx.h). The activations are quantized straight from x's dtype into this
//   thread's scratch, and the output written in x's dtype (quant_rows.h): a small call costs
//   little beyond reading its weights.
// - `int4_linear`, the packed linear's forward in one op: int4_gemv up to a row count the
//   caller gives (Int4Linear.product_rows: int4_tile_rows() where the panel product or AMX
//   tiles run), else the dense matmul on int4_expand's weight.
// - `int4_expand`, what the packed linear runs beyond that row count (a prefill's hundreds of
//   rows with AVX2 alone, or past 64 on AMX): the dense weight, for oneDNN's matmul.
// - `int8_gemv`: int8 codes with one scale per weight row (the LM head's copy, model/quant/
//   packed_head.py) against activations quantized to int16 per row (vpdpwssd, or AVX2's
//   vpmaddwd): the head's logits see less than a bfloat16 rounding of the activations.
// Output rows are split over threads in blocks of 16, and each block's weights are read once
// for every 4 activation rows (the later reads hit the L1/L2 cache; the panel product reads
// them once per call).
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

#include "quant_rows.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDKV_INT_VNNI 1
#endif

namespace pagedkv_cpu {
namespace {

constexpr int64_t kInt4Group = 32;

// A packed weight's shape (check_int4_weight): groups of 32 a row and the codes' bits, 4 (a row
// of K/2 bytes of nibbles) or 5 (the nibbles, then K/8 bytes of high bits).
struct Int4Shape {
  int64_t groups = 0;
  int bits = 4;
  int64_t k() const { return groups * kInt4Group; }
  int64_t row_bytes() const { return code_row_bytes(bits, groups); }
  static int64_t code_row_bytes(int bits, int64_t groups) { return groups * (bits == 5 ? 20 : 16); }
};

// Group g's high bits (bit j: code j's) of a 5-bit weight row at `row` of `groups` groups.
inline uint32_t high_bits(const uint8_t* row, int64_t groups, int64_t g) {
  uint32_t bits;
  std::memcpy(&bits, row + 16 * groups + 4 * g, sizeof(bits));
  return bits;
}

// Scale or offset i of a row as float32 (S: float or c10::Half).
template <typename S>
inline float scale_f(const S* s, int64_t i) {
  if constexpr (std::is_same_v<S, c10::Half>) {
#if defined(__F16C__)
    uint16_t bits;
    std::memcpy(&bits, s + i, sizeof(bits));
    return _cvtsh_ss(bits);
#else
    return static_cast<float>(s[i]);
#endif
  } else {
    return s[i];
  }
}

// Q4_K's scales kept as the file has them (its two levels), a uint8 row of `two_level_bytes`:
// the groups' 6-bit sub-scales [G], their 6-bit mins [G], then per 8 groups (a super-block of
// 256) d and -dmin as float16 [G / 8] each; scale = d * sub-scale, offset = -dmin * min, each
// product exact in float32 (the float32 table's very values). 0.078 bytes a weight against
// the float32 table's 0.25 (the codes take 0.5; the file 0.5625 in all). The products
// materialize a tile's rows into float32 scratch before they read them (`two_level_rows`);
// the VNNI decode product reads the table itself.
inline int64_t two_level_bytes(int64_t groups) { return 2 * groups + groups / 2; }

//
// Q4_0's scales alone (`scale_only`): a float16 row of G scales, each group's offset -8 times
// its scale (implied by the format, not stored): 0.0625 bytes a weight where a table with the
// offsets takes 0.125 (Q4_0 in memory 0.5625, the file's). Read and materialized as the two
// levels are.
struct TwoLevel {
  const uint8_t* table = nullptr;  // nullptr: the scales are a float16 / float32 table
  int64_t groups = 0;
  bool scale_only = false;  // Q4_0's float16 scales alone
  int64_t row_bytes() const { return scale_only ? 2 * groups : two_level_bytes(groups); }
};

// Rows [r0, r0 + nr)'s scales then offsets, float32 [nr][2 * groups], into buf (defined with
// the vector helpers below). Writes buf.
inline const float* two_level_rows(const TwoLevel& two, int64_t r0, int64_t nr, float* buf);

// What the VNNI decode product (q4_rows) takes as its scale type to read a TwoLevel table
// itself, a group's scale a multiply (the pointer is the table's row, as bytes); ScaleOnlyRow
// likewise for Q4_0's scales alone.
struct TwoLevelRow {};
struct ScaleOnlyRow {};

// A weight row's scales in bytes, read as S: a TwoLevel row, Q4_0's G float16 scales, or a
// table of 2 * G values of S.
template <typename S>
inline int64_t scale_row_bytes(int64_t groups) {
  if constexpr (std::is_same_v<S, TwoLevelRow>) return two_level_bytes(groups);
  else if constexpr (std::is_same_v<S, ScaleOnlyRow>) return 2 * groups;
  else return 2 * groups * int64_t(sizeof(S));
}

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

// Row n of the weight: out[g*32 + j] = code * scale + offset for the group's codes.
#if defined(__AVX512BF16__)
// bfloat16 rows with AVX512-BF16: 16 codes a register, one fused multiply-add, vcvtneps2bf16
// (round to nearest even, as the scalar path).
template <typename S>
inline void int4_expand_row_bf16(const uint8_t* nib, const S* sc, int64_t groups, bool five,
                                 c10::BFloat16* out) {
  const __m512i low4 = _mm512_set1_epi32(15), sixteen = _mm512_set1_epi32(16);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(scale_f(sc, g));
    const __m512 z = _mm512_set1_ps(scale_f(sc, groups + g));
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + g * (kInt4Group / 2))));
    __m512i lo_codes = _mm512_and_si512(v, low4), hi_codes = _mm512_srli_epi32(v, 4);
    if (five) {
      const uint32_t bits = high_bits(nib, groups, g);
      lo_codes = _mm512_mask_add_epi32(lo_codes, static_cast<__mmask16>(bits), lo_codes, sixteen);
      hi_codes = _mm512_mask_add_epi32(hi_codes, static_cast<__mmask16>(bits >> 16), hi_codes,
                                       sixteen);
    }
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_codes), s, z);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_codes), s, z);
    __m256i* o = reinterpret_cast<__m256i*>(out + g * kInt4Group);
    _mm256_storeu_si256(o, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
    _mm256_storeu_si256(o + 1, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
  }
}
#endif

template <typename T, typename S>
void int4_expand_row(const uint8_t* nib, const S* sc, int64_t groups, bool five, T* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = scale_f(sc, g), offset = scale_f(sc, groups + g);
    const uint8_t* b = nib + g * (kInt4Group / 2);
    const uint32_t bits = five ? high_bits(nib, groups, g) : 0;
    float lo[16], hi[16];
    for (int j = 0; j < 16; ++j) {
      const int lo_code = (b[j] & 15) | ((bits >> j) & 1) << 4;
      const int hi_code = (b[j] >> 4) | ((bits >> (16 + j)) & 1) << 4;
      lo[j] = static_cast<float>(lo_code) * scale + offset;
      hi[j] = static_cast<float>(hi_code) * scale + offset;
    }
    store_group(lo, hi, out + g * kInt4Group);
  }
}

template <typename T, typename S>
void int4_expand_as(const at::Tensor& codes, const at::Tensor& scales, const TwoLevel& two,
                    const Int4Shape& shape, at::Tensor& out) {
  const int64_t n = codes.size(0), groups = shape.groups, k = shape.k();
  const int64_t row_bytes = shape.row_bytes();
  const bool five = shape.bits == 5;
  const uint8_t* nib = codes.data_ptr<uint8_t>();
  const S* table = reinterpret_cast<const S*>(scales.data_ptr());
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float* buf = two.table ? quant_rows::scratch<float, 14>(2 * groups) : nullptr;
    for (int64_t r = begin; r < end; ++r) {
      const S* sc = two.table ? reinterpret_cast<const S*>(two_level_rows(two, r, 1, buf))
                              : table + 2 * groups * r;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        int4_expand_row_bf16(nib + r * row_bytes, sc, groups, five, dst + r * k);
        continue;
      }
#endif
      int4_expand_row<T>(nib + r * row_bytes, sc, groups, five, dst + r * k);
    }
  });
}

// The shape of a packed weight whose tensors have been checked to be 2-D: its groups from the
// scales' width (2.5 bytes a group in two levels, one float16 where Q4_0's scales stand alone,
// else a scale and an offset), its bits from the codes' (20 bytes a group: 5).
Int4Shape int4_shape(const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t width = scales.size(1);
  int64_t groups = width / 2;
  if (scales.scalar_type() == at::kByte) groups = width * 2 / 5;
  else if (scales.scalar_type() == at::kHalf && 16 * width == codes.size(1)) groups = width;
  return Int4Shape{groups, codes.size(1) == Int4Shape::code_row_bytes(5, groups) ? 5 : 4};
}

Int4Shape check_int4_weight(const at::Tensor& codes, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), op,
              ": codes must be a contiguous uint8 [N, K/2] (4-bit) or [N, K/2 + K/8] (5-bit)");
  const int64_t n = codes.size(0);
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == n, op,
              ": scales must be a contiguous [N, ...] table");
  const Int4Shape shape = int4_shape(codes, scales);
  const int64_t groups = shape.groups;
  if (scales.scalar_type() == at::kByte)
    TORCH_CHECK(groups % 8 == 0 && scales.size(1) == two_level_bytes(groups), op,
                ": two-level uint8 scales need K a multiple of 256 and [N, 2.5 * K/32]");
  TORCH_CHECK(groups > 0 && codes.size(1) == shape.row_bytes(), op, ": codes of ",
              codes.size(1), " bytes a row fit no K of these scales (K/2 bytes a row for 4-bit ",
              "codes, K/2 + K/8 for 5-bit, K a multiple of 32)");
  if (scales.scalar_type() == at::kByte) return shape;
  if (scales.scalar_type() == at::kHalf && scales.size(1) == groups) return shape;  // Q4_0's
  TORCH_CHECK((scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) &&
                  scales.size(1) == 2 * groups,
              op, ": scales must be a contiguous float16 or float32 [N, 2 * K/32] or the "
              "K-quants' two levels (uint8)");
  return shape;
}

// The two-level source of `scales` (table nullptr for a float16 / float32 table).
TwoLevel two_level_of(const at::Tensor& scales, int64_t groups) {
  if (scales.scalar_type() == at::kHalf && scales.size(1) == groups)
    return TwoLevel{reinterpret_cast<const uint8_t*>(scales.data_ptr()), groups, true};
  if (scales.scalar_type() != at::kByte) return TwoLevel{};
  return TwoLevel{scales.data_ptr<uint8_t>(), groups};
}

// codes: uint8 [N, K/2] or [N, K/2 + K/8] (Int4Shape); scales: float16 or float32 [N, 2 * K/32]
// (a row's scales, then its offsets), or TwoLevel's; returns W [N, K] in `dtype` (float32, bfloat16 or float16), each value rounded once.
at::Tensor int4_expand(const at::Tensor& codes, const at::Tensor& scales, at::ScalarType dtype) {
  const Int4Shape shape = check_int4_weight(codes, scales, "int4_expand");
  at::Tensor out = at::empty({codes.size(0), shape.k()}, codes.options().dtype(dtype));
  const TwoLevel two = two_level_of(scales, shape.groups);
  const bool half = scales.scalar_type() == at::kHalf && !two.table;  // (else materialized)
  auto run = [&](auto t) {
    using T = decltype(t);
    if (half) int4_expand_as<T, c10::Half>(codes, scales, two, shape, out);
    else int4_expand_as<T, float>(codes, scales, two, shape, out);
  };
  switch (dtype) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "int4_expand: dtype must be float32, bfloat16 or float16");
  }
  return out;
}


// ---- decode-sized products on the packed codes ----

constexpr int64_t kGemvBlock = 16;  // weight rows a task takes at a time
constexpr int kGemvRows = 4;        // activation rows one pass over a weight block computes
constexpr int kGemvCols = 4;        // weight rows one call computes together (independent sums)

// Runs row_fn(r, nr, m0, mr, y) for every run of nr (kGemvCols, or 1 at the end) weight rows
// from r and of mr (up to kGemvRows) activation rows from m0 (y[i * nr + j]: activation row
// m0 + i, weight row r + j), weight rows split over threads in blocks of kGemvBlock (on the
// calling thread below quant_rows::kInlineBytes of `row_bytes` weight rows per activation pass).
template <typename RowFn>
void for_each_output(int64_t n, int64_t m, int64_t row_bytes, RowFn row_fn) {
  const int64_t blocks = (n + kGemvBlock - 1) / kGemvBlock;
  const int64_t passes = (m + kGemvRows - 1) / kGemvRows;
  quant_rows::run_blocks(blocks, n * row_bytes * passes, [&](int64_t b, int64_t e) {
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

// Activation rows quantized per group of 32 to int8 (q = round(x / step), step = max|x| / 127),
// laid per chunk of 4 groups (what 64 code bytes hold) as the products read them: values 0-15
// of groups 0..3 (what the low nibbles pair with), then values 16-31 of the same (the high
// nibbles); per group the step and the sum of its quantized values (step times the codes'
// integer sum: the offset term then meets the same activations as the codes do, so a call
// computes the weight's exact product with the quantized rows, as llama.cpp's Q8_1 sums do;
// with x's own float sum instead the codes' rounding errors meet the uncentered codes 0..15
// alone, about 2-3x the error on SmolLM2's Q4_0 linears and 20x its mean KL). Groups past the
// last are zeros.
struct Q8Act {
  int64_t chunks = 0, groups = 0;
  const int8_t* q = nullptr;                    // [M, chunks, 128]
  const float* d = nullptr;                     // [M, padded()]
  const float* sum = nullptr;                   // [M, padded()]
  // d's and sum's row length: the groups rounded up to 16 (the products read 8 or 16 at a time).
  int64_t padded() const { return (groups + 15) / 16 * 16; }
};

// One group of 32 values from src: codes to lo[0..15] (values 0-15) and hi[0..15] (16-31);
// returns the step, the quantized values' sum (step times the codes' sum) to *total.
template <typename T>
inline float quantize_group(const T* src, int8_t* lo, int8_t* hi, float* total) {
#if defined(PAGEDKV_QUANT_ROWS_512)
  const __m512 v0 = quant_rows::load16(src), v1 = quant_rows::load16(src + 16);
  const float amax = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m128i q0 = quant_rows::quantize16(v0, inv), q1 = quant_rows::quantize16(v1, inv);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), q0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), q1);
  const int32_t codes_sum = _mm512_reduce_add_epi32(
      _mm512_add_epi32(_mm512_cvtepi8_epi32(q0), _mm512_cvtepi8_epi32(q1)));
#else
  float v[kInt4Group], amax = 0.f;
  for (int j = 0; j < kInt4Group; ++j) {
    v[j] = static_cast<float>(src[j]);
    amax = std::max(amax, std::fabs(v[j]));
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t codes_sum = 0;
  for (int j = 0; j < 16; ++j) {
    lo[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
    hi[j] = static_cast<int8_t>(std::nearbyint(v[16 + j] * inv));
    codes_sum += lo[j] + hi[j];
  }
#endif
  const float step = amax / 127.f;
  *total = static_cast<float>(codes_sum) * step;
  return step;
}

// x's rows quantized into this thread's scratch (valid until its next call).
template <typename T>
Q8Act quantize_q8(const T* x, int64_t rows, int64_t k) {
  Q8Act a;
  a.groups = k / kInt4Group;
  a.chunks = (a.groups + 3) / 4;
  int8_t* q = quant_rows::scratch<int8_t, 1>(rows * a.chunks * 128);
  float* d = quant_rows::scratch<float, 1>(rows * a.padded());
  float* sum = quant_rows::scratch<float, 2>(rows * a.padded());
  for (int64_t m = 0; m < rows; ++m) {
    float* dm = d + m * a.padded();
    float* sm = sum + m * a.padded();
    for (int64_t g = 0; g < a.groups; ++g) {
      int8_t* qg = q + (m * a.chunks + g / 4) * 128 + (g % 4) * 16;
      dm[g] = quantize_group(x + m * k + g * kInt4Group, qg, qg + 64, sm + g);
    }
    for (int64_t g = a.groups; g < a.chunks * 4; ++g) {  // the last chunk's past the groups
      int8_t* qg = q + (m * a.chunks + g / 4) * 128 + (g % 4) * 16;
      std::memset(qg, 0, 16);
      std::memset(qg + 64, 0, 16);
    }
    for (int64_t g = a.groups; g < a.padded(); ++g) dm[g] = sm[g] = 0.f;  // past the last: zeros
  }
  a.q = q;
  a.d = d;
  a.sum = sum;
  return a;
}

// How far ahead of the rows being computed the products prefetch the codes (and scales): a
// decode step streams every weight once, from memory or a shared L3, and one core's
// outstanding misses bound its read bandwidth; about 1.4x on SmolLM2's linears at one row.
// Where far_l2_prefetch holds (AMD's cores) the VNNI product asks for them into L2,
// quant_rows::kFarPrefetchBytes ahead, as the int8 products do: a SmolLM2 Q4_0 decode step at
// one row, one thread, took 6.1 ms of CPU time against 6.7 with the L1 prefetches (Zen 4).
constexpr int64_t kPrefetchBytes = 4096;

// How far ahead of the rows being computed a decode product prefetches, in weight rows of
// `row_bytes` codes: `near` rows (kPrefetchBytes, at least one) into L1, `far` rows
// (quant_rows::kFarPrefetchBytes in whole runs of kGemvCols rows) into L2 where
// far_l2_prefetch holds. Worked out once an op, not once a run of kGemvCols rows (three
// divisions a run, where a run of SmolLM2's K = 576 has 18 chunks of work).
struct RowsAhead {
  int64_t near, far;
  explicit RowsAhead(int64_t row_bytes)
      : near(std::max<int64_t>(1, kPrefetchBytes / row_bytes)),
        far(quant_rows::whole_tiles_ahead(quant_rows::kFarPrefetchBytes, row_bytes, kGemvCols) /
            row_bytes) {}
};

#if defined(PAGEDKV_INT_VNNI)
// 4 (16) of a row's scales or offsets as float32, lanes past `mask` zero.
template <typename S>
inline __m128 scales4(const S* s, __mmask8 mask) {
  if constexpr (std::is_same_v<S, c10::Half>) return _mm_cvtph_ps(_mm_maskz_loadu_epi16(mask, s));
  else return _mm_maskz_loadu_ps(mask, s);
}

template <typename S>
inline __m512 scales16(const S* s, __mmask16 mask) {
  if constexpr (std::is_same_v<S, c10::Half>)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s));
  else return _mm512_maskz_loadu_ps(mask, s);
}

// A TwoLevel row `t` (groups G): groups 4c .. 4c + 3's scales (one super-block's: G is a
// multiple of 8), and groups g0 .. g0 + 15's offsets (lanes past `mask` zero).
inline __m128 two_level_scales4(const uint8_t* t, int64_t groups, int64_t c) {
  int32_t sub;
  std::memcpy(&sub, t + 4 * c, sizeof(sub));
  uint16_t d;
  std::memcpy(&d, t + 2 * groups + 2 * (c / 2), sizeof(d));
  return _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(sub))),
                    _mm_set1_ps(_cvtsh_ss(d)));
}

inline __m512 two_level_offsets16(const uint8_t* t, int64_t groups, int64_t g0, __mmask16 mask) {
  const __m512 mins = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
      _mm_maskz_loadu_epi8(mask, t + groups + g0)));
  const __mmask8 halves = static_cast<__mmask8>(mask == 0xFFFF ? 3 : 1);
  const __m512 neg_dmin = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_maskz_loadu_epi16(
      halves, t + 2 * groups + groups / 4 + 2 * (g0 / 8))));
  const __m512i half_of = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_mul_ps(mins, _mm512_permutexvar_ps(half_of, neg_dmin));
}

// As two_level_offsets16, the scales: groups g0 .. g0 + 15's (lanes past `mask` zero).
inline __m512 two_level_scales16(const uint8_t* t, int64_t groups, int64_t g0, __mmask16 mask) {
  const __m512 subs = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, t + g0)));
  const __mmask8 halves = static_cast<__mmask8>(mask == 0xFFFF ? 3 : 1);
  const __m512 d = _mm512_castps128_ps512(
      _mm_cvtph_ps(_mm_maskz_loadu_epi16(halves, t + 2 * groups + 2 * (g0 / 8))));
  const __m512i half_of = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_mul_ps(subs, _mm512_permutexvar_ps(half_of, d));
}
#endif

// 16 groups a vector where AVX-512 VNNI is compiled (the same products).
inline const float* two_level_rows(const TwoLevel& two, int64_t r0, int64_t nr, float* buf) {
  const int64_t groups = two.groups, bytes = two.row_bytes();
  for (int64_t r = 0; r < nr; ++r) {
    const uint8_t* t = two.table + (r0 + r) * bytes;
    float* o = buf + r * 2 * groups;
    if (two.scale_only) {  // offset = -8 x scale
      const c10::Half* d = reinterpret_cast<const c10::Half*>(t);
#if defined(PAGEDKV_INT_VNNI)
      for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        const __mmask16 mask = static_cast<__mmask16>(
            groups - g0 >= 16 ? 0xFFFF : (1u << (groups - g0)) - 1);
        const __m512 sc = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + g0));
        _mm512_mask_storeu_ps(o + g0, mask, sc);
        _mm512_mask_storeu_ps(o + groups + g0, mask, _mm512_mul_ps(sc, _mm512_set1_ps(-8.f)));
      }
#else
      for (int64_t g = 0; g < groups; ++g) {
        o[g] = scale_f(d, g);
        o[groups + g] = -8.f * o[g];
      }
#endif
      continue;
    }
#if defined(PAGEDKV_INT_VNNI)
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const __mmask16 mask = groups - g0 >= 16 ? 0xFFFF : 0x00FF;  // groups: a multiple of 8
      _mm512_mask_storeu_ps(o + g0, mask, two_level_scales16(t, groups, g0, mask));
      _mm512_mask_storeu_ps(o + groups + g0, mask, two_level_offsets16(t, groups, g0, mask));
    }
#else
    for (int64_t g = 0; g < groups; ++g) {
      uint16_t bits[2];
      std::memcpy(&bits[0], t + 2 * groups + 2 * (g / 8), 2);
      std::memcpy(&bits[1], t + 2 * groups + groups / 4 + 2 * (g / 8), 2);
      o[g] = static_cast<float>(c10::Half(bits[0], c10::Half::from_bits())) * t[g];
      o[groups + g] = static_cast<float>(c10::Half(bits[1], c10::Half::from_bits())) *
                      t[groups + g];
    }
#endif
  }
  return buf;
}
#if defined(PAGEDKV_INT_VNNI)

// Four rows' accumulators summed across their lanes, row j's sum in lane j (two rounds of
// unpack-and-add within 128-bit lanes, then the four 128-bit lanes added).
inline __m128 sum_rows4(const __m512* r) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(r[2], r[3]), _mm512_unpackhi_ps(r[2], r[3]));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 h = _mm256_add_ps(
      _mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Four chunks' dots (chunk c: groups 4c .. 4c + 3, one a 128-bit lane, 4 int32 partial sums
// each) summed to one int32 a group by two rounds of unpack-and-add: lane 4k + c holds group
// 4c + k (q4_rows' block_order reads 16 groups' scales and steps in that order).
inline __m512i sum_groups16(const __m512i* d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]),
                                      _mm512_unpackhi_epi32(d[0], d[1]));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]),
                                      _mm512_unpackhi_epi32(d[2], d[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// A weight row's 16 groups' scales from g0 (all within the row) in the layout S names.
template <typename S>
inline __m512 block_scales16(const char* row_scales, int64_t groups, int64_t g0) {
  if constexpr (std::is_same_v<S, TwoLevelRow>)
    return two_level_scales16(reinterpret_cast<const uint8_t*>(row_scales), groups, g0, 0xFFFF);
  else if constexpr (std::is_same_v<S, ScaleOnlyRow>)
    return scales16(reinterpret_cast<const c10::Half*>(row_scales) + g0, 0xFFFF);
  else
    return scales16(reinterpret_cast<const S*>(row_scales) + g0, 0xFFFF);
}

// Weight rows r .. r + NR - 1 (codes, scales at row r) against activation rows m0 .. m0 + MR - 1:
// y[i * NR + j]. Per chunk of 4 groups and pair of rows: two vpdpbusd (low nibbles, high
// nibbles; the codes 0..15, or 0..31 with their high bits added, as the unsigned bytes) leave
// 16 int32 lanes, 4 per group. A whole block of 4 chunks (16 groups) sums its chunks' lanes to
// one int32 a group (sum_groups16) and scales them by the groups' weight scales times their
// activation steps with one multiply-add; a last part block scales each chunk's lanes by
// themselves. (Scaling every chunk's lanes, a convert, a permute and a multiply-add a chunk and
// row, left the product compute-bound at about 3 ns a chunk and row on a Zen 4, in cache; a
// 1B-shaped layer's linears at one row, two threads, weights from memory, are 3-20% faster
// against bfloat16's in the same run now, 5-bit codes the most.)
template <int MR, int NR, typename S, bool Far, int Bits>
inline void q4_rows(const uint8_t* codes, const S* scales, int64_t groups, const Q8Act& a,
                    int64_t m0, float* y, const uint8_t* codes_end, const RowsAhead& rows_ahead) {
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i lane_group = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  // A chunk's 4 groups' high bits: codes 0-15 of each (the low nibbles') in the low 8 bytes,
  // codes 16-31 in the high 8, as the nibbles' bytes lie.
  const __m128i split_halves =
      _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  constexpr bool kTwo = std::is_same_v<S, TwoLevelRow>;
  constexpr bool kOnly = std::is_same_v<S, ScaleOnlyRow>;  // Q4_0's scales alone
  const int64_t row_bytes = Int4Shape::code_row_bytes(Bits, groups), padded = a.padded();
  const int64_t high_at = 16 * groups;  // a 5-bit row's high bits
  const char* scale_bytes = reinterpret_cast<const char*>(scales);
  const int64_t scale_row_bytes = pagedkv_cpu::scale_row_bytes<S>(groups);
  const int64_t ahead = rows_ahead.near * row_bytes, ahead_s = rows_ahead.near * scale_row_bytes;
  const int64_t far = rows_ahead.far * row_bytes;
  const char* far_scales = scale_bytes + rows_ahead.far * scale_row_bytes;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  // Row j's chunk c: its prefetches issued, its codes' low and high nibbles (4-bit values, or
  // 5-bit with their high bits added), bytes past the row's `rem` groups zero.
  const auto chunk_codes = [&](int j, int64_t c, int64_t rem, __m512i* lo, __m512i* hi) {
    const __mmask64 wmask = rem == 4 ? ~0ULL : (1ULL << (16 * rem)) - 1;
    const __mmask8 smask = static_cast<__mmask8>((1u << rem) - 1);
    if constexpr (Far) {
      if (codes + j * row_bytes + 64 * c + far < codes_end)  // (never past the weight)
        prefetch_l2(codes + j * row_bytes + 64 * c + far);
      // The scales of the row that far ahead, whole (10 lines of Q4_K's at K = 8,192: one
      // alone left the rest to demand misses, 1.2x slower per byte than at K = 2,048).
      if (c * 64 < scale_row_bytes) prefetch_l2(far_scales + j * scale_row_bytes + c * 64);
      const uint8_t* high = codes + j * row_bytes + high_at + 16 * c + far;
      if (Bits == 5 && c % 4 == 0 && high < codes_end) prefetch_l2(high);
    } else {
      __builtin_prefetch(codes + j * row_bytes + ahead + 64 * c);
      if (c == 0) __builtin_prefetch(scale_bytes + j * scale_row_bytes + ahead_s);
      if (Bits == 5 && c % 4 == 0)
        __builtin_prefetch(codes + j * row_bytes + high_at + 16 * c + ahead);
    }
    const __m512i w = _mm512_maskz_loadu_epi8(wmask, codes + j * row_bytes + 64 * c);
    *lo = _mm512_and_si512(w, low4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
    if constexpr (Bits == 5) {
      const __m128i halves = _mm_shuffle_epi8(
          _mm_maskz_loadu_epi32(smask, codes + j * row_bytes + high_at + 16 * c), split_halves);
      const __m512i sixteen = _mm512_set1_epi8(16);
      *lo = _mm512_mask_add_epi8(*lo, static_cast<__mmask64>(_mm_cvtsi128_si64(halves)), *lo,
                                 sixteen);
      *hi = _mm512_mask_add_epi8(*hi, static_cast<__mmask64>(_mm_extract_epi64(halves, 1)),
                                 *hi, sixteen);
    }
  };
  const __m512i block_order =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);  // sum_groups16's
  int64_t c = 0;
  for (; 4 * c + 16 <= groups; c += 4) {  // whole blocks of 16 groups
    __m512 step[MR];
    for (int i = 0; i < MR; ++i)
      step[i] = _mm512_permutexvar_ps(block_order,
                                      _mm512_loadu_ps(a.d + (m0 + i) * padded + 4 * c));
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      __m512i lo[4], hi[4];
      for (int k = 0; k < 4; ++k) chunk_codes(j, c + k, 4, &lo[k], &hi[k]);
      const __m512 ws = _mm512_permutexvar_ps(
          block_order, block_scales16<S>(scale_bytes + j * scale_row_bytes, groups, 4 * c));
      for (int i = 0; i < MR; ++i) {
        const int8_t* q = a.q + ((m0 + i) * a.chunks + c) * 128;
        __m512i dot[4];
        for (int k = 0; k < 4; ++k)
          dot[k] = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[k], _mm512_loadu_si512(q + 128 * k)),
              hi[k], _mm512_loadu_si512(q + 128 * k + 64));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_groups16(dot)),
                                    _mm512_mul_ps(ws, step[i]), acc[i][j]);
      }
    }
  }
  for (; c < a.chunks; ++c) {  // the last part block, a chunk at a time
    const int64_t rem = std::min<int64_t>(4, groups - 4 * c);
    const __mmask8 smask = static_cast<__mmask8>((1u << rem) - 1);
    __m128 step[MR];
    for (int i = 0; i < MR; ++i) step[i] = _mm_loadu_ps(a.d + (m0 + i) * padded + 4 * c);
    for (int j = 0; j < NR; ++j) {
      const char* row_scales = scale_bytes + j * scale_row_bytes;
      __m512i lo, hi;
      chunk_codes(j, c, rem, &lo, &hi);
      __m128 ws;
      if constexpr (kTwo)
        ws = two_level_scales4(reinterpret_cast<const uint8_t*>(row_scales), groups, c);
      else if constexpr (kOnly)
        ws = scales4(reinterpret_cast<const c10::Half*>(row_scales) + 4 * c, smask);
      else
        ws = scales4(reinterpret_cast<const S*>(row_scales) + 4 * c, smask);
      for (int i = 0; i < MR; ++i) {
        const int8_t* q = a.q + ((m0 + i) * a.chunks + c) * 128;
        const __m512i dot = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q)), hi,
            _mm512_loadu_si512(q + 64));
        const __m512 s = _mm512_permutexvar_ps(
            lane_group, _mm512_castps128_ps512(_mm_mul_ps(ws, step[i])));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[i][j]);
      }
    }
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {  // the offsets times the groups' sums
    const __mmask16 mask = groups - g0 >= 16 ? 0xFFFF
                                             : static_cast<__mmask16>((1u << (groups - g0)) - 1);
    for (int j = 0; j < NR; ++j) {
      const char* row_scales = scale_bytes + j * scale_row_bytes;
      __m512 off;
      if constexpr (kTwo)
        off = two_level_offsets16(reinterpret_cast<const uint8_t*>(row_scales), groups, g0,
                                  mask);
      else if constexpr (kOnly)
        off = _mm512_mul_ps(_mm512_set1_ps(-8.f),
                            scales16(reinterpret_cast<const c10::Half*>(row_scales) + g0, mask));
      else
        off = scales16(reinterpret_cast<const S*>(row_scales) + groups + g0, mask);
      for (int i = 0; i < MR; ++i)
        acc[i][j] = _mm512_fmadd_ps(
            off, _mm512_maskz_loadu_ps(mask, a.sum + (m0 + i) * padded + g0), acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if constexpr (NR == 4) {
      _mm_storeu_ps(y + i * NR, sum_rows4(acc[i]));
    } else {
      for (int j = 0; j < NR; ++j) y[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
    }
  }
}
#elif defined(__AVX2__)
inline float q4_hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// Up to 8 floats (n of them; the rest zero) from p as a vector.
inline __m256 load_floats8(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float buf[8] = {};
  std::memcpy(buf, p, n * sizeof(float));
  return _mm256_load_ps(buf);
}

// Up to 8 float16 values (n of them; the rest zero) from p as float32.
inline __m256 load_halves8(const c10::Half* p, int64_t n) {
#if defined(__F16C__)
  if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  alignas(16) uint16_t buf[8] = {};
  std::memcpy(buf, p, std::min<int64_t>(n, 8) * sizeof(uint16_t));
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
#else
  alignas(32) float out[8];
  for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(c10::Half(buf[i], c10::Half::from_bits()));
  return _mm256_load_ps(out);
#endif
}

// Groups g0 .. g0 + 7's scales and offsets (groups past `groups` zero) of a weight row whose
// scales start at `row` (bytes) in the layout S names: a float32 or float16 table (the G
// scales, then the G offsets), a TwoLevel row read in place (8 groups: one super-block), or
// Q4_0's float16 scales alone (offset -8 x scale).
template <typename S>
inline void scales8(const char* row, int64_t groups, int64_t g0, __m256* scale, __m256* offset) {
  const int64_t n = groups - g0;
  if constexpr (std::is_same_v<S, TwoLevelRow>) {
    const uint8_t* t = reinterpret_cast<const uint8_t*>(row);
    uint16_t bits[2];
    std::memcpy(&bits[0], t + 2 * groups + 2 * (g0 / 8), 2);
    std::memcpy(&bits[1], t + 2 * groups + groups / 4 + 2 * (g0 / 8), 2);
    const auto byte8 = [](const uint8_t* p) {
      int64_t v;
      std::memcpy(&v, p, sizeof(v));
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v)));
    };
    const auto half = [](uint16_t h) {
      return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
    };
    *scale = _mm256_mul_ps(byte8(t + g0), _mm256_set1_ps(half(bits[0])));
    *offset = _mm256_mul_ps(byte8(t + groups + g0), _mm256_set1_ps(half(bits[1])));
  } else if constexpr (std::is_same_v<S, ScaleOnlyRow>) {
    *scale = load_halves8(reinterpret_cast<const c10::Half*>(row) + g0, n);
    *offset = _mm256_mul_ps(*scale, _mm256_set1_ps(-8.f));
  } else if constexpr (std::is_same_v<S, c10::Half>) {
    const c10::Half* p = reinterpret_cast<const c10::Half*>(row);
    *scale = load_halves8(p + g0, n);
    *offset = load_halves8(p + groups + g0, n);
  } else {
    const float* p = reinterpret_cast<const float*>(row);
    *scale = load_floats8(p + g0, n);
    *offset = load_floats8(p + groups + g0, n);
  }
}

// A block's 8 groups' int32 dots from its 4 pairs' vpmaddwd results (pair p: group 2p's 4
// partial sums in lanes 0-3, 2p + 1's in 4-7), summed by three vphaddd: groups 0, 2, 4, 6 in
// the low half, 1, 3, 5, 7 in the high one.
inline __m256i hadd_groups8(const __m256i* pairs) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(pairs[0], pairs[1]),
                           _mm256_hadd_epi32(pairs[2], pairs[3]));
}

// A 5-bit pair of groups' fifth bits as the bytes they add to the nibbles (16 where set):
// `bits` holds group g's uint32 then g + 1's (code j's bit j); *lo gets codes 0-15 of g then of
// g + 1 (what the low nibbles' bytes hold), *hi codes 16-31 of each.
inline void fifth_bit_bytes(int64_t bits, __m256i* lo, __m256i* hi) {
  const __m256i both = _mm256_set1_epi64x(bits);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i sixteen = _mm256_set1_epi8(16);
  const auto spread = [&](__m256i from) {
    return _mm256_and_si256(
        _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(both, from), bit), bit), sixteen);
  };
  *lo = spread(_mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5));
  *hi = spread(_mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
                                6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7));
}

// As the VNNI kernel, 2 groups a register: vpmaddubsw (codes 0..15, or 0..31, unsigned times
// the int8 activations: pair sums within 2 * 31 * 127), low and high nibbles' sums added in
// int16 (within 4 * 31 * 127), then vpmaddwd by ones: 8 int32 lanes, 4 per group. Per block of
// 8 groups and weight row, the 4 pairs' lanes are summed to one int32 a group (hadd_groups8),
// converted once and scaled by the groups' scales times their activation steps (both read 8
// at a time in the sums' order), and the offsets meet the groups' activation sums: one
// multiply-add per block into the row's accumulator, which stays in a register. (Scaling each
// pair's lanes as they came, by a permute of the 8 scales and a multiply-add, chained every
// pair through the accumulator: about 9 cycles a pair on a Zen 4, the AVX2 product's bound.)
template <int MR, int NR, typename S, bool Far, int Bits>
inline void q4_rows(const uint8_t* codes, const S* scales, int64_t groups, const Q8Act& a,
                    int64_t m0, float* y, const uint8_t* codes_end, const RowsAhead& rows_ahead) {
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i hadd_order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // hadd_groups8's
  const int64_t row_bytes = Int4Shape::code_row_bytes(Bits, groups), padded = a.padded();
  const char* scale_bytes = reinterpret_cast<const char*>(scales);
  const int64_t scale_row_bytes = pagedkv_cpu::scale_row_bytes<S>(groups);
  // As the VNNI product: where far_l2_prefetch holds (AMD's cores) into L2, far ahead and
  // never past the weight's last code (a small linear's overshoot cost SmolLM2's decode 8%),
  // else into L1, kPrefetchBytes ahead. (A 1B-shaped layer's 4- and 5-bit linears at one row,
  // two threads, weights from memory: 1.3-1.5x faster with the far prefetch on a Zen 4.)
  const int64_t ahead =  // (in whole runs of kGemvCols rows)
      (rows_ahead.near + kGemvCols - 1) / kGemvCols * kGemvCols * row_bytes;
  const int64_t ahead_s = rows_ahead.near * scale_row_bytes;
  const int64_t far = rows_ahead.far * row_bytes, far_s = rows_ahead.far * scale_row_bytes;
  const auto prefetch = [](const void* p) { __builtin_prefetch(p); };
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int64_t n8 = std::min<int64_t>(8, groups - g0);
    __m256 step[MR], sums[MR];  // the 8 groups' activation steps (in hadd order) and sums
    for (int i = 0; i < MR; ++i) {  // (Q8Act pads both to a multiple of 16 groups with zeros)
      step[i] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(a.d + (m0 + i) * padded + g0),
                                         hadd_order);
      sums[i] = _mm256_loadu_ps(a.sum + (m0 + i) * padded + g0);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const char* row_scales = scale_bytes + j * scale_row_bytes;
      const uint8_t* row = codes + j * row_bytes;
      if constexpr (Far) {
        // The far row's scales, a line a block (8 bytes a group: a float32 table's two)
        if (g0 * 8 < scale_row_bytes) prefetch_l2(row_scales + far_s + g0 * 8);
      } else if (g0 == 0) {
        prefetch(row_scales + ahead_s);
      }
      __m256 ws, wo;
      scales8<S>(row_scales, groups, g0, &ws, &wo);
      __m256i dots[MR][4];
      // A pair of groups from g (one where `pair` is false: g is the last group).
      const auto pair_dots = [&](int p, bool pair) {
        const int64_t g = g0 + 2 * p;
        const uint8_t* wp = row + (kInt4Group / 2) * g;
        if constexpr (Far) {
          if (p % 2 == 0 && wp + far < codes_end) prefetch_l2(wp + far);
          const uint8_t* high = row + 16 * groups + 4 * g + far;
          if (Bits == 5 && g % 16 == 0 && high < codes_end) prefetch_l2(high);
        } else {
          if (p % 2 == 0) prefetch(wp + ahead);
          if (Bits == 5 && g % 16 == 0) prefetch(row + 16 * groups + 4 * g + ahead);
        }
        const __m256i w = pair
            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp))
            : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
        __m256i lo = _mm256_and_si256(w, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        if constexpr (Bits == 5) {  // group g's codes 0-15 then g + 1's, likewise 16-31
          int64_t bits = high_bits(row, groups, g);  // g's uint32, then g + 1's
          if (pair) std::memcpy(&bits, row + 16 * groups + 4 * g, sizeof(bits));
          __m256i add_lo, add_hi;
          fifth_bit_bytes(bits, &add_lo, &add_hi);
          lo = _mm256_or_si256(lo, add_lo);
          hi = _mm256_or_si256(hi, add_hi);
        }
        const int64_t at = (g / 4) * 128 + 32 * ((g % 4) / 2);
        for (int i = 0; i < MR; ++i) {
          const int8_t* q = a.q + (m0 + i) * a.chunks * 128 + at;
          const __m256i sum16 = _mm256_add_epi16(
              _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
              _mm256_maddubs_epi16(
                  hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64))));
          dots[i][p] = _mm256_madd_epi16(sum16, ones);
        }
      };
      if (n8 == 8) {  // a whole block (every one where the groups are a multiple of 8)
        for (int p = 0; p < 4; ++p) pair_dots(p, true);
      } else {
        for (int p = 0; p < 4; ++p) {
          if (2 * p < n8) {
            pair_dots(p, 2 * p + 1 < n8);
          } else {  // past the last group
            for (int i = 0; i < MR; ++i) dots[i][p] = _mm256_setzero_si256();
          }
        }
      }
      ws = _mm256_permutevar8x32_ps(ws, hadd_order);
      for (int i = 0; i < MR; ++i)
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hadd_groups8(dots[i])),
                                    _mm256_mul_ps(ws, step[i]),
                                    _mm256_fmadd_ps(wo, sums[i], acc[i][j]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * NR + j] = q4_hsum8(acc[i][j]);
}
#else
template <int MR, int NR, typename S, bool Far, int Bits>
inline void q4_rows(const uint8_t* codes, const S* scales, int64_t groups, const Q8Act& a,
                    int64_t m0, float* y, const uint8_t* codes_end, const RowsAhead& rows_ahead) {
  (void)codes_end, (void)rows_ahead;  // (no prefetch)
  const int64_t row_bytes = Int4Shape::code_row_bytes(Bits, groups), row_s = 2 * groups;
  const int64_t padded = a.padded();
  for (int j = 0; j < NR; ++j) {
    for (int i = 0; i < MR; ++i) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = codes + j * row_bytes + g * (kInt4Group / 2);
        const uint32_t bits = Bits == 5 ? high_bits(codes + j * row_bytes, groups, g) : 0;
        const int8_t* q = a.q + ((m0 + i) * a.chunks + g / 4) * 128 + (g % 4) * 16;
        int32_t dot = 0;
        for (int t = 0; t < 16; ++t)
          dot += ((b[t] & 15) | ((bits >> t) & 1) << 4) * q[t] +
                 ((b[t] >> 4) | ((bits >> (16 + t)) & 1) << 4) * q[64 + t];
        const int64_t at = (m0 + i) * padded + g;
        acc += scale_f(scales + j * row_s, g) * a.d[at] * static_cast<float>(dot) +
               scale_f(scales + j * row_s, groups + g) * a.sum[at];
      }
      y[i * NR + j] = acc;
    }
  }
}
#endif

#if defined(PAGEDKV_INT_VNNI) && defined(__F16C__)
#define PAGEDKV_INT4_PANEL 1
// The product from a few activation rows on (kInt4PanelMinRows), a panel of 16 weight rows
// (output columns) at a time, as quant_int8.cpp's panel product: the panel's codes are laid out
// once per call, 4 codes (a dword) of 8 weight rows a 256-bit half (an 8 x 8 dword transpose of
// the packed codes, then unpacked from their nibbles to bytes 0..15: vpdpbusd's unsigned
// operand as they are), the two halves one 512-bit vector of the 16 rows, its groups' scales
// and offsets as float32 16 weight rows a vector; then each activation row's 4 codes at a
// time, broadcast, meet the 16 weight rows' in one vpdpbusd, a whole group's dot summed in each
// int32 lane before one convert and one multiply-add by the two scales, and one multiply-add of
// the offsets by the group's activation sum, 8 activation rows at a time (8 independent sums:
// the instruction's latency hidden). Per activation row and 16 weight rows a group costs 8
// vpdpbusd and 4 float operations, where q4_rows spends 2 vpdpbusd per 4 groups of one weight
// row beside a permute and 3 float operations (its lanes run along K), and re-reads and
// re-unpacks the codes for every 4 activation rows; the layout's cost is shared by all the rows.
// Below 4 rows q4_rows (the batch-1 decode's product) stays.
// Over SmolLM2-135M's shapes, one thread, weights from memory (AMD Zen 4;
// benchmarks/bench_quant_linear.py --cold): 1.2x q4_rows' speed at 4 rows, 1.6x at 8, 2.0x at
// 16, 2.2x at 32, 2.3x at 64, and faster than the dense bfloat16 linear at each. 512-bit
// vectors and 8-row tiles against 256-bit ones and 4-row tiles (Zen 4 runs a 512-bit vpdpbusd
// as two halves; Zen 5 whole): on AMD Zen 5 over the 1B-shaped layer's linears, one thread,
// 1.35x at 16 rows and 1.46x at 256 (bench_quant_linear.py --shapes llama1b --paths q40).
constexpr int64_t kInt4PanelMinRows = 4;
constexpr int kQ4PanelCols = 16;    // weight rows a panel: one 512-bit vector of int32 lanes
constexpr int kQ4PanelRowTile = 8;  // activation rows computed together
// Groups along K laid out at a time: 8 (256 codes; 4 KiB of codes laid out for 16 weight rows,
// in L1 at any K).
constexpr int64_t kQ4PanelGroups = 8;
// How far ahead of the panel being laid out its codes (and scales) are asked for into L2
// (rounded to whole panels, at least the next), as quant_int8.cpp's panel product (16 KiB
// measured within the noise of 8 over SmolLM2's shapes at 4-64 rows, AMD Zen 4).
constexpr int64_t kQ4PanelPrefetchBytes = 8 << 10;

// Up to 8 of a row's scales or offsets from p (mask: which) as float32, the rest zero.
template <typename S>
inline __m256 q4_panel_scales(const S* p, __mmask8 mask) {
  if constexpr (std::is_same_v<S, c10::Half>)
    return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask, p));
  else return _mm256_maskz_loadu_ps(mask, p);
}

// Lays out groups [g0, g0 + ng) (ng <= kQ4PanelGroups) of the weight rows at `codes` (nc <= 16
// of them, `groups` groups each; scales and offsets from `scales`, 2 * groups a row) into pw
// ([ng][8 dwords][2]: dword d of the group's codes in their order, values 4d .. 4d + 3, of
// rows 0-7 and of rows 8-15, as bytes 0..15), ps and po ([ng][16]: the rows' scales, offsets),
// rows past nc as zero codes, scales and offsets. `next`: the codes of a panel further on
// (nullptr past the weight's end; next_rows of its rows), whose same groups are asked for into
// L2 meanwhile. 5-bit codes (Bits): their high bits added once unpacked, 16 where set, as
// bytes 0..31. Writes pw, ps and po.
template <bool Full, int Bits, typename S>
void lay_out_q4_panel(const uint8_t* codes, const S* scales, int64_t nc, int64_t groups,
                      int64_t g0, int64_t ng, __m256i* pw, float* ps, float* po,
                      const uint8_t* next, int64_t next_rows) {
  if constexpr (Full) nc = kQ4PanelCols;  // (a constant: no test per row)
  const int64_t row_bytes = Int4Shape::code_row_bytes(Bits, groups), row_s = 2 * groups;
  if (next != nullptr)
    for (int64_t j = 0; j < next_rows; ++j) {
      for (int64_t b = 0; b < ng * (kInt4Group / 2); b += 64)
        prefetch_l2(next + j * row_bytes + g0 * (kInt4Group / 2) + b);
      if constexpr (Bits == 5) prefetch_l2(next + j * row_bytes + 16 * groups + 4 * g0);
    }
  const __m512i low4 = _mm512_set1_epi8(15);
  // A row's 32 code bytes of groups p, p + 1 (16 of group p alone at the end), zeros past nc.
  auto row_codes = [&](int64_t row, int64_t p, bool pair) {
    if (row >= nc) return _mm256_setzero_si256();
    const uint8_t* src = codes + row * row_bytes + (g0 + p) * (kInt4Group / 2);
    return pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  };
  for (int64_t p = 0; p < ng; p += 2) {  // two groups (32 code bytes) of each row at a time
    const bool pair = p + 1 < ng;
    // Rows i and 8 + i's packed dwords: 0-3 group p's, 4-7 group p + 1's (each 4 codes in the
    // low nibbles, the 4 codes 16 on in the high ones); transposed first, unpacked after.
    __m512i r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(row_codes(i, p, pair)),
                                row_codes(8 + i, p, pair), 1);
    quant_rows::transpose8x8x2(r);
    for (int q = 0; q < 8; ++q) {
      if (q >= 4 && !pair) break;
      const int64_t at = (p + q / 4) * 8 + q % 4;  // group p + q / 4, its dword q % 4
      _mm512_storeu_si512(pw + at * 2, _mm512_and_si512(r[q], low4));
      _mm512_storeu_si512(pw + (at + 4) * 2, _mm512_and_si512(_mm512_srli_epi16(r[q], 4), low4));
    }
  }
  if constexpr (Bits == 5) {
    // Each row's high bits of a group as bytes (16 where set) in code order, dword d = codes
    // 4d .. 4d + 3 (the laid-out dword d's), transposed as the codes were and added.
    // Rows i and 8 + i a vector (their 32 bits a mask each), as the codes.
    auto row_bits = [&](int64_t row, int64_t g) -> uint64_t {
      return row < nc ? high_bits(codes + row * row_bytes, groups, g) : 0;
    };
    for (int64_t p = 0; p < ng; ++p) {
      __m512i e[8];
      for (int i = 0; i < 8; ++i)
        e[i] = _mm512_maskz_mov_epi8(row_bits(i, g0 + p) | row_bits(8 + i, g0 + p) << 32,
                                     _mm512_set1_epi8(16));
      quant_rows::transpose8x8x2(e);
      for (int d = 0; d < 8; ++d) {
        __m256i* at = pw + (p * 8 + d) * 2;
        _mm512_storeu_si512(at, _mm512_or_si512(_mm512_loadu_si512(at), e[d]));
      }
    }
  }
  // Each row's 8 scales (offsets) of the chunk, rows i and 8 + i a vector, transposed as the
  // codes were: group q's 16 rows' values in one vector.
  const __mmask8 mask = static_cast<__mmask8>((1u << ng) - 1);
  auto row_values = [&](int64_t row, int64_t from) {
    if (row >= nc) return _mm256_setzero_si256();
    return _mm256_castps_si256(q4_panel_scales(scales + row * row_s + from + g0, mask));
  };
  __m512i sv[8], ov[8];
  for (int i = 0; i < 8; ++i) {
    sv[i] = _mm512_inserti64x4(_mm512_castsi256_si512(row_values(i, 0)), row_values(8 + i, 0), 1);
    ov[i] = _mm512_inserti64x4(_mm512_castsi256_si512(row_values(i, groups)),
                               row_values(8 + i, groups), 1);
  }
  quant_rows::transpose8x8x2(sv);
  quant_rows::transpose8x8x2(ov);
  for (int q = 0; q < ng; ++q) {
    _mm512_storeu_si512(ps + q * kQ4PanelCols, sv[q]);
    _mm512_storeu_si512(po + q * kQ4PanelCols, ov[q]);
  }
}

// A call's quantized activation rows in the order the panel tiles read them: for each tile of
// kQ4PanelRowTile rows and each group, the rows' 32 codes one after another (then their steps
// and sums likewise), so a tile reads one run of memory from one pointer. Rows past the
// call's last are zeros.
struct Q4TileAct {
  const int8_t* q = nullptr;    // [tiles][groups][kQ4PanelRowTile][32]
  const float* d = nullptr;     // [tiles][groups][kQ4PanelRowTile]
  const float* sum = nullptr;   // [tiles][groups][kQ4PanelRowTile]
  int64_t groups = 0;
};

// Rows [row0, row0 + m) of `a` as Q4TileAct, into this thread's scratch (valid until its next
// call; read by the panel threads meanwhile).
inline Q4TileAct tile_activations(const Q8Act& a, int64_t row0, int64_t m) {
  constexpr int64_t T = kQ4PanelRowTile;
  const int64_t groups = a.groups, tiles = (m + T - 1) / T, padded = a.padded();
  int8_t* q = quant_rows::scratch<int8_t, 7>(tiles * groups * T * 32);
  float* d = quant_rows::scratch<float, 17>(2 * tiles * groups * T);
  float* sum = d + tiles * groups * T;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = 0; r < T; ++r) {
        const int64_t row = row0 + t * T + r, at = (t * groups + g) * T + r;
        if (t * T + r >= m) {
          std::memset(q + at * 32, 0, 32);
          d[at] = sum[at] = 0.f;
          continue;
        }
        const int8_t* src = a.q + (row * a.chunks + g / 4) * 128 + (g % 4) * 16;
        std::memcpy(q + at * 32, src, 16);
        std::memcpy(q + at * 32 + 16, src + 64, 16);
        d[at] = a.d[row * padded + g];
        sum[at] = a.sum[row * padded + g];
      }
  return {q, d, sum, groups};
}

// Tile `tile`'s first R activation rows, groups [g0, g0 + ng), against a laid-out panel (pw,
// ps, po): y [r * 16 + j] (plus its value unless `first`) += row r's product with the panel's
// weight row j. Writes y.
template <int R>
inline void q4_panel_tile(const __m256i* pw, const float* ps, const float* po,
                          const Q4TileAct& a, int64_t tile, int64_t g0, int64_t ng, float* y,
                          bool first) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r)
    acc[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * kQ4PanelCols);
  for (int64_t gl = 0; gl < ng; ++gl) {
    const int64_t at = (tile * a.groups + g0 + gl) * kQ4PanelRowTile;  // row 0's, group g0 + gl
    const int8_t* x = a.q + at * 32;  // row r's codes at x + 32 r, in order
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const __m256i* wg = pw + gl * 16;
#pragma GCC unroll 8
    for (int d = 0; d < 8; ++d) {
      const __m512i w = _mm512_loadu_si512(wg + 2 * d);
      for (int r = 0; r < R; ++r) {
        int32_t xd;
        std::memcpy(&xd, x + 32 * r + 4 * d, sizeof(xd));
        dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(xd));
      }
    }
    const __m512 s = _mm512_loadu_ps(ps + gl * kQ4PanelCols);
    const __m512 o = _mm512_loadu_ps(po + gl * kQ4PanelCols);
    for (int r = 0; r < R; ++r) {
      const __m512 step = _mm512_set1_ps(a.d[at + r]);
      const __m512 sum = _mm512_set1_ps(a.sum[at + r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(s, step), acc[r]);
      acc[r] = _mm512_fmadd_ps(o, sum, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * kQ4PanelCols, acc[r]);
}

// Rows [row0, row0 + m) of out [.., n] (T) = those rows of the quantized activations `a` times
// the weight (codes, scales; `a.groups` groups a row) + bias, a panel of 16 weight rows at a
// time (panels over threads, on the calling thread below quant_rows::kInlineBytes of weights),
// each kQ4PanelGroups groups along K laid out and met by all the m rows before the next (a
// larger call passes its rows a block at a time: quant_rows::for_row_blocks). Writes out.
template <int Bits, typename T, typename S>
void q4_panel_columns(const Q8Act& a, int64_t row0, int64_t m, const uint8_t* codes,
                      const S* scales, const TwoLevel& two, int64_t n, const float* bias,
                      T* out) {
  const int64_t groups = a.groups, row_bytes = Int4Shape::code_row_bytes(Bits, groups);
  const int64_t row_s = 2 * groups;
  const int64_t panels = (n + kQ4PanelCols - 1) / kQ4PanelCols;
  const int64_t passes = (m + kQ4PanelRowTile - 1) / kQ4PanelRowTile;
  // The panel whose codes are asked for while this one is laid out: about
  // kQ4PanelPrefetchBytes ahead.
  const int64_t ahead = std::max<int64_t>(1, kQ4PanelPrefetchBytes / (kQ4PanelCols * row_bytes));
  const Q4TileAct tiled = tile_activations(a, row0, m);
  quant_rows::run_blocks(panels, n * row_bytes * passes, [&](int64_t p_begin, int64_t p_end) {
    const int64_t chunk = std::min(groups, kQ4PanelGroups);
    __m256i* pw = reinterpret_cast<__m256i*>(
        quant_rows::scratch<int8_t, 6>(chunk * 16 * sizeof(__m256i)));
    float* ps = quant_rows::scratch<float, 12>(2 * chunk * kQ4PanelCols);
    float* po = ps + chunk * kQ4PanelCols;
    float* y = quant_rows::scratch<float, 13>(m * kQ4PanelCols);
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t col = p * kQ4PanelCols;
      const int64_t nc = std::min<int64_t>(kQ4PanelCols, n - col);
      const int64_t next_col = col + ahead * kQ4PanelCols;
      const uint8_t* next = next_col < n ? codes + next_col * row_bytes : nullptr;
      const int64_t next_rows = std::min<int64_t>(kQ4PanelCols, n - next_col);
      if (next != nullptr) {  // the next panel's scales and offsets
        const int64_t bytes = two.table ? two.row_bytes() : row_s * int64_t(sizeof(S));
        const char* ns = two.table
            ? reinterpret_cast<const char*>(two.table + next_col * bytes)
            : reinterpret_cast<const char*>(scales + next_col * row_s);
        for (int64_t b = 0; b < next_rows * bytes; b += 64) prefetch_l2(ns + b);
      }
      const S* panel_scales = two.table
          ? reinterpret_cast<const S*>(two_level_rows(
                two, col, nc, quant_rows::scratch<float, 15>(kQ4PanelCols * row_s)))
          : scales + col * row_s;
      for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int64_t ng = std::min(chunk, groups - g0);
        const uint8_t* wp = codes + col * row_bytes;
        if (nc == kQ4PanelCols) {
          lay_out_q4_panel<true, Bits>(wp, panel_scales, nc, groups, g0, ng, pw, ps, po, next,
                                       next_rows);
        } else {
          lay_out_q4_panel<false, Bits>(wp, panel_scales, nc, groups, g0, ng, pw, ps, po, next,
                                        next_rows);
        }
        quant_rows::for_row_tiles<kQ4PanelRowTile>(m, [&](int64_t r, auto tile) {
          q4_panel_tile<decltype(tile)::value>(pw, ps, po, tiled, r / kQ4PanelRowTile, g0, ng,
                                               y + r * kQ4PanelCols, g0 == 0);
        });
      }
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < nc; ++j)
          out[(row0 + r) * n + col + j] =
              static_cast<T>(y[r * kQ4PanelCols + j] + (bias ? bias[col + j] : 0.f));
    }
  });
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

// out[m0 + i][r + j] = y[i * nr + j] (+ bias[r + j]) in out's dtype.
template <typename T>
inline void store_out(T* out, int64_t n, int64_t r, int nr, int64_t m0, int mr, const float* y,
                      const float* bias) {
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j)
      out[(m0 + i) * n + r + j] = static_cast<T>(y[i * nr + j] + (bias ? bias[r + j] : 0.f));
}

// row_y's products into a new [..., N] output of x's dtype (x [..., K], contiguous), plus the
// bias, each weight row's codes `row_bytes` long.
template <typename RowY>
at::Tensor gemv_out(const at::Tensor& x, int64_t n, int64_t row_bytes,
                    const c10::optional<at::Tensor>& bias, RowY row_y) {
  const int64_t m = x.numel() / x.size(-1);
  at::Tensor out = at::empty(quant_rows::out_sizes(x, n), x.options());
  const float* bp = quant_rows::float_bias(bias, n);
  dispatch(x.scalar_type(), "int_gemv", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = out.data_ptr<T>();
    for_each_output(n, m, row_bytes, [&](int64_t r, int nr, int64_t m0, int mr, float* y) {
      row_y(r, nr, m0, mr, y);
      store_out(o, n, r, nr, m0, mr, y, bp);
    });
  });
  return out;
}

void check_gemv_input(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && x.size(-1) == k, op,
              ": x must be a contiguous [..., ", k, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf, op, ": x must be float32, bfloat16 or float16");
  TORCH_CHECK(k % kInt4Group == 0, op, ": K must be a multiple of 32, got ", k);
}

}  // namespace
}  // namespace pagedkv_cpu

#include "quant_int4_amx.h"

namespace pagedkv_cpu {
namespace {

// int4_gemv on AMX tiles (quant_int4_amx.h) where this build and CPU have them, the rows are
// enough and N is a multiple of 16: its output, else an undefined tensor.
at::Tensor int4_gemv_tiles(const at::Tensor& x, const Q8Act& act, const at::Tensor& codes,
                           const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
#if defined(PAGEDKV_INT4_AMX)
  const int64_t n = codes.size(0), m = x.numel() / x.size(-1);
  if (m < kAmxMinRows || n % 16 || !amx_permitted()) return at::Tensor();
  at::Tensor out = at::empty(quant_rows::out_sizes(x, n), x.options());
  const float* bp = quant_rows::float_bias(bias, n);
  const Int4AmxAct tiles = amx_activations(act, m);
  const uint8_t* nib = codes.data_ptr<uint8_t>();
  const TwoLevel two = two_level_of(scales, act.groups);
  dispatch(x.scalar_type(), "int4_gemv", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (scales.scalar_type() == at::kHalf && !two.table)
      int4_amx_product(tiles, m, nib, reinterpret_cast<const c10::Half*>(scales.data_ptr()), two,
                       n, act.groups, bp, out.data_ptr<T>());
    else
      int4_amx_product(tiles, m, nib, reinterpret_cast<const float*>(scales.data_ptr()), two, n,
                       act.groups, bp, out.data_ptr<T>());
  });
  return out;
#else
  return at::Tensor();
#endif
}

template <int Bits>
at::Tensor int4_gemv_bits(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias, const Int4Shape& shape) {
  const int64_t n = codes.size(0), k = shape.k(), groups = shape.groups;
  check_gemv_input(x, k, "int4_gemv");
  const TwoLevel two = two_level_of(scales, groups);
  Q8Act act;
  dispatch(x.scalar_type(), "int4_gemv", [&](auto tag) {
    act = quantize_q8(x.data_ptr<typename decltype(tag)::type>(), x.numel() / k, k);
  });
  if constexpr (Bits == 4) {  // (5-bit codes: the VNNI panel product; the tiles take nibbles)
    if (at::Tensor tiled = int4_gemv_tiles(x, act, codes, scales, bias); tiled.defined())
      return tiled;
  }
  const uint8_t* nib = codes.data_ptr<uint8_t>();
#if defined(PAGEDKV_INT4_PANEL)
  if (x.numel() / k >= kInt4PanelMinRows) {
    at::Tensor out = at::empty(quant_rows::out_sizes(x, n), x.options());
    const float* bp = quant_rows::float_bias(bias, n);
    const int64_t m = x.numel() / k;
    dispatch(x.scalar_type(), "int4_gemv", [&](auto tag) {
      using T = typename decltype(tag)::type;
      quant_rows::for_row_blocks(m, k, [&](int64_t r0, int64_t rows) {
        if (scales.scalar_type() == at::kHalf && !two.table)
          q4_panel_columns<Bits>(act, r0, rows, nib,
                                 reinterpret_cast<const c10::Half*>(scales.data_ptr()), two, n,
                                 bp, out.data_ptr<T>());
        else
          q4_panel_columns<Bits>(act, r0, rows, nib,
                                 reinterpret_cast<const float*>(scales.data_ptr()), two, n, bp,
                                 out.data_ptr<T>());
      });
    });
    return out;
  }
#endif
  auto run = [&](auto scale_type, auto far) {
    using S = decltype(scale_type);
    const S* sc = reinterpret_cast<const S*>(scales.data_ptr());
    const RowsAhead ahead(shape.row_bytes());
    return gemv_out(x, n, shape.row_bytes(), bias,
                    [&](int64_t r, int nr, int64_t m0, int mr, float* y) {
      const S* rows_sc;
      if constexpr (std::is_same_v<S, TwoLevelRow> || std::is_same_v<S, ScaleOnlyRow>)
        rows_sc = reinterpret_cast<const S*>(two.table + r * two.row_bytes());  // in place
      else  // a float16 / float32 table, or the two levels materialized (AVX2, scalar)
        rows_sc = two.table ? reinterpret_cast<const S*>(two_level_rows(
                                  two, r, nr, quant_rows::scratch<float, 15>(nr * 2 * groups)))
                            : sc + 2 * groups * r;
      dispatch_rows(mr, nr, [&](auto mr_c, auto nr_c) {
        q4_rows<decltype(mr_c)::value, decltype(nr_c)::value, S, decltype(far)::value, Bits>(
            nib + r * shape.row_bytes(), rows_sc, groups, act, m0, y, nib + n * shape.row_bytes(),
            ahead);
      });
    });
  };
  auto with_far = [&](auto scale_type) {
    if (far_l2_prefetch()) return run(scale_type, std::true_type{});
    return run(scale_type, std::false_type{});
  };
#if defined(PAGEDKV_INT_VNNI) || defined(__AVX2__)
  if (two.table && two.scale_only) return with_far(ScaleOnlyRow{});  // read in place
  if (two.table) return with_far(TwoLevelRow{});  // the VNNI and AVX2 products read them
#endif
  return scales.scalar_type() == at::kHalf && !two.table ? with_far(c10::Half{})
                                                         : with_far(float{});
}

// x [..., K] (float32, bfloat16 or float16, contiguous); codes uint8 [N, K/2] or
// [N, K/2 + K/8] (Int4Shape); scales float16 or float32 [N, 2 * K/32] or TwoLevel's; bias [N]
// or None. Returns x W^T (+ bias) [..., N] in x's dtype.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  const Int4Shape shape = check_int4_weight(codes, scales, "int4_gemv");
  if (shape.bits == 5) return int4_gemv_bits<5>(x, codes, scales, bias, shape);
  return int4_gemv_bits<4>(x, codes, scales, bias, shape);
}

// Rows up to which the packed linear runs int4_gemv where it runs on AMX tiles (64: beyond,
// the expanded weight on oneDNN's AMX matmul) or the panel product (every call: kEveryRow);
// 0 without either (Int4Linear's GEMV_ROWS then). The panel product took 0.5-0.7x the
// one-thread CPU time of the weight expanded to bfloat16 and oneDNN's matmul at 16-64 rows over
// SmolLM2-135M's shapes on AMD Zen 4, 0.8x at 512 and 2,048 rows (benchmarks/bench_quant_linear.py
// --paths int4gemv,int4expand); AVX2's product stays at GEMV_ROWS.
int64_t int4_tile_rows() {
#if defined(PAGEDKV_INT4_AMX)
  if (amx_permitted()) return kAmxMaxRows;
#endif
#if defined(PAGEDKV_INT4_PANEL)
  return quant_rows::kEveryRow;
#else
  return 0;
#endif
}

// The packed linear's forward: x [..., K] W^T (+ bias) [..., N] in x's dtype, by int4_gemv up to
// `gemv_rows` rows (Int4Linear's product_rows: int4_tile_rows() where tiles run), else on the
// weight expanded (int4_expand, a chunk of rows at a time) by the dense matmul.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t gemv_rows) {
  const at::Tensor xc = x.contiguous();
  const int64_t k = check_int4_weight(codes, scales, "int4_linear").k();
  if (xc.numel() <= gemv_rows * k)
    return int4_gemv(xc, codes, scales, bias);
  check_gemv_input(xc, k, "int4_linear");
  const at::Tensor rows = xc.view({-1, k});
  const at::Tensor y = quant_rows::expanded_linear(rows, codes.size(0), bias,
                                                   [&](int64_t start, int64_t stop) {
    return int4_expand(codes.slice(0, start, stop), scales.slice(0, start, stop),
                       xc.scalar_type());
  });
  return y.view(quant_rows::out_sizes(xc, codes.size(0)));
}

// int4_linear on x's columns taken in `order` (int64 [K]): a GPTQ act-order linear whose codes
// hold the input features sorted by group (model/quant/prequantized.py: PermutedInt4Linear),
// one op for the decode stack.
at::Tensor int4_linear_gathered(const at::Tensor& x, const at::Tensor& order,
                                const at::Tensor& codes, const at::Tensor& scales,
                                const c10::optional<at::Tensor>& bias, int64_t gemv_rows) {
  return int4_linear(x.index({at::indexing::Ellipsis, order}), codes, scales, bias, gemv_rows);
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
  dispatch(x.scalar_type(), "int8_gemv", [&](auto tag) {
    act = quantize_rows16(x.data_ptr<typename decltype(tag)::type>(), x.numel() / k, k);
  });
  const int8_t* w = codes.data_ptr<int8_t>();
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / k) * k;
  return gemv_out(x, n, k, bias, [&](int64_t r, int nr, int64_t m0, int mr, float* y) {
    if (m0 == 0)
      for (int64_t c = 0; c < nr * k; c += 64) __builtin_prefetch(w + r * k + ahead + c);
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
  m.def("int4_expand(Tensor codes, Tensor scales, ScalarType dtype) -> Tensor",
        &pagedkv_cpu::int4_expand);
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor",
        &pagedkv_cpu::int4_gemv);
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias, int gemv_rows) -> Tensor",
        &pagedkv_cpu::int4_linear);
  m.def("int4_linear_gathered(Tensor x, Tensor order, Tensor codes, Tensor scales, Tensor? bias, "
        "int gemv_rows) -> Tensor",
        &pagedkv_cpu::int4_linear_gathered);
  m.def("int8_gemv(Tensor x, Tensor codes, Tensor scale, Tensor? bias) -> Tensor",
        &pagedkv_cpu::int8_gemv);
  m.def("int_gemv_isa() -> str", &pagedkv_cpu::int_gemv_isa);
  m.def("int4_tile_rows() -> int", &pagedkv_cpu::int4_tile_rows);
}
