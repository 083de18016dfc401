// The vector helpers the kernels share: GCC/Clang vector extensions sized by the build's ISA,
// and the few intrinsics they do not reach. Everything here is inline (hot loops call it).
//
// QW lanes, 16 (one zmm) where AVX-512 is compiled in, 8 (one ymm) otherwise;
// PAGEDKV_CPU_ISA=avx2 (pagedkv/kernels/cpu.py: -mno-avx512f, as a Zen 3 build) gives the
// 8-lane build on an AVX-512 machine, so both are tested there.
#pragma once

#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define PAGEDKV_QW 16
#else
#define PAGEDKV_QW 8
#endif

namespace pagedkv_cpu {
namespace {

// exp(x) in float32 to about 2 ulp (Cephes' expf: 2^n * a degree-6 polynomial of the
// remainder), plain arithmetic so that loops of it vectorize (libm's expf does not).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

#if defined(__AVX512F__)
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
#endif

// Eight floats (GCC/Clang vector extension: AVX registers with -march=native, plain code elsewhere).
typedef float v8f __attribute__((vector_size(32)));
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof(v)); return v; }
inline float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

constexpr int QW = PAGEDKV_QW;
typedef float vqf __attribute__((vector_size(QW * 4)));
typedef int8_t vqi8 __attribute__((vector_size(QW)));
typedef uint8_t vqu8 __attribute__((vector_size(QW)));
typedef uint16_t vqu16 __attribute__((vector_size(QW * 2)));
typedef int16_t vqs16 __attribute__((vector_size(QW * 4)));  // 2 * QW int16 (one register)
typedef int32_t vqi32 __attribute__((vector_size(QW * 4)));
typedef int8_t vqi8x2 __attribute__((vector_size(QW * 2)));
typedef uint32_t vqu32 __attribute__((vector_size(QW * 4)));

inline vqf halves_to_float(vqu16 h) {
#if PAGEDKV_QW == 16
  return (vqf)_mm512_cvtph_ps((__m256i)h);
#elif defined(__F16C__)
  return (vqf)_mm256_cvtph_ps((__m128i)h);
#else
  vqf f;
  for (int i = 0; i < QW; i++) f[i] = static_cast<float>(c10::Half(h[i], c10::Half::from_bits()));
  return f;
#endif
}

// QW values of a cache row as float32 (the formats' `widen`, one register at a time).
inline vqf row_vec(const float* p) { vqf v; std::memcpy(&v, p, sizeof(v)); return v; }
// bfloat16 bits -> float32 (GCC splits the generic 16-lane widening into four 256-bit
// instructions under its 256-bit preference; the intrinsic is one vpmovzxwd).
inline vqf bf16_widen(vqu16 h) {
#if PAGEDKV_QW == 16
  return (vqf)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
#else
  return (vqf)(__builtin_convertvector(h, vqu32) << 16);
#endif
}
inline vqf row_vec(const c10::BFloat16* p) {
  vqu16 h;
  std::memcpy(&h, p, sizeof(h));
  return bf16_widen(h);
}
inline vqf row_vec(const c10::Half* p) { vqu16 h; std::memcpy(&h, p, sizeof(h)); return halves_to_float(h); }

// acc + the pairwise products of a and b summed in pairs (int16 x int16 -> int32).
inline vqi32 dot_pairs(vqi32 acc, vqs16 a, vqs16 b) {
#if PAGEDKV_QW == 16 && defined(__AVX512VNNI__)
  return (vqi32)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif PAGEDKV_QW == 16 && defined(__AVX512BW__)
  return acc + (vqi32)_mm512_madd_epi16((__m512i)a, (__m512i)b);
#elif PAGEDKV_QW == 8 && defined(__AVX2__)
  return acc + (vqi32)_mm256_madd_epi16((__m256i)a, (__m256i)b);
#else
  for (int i = 0; i < QW; i++) acc[i] += int32_t(a[2 * i]) * b[2 * i] + int32_t(a[2 * i + 1]) * b[2 * i + 1];
  return acc;
#endif
}

// out[i] = the sum of r[i]'s lanes, for QW vectors r (a transpose-and-add tree with AVX-512).
template <typename V> inline V row_sums(V* r) {
#if PAGEDKV_QW == 16
  constexpr bool is_int = std::is_same_v<V, vqi32>;
  auto add = [](__m512i a, __m512i b) {
    if constexpr (is_int) return _mm512_add_epi32(a, b);
    else return _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b)));
  };
  __m512i x[16];
  for (int i = 0; i < 16; i++) x[i] = (__m512i)r[i];
  for (int i = 0; i < 8; i++)  // lanes (a0+a2, b0+b2, a1+a3, b1+b3) per 128-bit quarter
    x[i] = add(_mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 4; i++)  // (a, b, c, d) partial sums per quarter
    x[i] = add(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 2; i++)
    x[i] = add(_mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], 0x88), _mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], 0xDD));
  return (V)add(_mm512_shuffle_i32x4(x[0], x[1], 0x88), _mm512_shuffle_i32x4(x[0], x[1], 0xDD));
#else
  V out;
  for (int i = 0; i < QW; i++) {
    auto s = r[i][0];
    for (int j = 1; j < QW; j++) s += r[i][j];
    out[i] = s;
  }
  return out;
#endif
}

#if PAGEDKV_QW == 16
// Transposes 16 rows of 16 32-bit lanes in place: afterwards x[i] lane j is what x[j] lane i
// was (unpack within 128-bit quarters, then two quarter shuffles: 64 shuffles in all).
inline void transpose16(__m512i (&x)[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++)
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
      x[4 * i + 2 * h] = _mm512_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);
      x[4 * i + 2 * h + 1] = _mm512_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);
    }
  // x[4i + k] now holds, in quarter q, lane 4q + k of rows 4i .. 4i + 3.
#pragma GCC unroll 2
  for (int i = 0; i < 2; i++)
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
      t[8 * i + k] = _mm512_shuffle_i32x4(x[8 * i + k], x[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_i32x4(x[8 * i + k], x[8 * i + 4 + k], 0xDD);
    }
#pragma GCC unroll 8
  for (int k = 0; k < 8; k++) {
    x[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    x[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xDD);
  }
}
#endif

// a * b + c as one fused multiply-add (QW lanes).
inline vqf fma_q(vqf a, vqf b, vqf c) {
#if PAGEDKV_QW == 16
  return (vqf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vqf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

}  // namespace
}  // namespace pagedkv_cpu
