// The storage formats of a KV cache block and how a kernel reads them.
//
// int8 (per-token-head float32 scales beside the block, pagedkv/model/kv_int8.py) and fp8
// (e4m3fn / e5m2; their per-layer or per-head scales are folded into q and the output by
// kv_quant.KVScales before the kernel) blocks are widened to float32 a vector (simd.h's QW
// lanes) at a time as they are read. fp8 goes through float16: e5m2 is the top byte of a
// float16; e4m3fn's 7 low bits shifted into a float16's exponent and mantissa are the value
// times 2^-8 (normal and subnormal alike), so both widen exactly with one vcvtph2ps (F16C, on
// every x86-64 CPU since 2013) and, for e4m3, one multiply.
#pragma once

#include "common.h"
#include "simd.h"

namespace pagedkv_cpu {
namespace {

// One fp8 value's float16 bits (e5m2: its top byte; e4m3fn: 2^-8 of the value, see above).
template <bool e4m3> inline uint16_t fp8_half(uint8_t x) {
  return e4m3 ? static_cast<uint16_t>(((x & 0x80) << 8) | ((x & 0x7F) << 7)) : static_cast<uint16_t>(x << 8);
}

// The storage formats of a KV cache block: `widen(src, dst, n)` writes n float32 values.
template <typename T> struct SameFmt {  // the activation dtype itself
  using storage = T;
  static constexpr bool quantized = false;
  static void widen(const T* s, float* d, int64_t n) { for (int64_t j = 0; j < n; j++) d[j] = to_f(s[j]); }
};
struct Int8Fmt {
  using storage = int8_t;
  static constexpr bool quantized = true;
  static void widen(const int8_t* __restrict s, float* __restrict d, int64_t n) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) d[j] = static_cast<float>(s[j]);  // vpmovsxbd + vcvtdq2ps
  }
};
// QW fp8 values at p as the float16 bits that widen them (e4m3: 2^-8 of the value): one
// widening load and one shift (e5m2), or a sign-extending load, a shift and an AND (e4m3fn:
// sign-extended, bit 14 copies the sign bit, cleared; the 7 low bits land on the float16's
// exponent and mantissa). __builtin_convertvector from uint8 lanes costs GCC 12 two half-width
// widenings and an insert.
template <bool e4m3> inline vqu16 fp8_halves(const uint8_t* p) {
#if PAGEDKV_QW == 16
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (e4m3)
    return (vqu16)_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(int16_t(0xBFFF)));
  else return (vqu16)_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (e4m3) return (vqu16)_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(int16_t(0xBFFF)));
  else return (vqu16)_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
#else
  vqu16 h;
  for (int i = 0; i < QW; i++) h[i] = fp8_half<e4m3>(p[i]);
  return h;
#endif
}

// fp8 blocks (e4m3 = true: e4m3fn, else e5m2) widened exactly through float16 (above).
template <bool e4m3> struct Fp8Fmt {
  using storage = uint8_t;
  static constexpr bool quantized = true;
  static constexpr float unit = e4m3 ? 256.f : 1.f;  // fp8_halves' values x unit: the stored ones
  static void widen(const uint8_t* s, float* d, int64_t n) {
    int64_t j = 0;
    for (; j + QW <= n; j += QW) {
      const vqf f = halves_to_float(fp8_halves<e4m3>(s + j)) * unit;
      std::memcpy(d + j, &f, sizeof(f));
    }
    for (; j < n; j++) d[j] = static_cast<float>(c10::Half(fp8_half<e4m3>(s[j]), c10::Half::from_bits())) * unit;
  }
};
using E5M2Fmt = Fp8Fmt<false>;
using E4M3Fmt = Fp8Fmt<true>;

template <typename Fmt> inline vqf fmt_vec(const typename Fmt::storage* p) {
  if constexpr (std::is_same_v<Fmt, Int8Fmt>) {
    // vpmovsxbd + vcvtdq2ps (GCC 12 scalarizes __builtin_convertvector from int8 lanes)
#if PAGEDKV_QW == 16
    return (vqf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
    return (vqf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    vqf f;
    for (int i = 0; i < QW; i++) f[i] = static_cast<float>(p[i]);
    return f;
#endif
  } else if constexpr (std::is_same_v<Fmt, E5M2Fmt> || std::is_same_v<Fmt, E4M3Fmt>) {
    return halves_to_float(fp8_halves<std::is_same_v<Fmt, E4M3Fmt>>(p));  // e4m3: x 2^-8, fmt_unit
  } else {
    return row_vec(p);
  }
}

// fmt_vec(p) x fmt_unit<Fmt> is the stored value (e4m3 widens to 2^-8 of it: the 2^8 goes once
// into q and once onto the output instead of onto every element; exact, a power of two).
template <typename Fmt> constexpr float fmt_unit = std::is_same_v<Fmt, E4M3Fmt> ? E4M3Fmt::unit : 1.f;

// int8 caches' scales: contiguous float32 [KVH, NB, BS] beside the cache (when given).
inline void check_scales(const c10::optional<at::Tensor>& scales, const at::Tensor& cache,
                         const char* name, const char* op = "paged_decode_attention") {
  if (!scales.has_value()) return;
  TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
              scales->dim() == 3 && scales->size(0) == cache.size(0) &&
              scales->size(1) == cache.size(1) && scales->size(2) == cache.size(2),
              op, ": ", name, " must be contiguous float32 [KVH, NB, BS]");
}

}  // namespace
}  // namespace pagedkv_cpu
