// Whole-register loads, stores, roundings and exp for the elementwise kernels (norm_rope_act.cpp):
// QW lanes of float32 (simd.h's vqf; 16 with AVX-512, 8 with AVX2), from and to rows of float,
// bfloat16 or half, each rounding as common.h's scalar conversions round (round to nearest
// even), so a vector loop and its scalar tail give the same values.
#pragma once

#include "common.h"
#include "simd.h"

namespace pagedkv_cpu {
namespace {

inline vqf load_q(const float* p) { return row_vec(p); }
inline vqf load_q(const c10::BFloat16* p) { return row_vec(p); }
inline vqf load_q(const c10::Half* p) { return row_vec(p); }

// float32 bits -> bfloat16 bits, round to nearest even, NaN a quiet NaN (common.h's from_f).
inline vqu32 bf16_bits(vqf v) {
  const vqu32 u = (vqu32)v;
  const vqu32 r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (vqu32)(((u & 0x7FFFFFFFu) > 0x7F800000u) ? (vqu32)(r ^ r) + 0x7FC0u : r);
}

inline vqu16 half_bits(vqf v) {
#if PAGEDKV_QW == 16
  return (vqu16)_mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__F16C__)
  return (vqu16)_mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  vqu16 h;
  for (int i = 0; i < QW; i++) h[i] = c10::Half(v[i]).x;
  return h;
#endif
}

#if PAGEDKV_QW == 16 && defined(__AVX512BF16__)
// One vcvtneps2bf16: round to nearest even, NaN a quiet NaN, as bf16_bits, except that a
// denormal float32 input rounds to zero (the instruction's DAZ: below 2^-126, far under any
// activation's last place).
inline vqu16 bf16_halves(vqf v) { return (vqu16)(__m256i)_mm512_cvtneps_pbh((__m512)v); }
#else
inline vqu16 bf16_halves(vqf v) { return __builtin_convertvector(bf16_bits(v), vqu16); }
#endif

inline void store_q(float* p, vqf v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_q(c10::BFloat16* p, vqf v) {
  const vqu16 h = bf16_halves(v);
  std::memcpy(p, &h, sizeof(h));
}
inline void store_q(c10::Half* p, vqf v) {
  const vqu16 h = half_bits(v);
  std::memcpy(p, &h, sizeof(h));
}

// v rounded to T's precision and back (the vector rnd<T>).
template <typename T> inline vqf rnd_q(vqf v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return bf16_widen(bf16_halves(v));
  else if constexpr (std::is_same_v<T, c10::Half>) return halves_to_float(half_bits(v));
  else return v;
}

inline vqf splat_q(float x) { return vqf{} + x; }

inline float hsum_q(vqf v) {
  float s = 0.f;
  for (int i = 0; i < QW; i++) s += v[i];
  return s;
}

// exp(x), simd.h's fast_exp lane by lane (the same Cephes polynomial; n rounded to nearest
// instead of floor(x log2 e + 0.5), which differs only at exact ties, inside the
// polynomial's range either way).
inline vqf exp_q(vqf x) {
  x = x < -87.3f ? splat_q(-87.3f) : x;
  x = x > 88.7f ? splat_q(88.7f) : x;
  const vqf big = splat_q(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vqf n = (x * 1.44269504088896341f + big) - big;
  const vqf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vqf p = splat_q(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vqf y = p * r * r + r + 1.f;
  const vqi32 bits = (__builtin_convertvector(n, vqi32) + 127) << 23;
  return y * (vqf)bits;
}

// 1 / d to about 2^-23 relative (AVX-512: rcp14 and one Newton step, a fifth of a divide's
// cost; elsewhere the divide).
inline vqf recip_q(vqf d) {
#if PAGEDKV_QW == 16
  const vqf r = (vqf)_mm512_rcp14_ps((__m512)d);
  return r * (2.f - d * r);
#else
  return 1.f / d;
#endif
}

}  // namespace
}  // namespace pagedkv_cpu
