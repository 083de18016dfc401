// 4-bit group-32 weights (pagedkv/model/quant/int4_blocks.py: GGUF Q4_0, Q4_1, Q4_K) expanded
// to a dense weight for the compute-bound calls (a prefill's hundreds of rows), where oneDNN's
// matmul on the expanded weight beats any int4 kernel; decode-sized calls run torch's
// _weight_int4pack_mm_for_cpu on the packed codes instead (int4_linear.py).
// Registered as a fragment of the pagedkv_cpu library (bindings.cpp holds the rest).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
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

}  // namespace
}  // namespace pagedkv_cpu

TORCH_LIBRARY_FRAGMENT(pagedkv_cpu, m) {
  m.def("int4_expand(Tensor nibbles, Tensor scale_zero, ScalarType dtype) -> Tensor",
        &pagedkv_cpu::int4_expand);
}
