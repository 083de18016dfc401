// What every kernel file shares: torch's headers, the scalar conversions that round as the
// pure-torch reference rounds, and the dtype dispatch.
//
// Each kernel rounds where the pure-torch reference in pagedkv/model/ rounds (statistics and
// accumulations in float32, results cast to the activation dtype at the same points), so the
// two paths agree to float32 summation order. Work is split across torch's own OpenMP pool
// (at::parallel_for), so torch.set_num_threads governs these kernels too.
//
// The helpers of these headers are in an unnamed namespace: each file that includes them has
// its own copy with internal linkage, as in one translation unit, so the compiler inlines them
// where it did there (a helper with external linkage may stay a call, through the PLT). Only
// the ops (ops.h) are seen across files.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace pagedkv_cpu {
namespace {

template <typename T> inline float to_f(T x) { return static_cast<float>(x); }
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }
// bfloat16 <-> float32 as c10's conversions (round to nearest even, NaN kept a quiet NaN), but
// branch-free, so that loops over them vectorize.
template <> inline float to_f(c10::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
template <> inline c10::BFloat16 from_f(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  r = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r;
  return c10::BFloat16(static_cast<uint16_t>(r), c10::BFloat16::from_bits());
}
// Round a float32 value to T's precision and back (identity for float).
template <typename T> inline float rnd(float x) { return to_f<T>(from_f<T>(x)); }

// Whether streaming reads prefetch into the L2 cache rather than L1 (the packed linears'
// decode products far ahead, the decode attention's next block row by row): on AMD's cores
// (Zen 4) L1 prefetches hold the L1 miss buffers the loads in hand need too, and left SmolLM2's
// Q8_0 decode at half one core's read bandwidth and scattered KV blocks read at 8-9 GB/s a core
// (19-21 with L2 prefetches); on Intel's the near prefetch into L1 was measured best. CPUID's
// vendor, read once.
inline bool far_l2_prefetch() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

// Asks for the cache line at p into L2 (prefetcht1).
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Asks for the `bytes` bytes at p, a stretch of a stream read soon, a cache line at a time:
// into L2 where far_l2_prefetch holds, else into L1 (the vendor read once for the stretch: a
// check per line cost the decode kernel a third of its speed).
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  if (far_l2_prefetch())
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 1);
  else
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
}

template <typename T> struct Tag { using type = T; };

// Calls f(Tag<T>{}) for the scalar type T of `dtype` (float, bfloat16, half).
template <typename F> void dispatch(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: f(Tag<float>{}); break;
    case at::kBFloat16: f(Tag<c10::BFloat16>{}); break;
    case at::kHalf: f(Tag<c10::Half>{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", dtype);
  }
}

}  // namespace
}  // namespace pagedkv_cpu
