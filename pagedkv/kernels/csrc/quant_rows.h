// What the packed linears' decode products (quant_int4.cpp, quant_int8.cpp) share around their
// integer dot products, so that a small call costs little beyond reading its weights:
// - `load16`: 16 activations of any float type as float32 (no float32 copy of the input);
// - `quantize16`: 16 floats times 1 / step rounded to int8 (nearest even, as std::nearbyint);
// - `scratch`: a thread's reusable buffer (no allocation per call once it has grown);
// - `float_bias`: a bias as float32 without a tensor of its own;
// - `run_blocks`: a parallel loop that stays on the calling thread below `kInlineBytes` of
//   weights (a fork/join costs more than it saves there);
// - `for_row_blocks`: a large call's activation rows in blocks that stay in L2 while the panel
//   products pass every weight panel over them;
// - `expanded_linear`: the path beyond decode sizes, the weight expanded a chunk of rows at a
//   time into the activation dtype for the dense matmul (oneDNN's), a chunk small enough that
//   the allocator reuses its pages and the cache keeps it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"  // far_l2_prefetch

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__linux__)
#define PAGEDKV_QUANT_AMX 1
#include "amx.h"
#endif

namespace pagedkv_cpu {
namespace quant_rows {

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDKV_QUANT_ROWS_512 1
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_loadu_ps(p);
  }
}

// round(v * inv) as int8 (the default rounding mode: nearest even); |v * inv| <= 127.
inline __m128i quantize16(__m512 v, __m512 inv) {
  return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)));
}
#endif

#if defined(__AVX2__)
// 32 bytes: byte j is `value` where bit j of `bits` is set, else 0 (a code's high bit, packed
// a bit a code, as the byte it adds; AVX2 has no byte masks).
inline __m256i bits_to_bytes(uint32_t bits, char value) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                       3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(value));
}
#endif

// A buffer of at least `count` elements, this thread's own, kept between calls (tag: which).
template <typename E, int Tag>
inline E* scratch(size_t count) {
  thread_local std::vector<E> buffer;
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

// The bias as float32 (nullptr without one): its own data when float32, else a converted copy in
// this thread's scratch.
inline const float* float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
              "bias must be a contiguous [", n, "]");
  if (bias->scalar_type() == at::kFloat) return bias->data_ptr<float>();
  float* out = scratch<float, 0>(n);
  if (bias->scalar_type() == at::kBFloat16) {
    const c10::BFloat16* b = bias->data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(b[i]);
  } else if (bias->scalar_type() == at::kHalf) {
    const c10::Half* b = bias->data_ptr<c10::Half>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(b[i]);
  } else {
    TORCH_CHECK(false, "bias must be float32, bfloat16 or float16");
  }
  return out;
}

// Bytes ahead of the codes being read that the far prefetch asks for (into L2: prefetcht1).
constexpr int64_t kFarPrefetchBytes = 16 << 10;

// A prefetch distance of `bytes` for a product reading `tile` weight rows of `row_bytes` side
// by side, rounded up to whole tiles, so that each row's request lands on the same place of a
// row of a later tile. A distance of a fraction of a tile lands on rows already being read and
// never on some of the next tile's: at K = 8,192 (int8 codes: kFarPrefetchBytes = 2 rows of a
// tile of 4) a decode product streamed 1.2-1.4x slower per byte than at K = 2,048.
inline int64_t whole_tiles_ahead(int64_t bytes, int64_t row_bytes, int64_t tile) {
  const int64_t tile_bytes = row_bytes * tile;
  return (bytes + tile_bytes - 1) / tile_bytes * tile_bytes;
}


// Weight bytes (times the activation rows' passes over them) below which a product runs on the
// calling thread: a fork/join of the thread pool costs a few microseconds, what one core
// streams 40-60 KB of codes in (benchmarks/bench_quant_linear.py --small).
constexpr int64_t kInlineBytes = 48 << 10;

// fn(begin, end) over [0, count), split over threads unless `work_bytes` is below kInlineBytes.
template <typename Fn>
inline void run_blocks(int64_t count, int64_t work_bytes, const Fn& fn) {
  if (work_bytes < kInlineBytes || at::get_num_threads() == 1 || at::in_parallel_region()) {
    fn(int64_t{0}, count);
    return;
  }
  at::parallel_for(0, count, 1, fn);
}

// Activation rows the panel products (quant_int4.cpp, quant_int8.cpp) meet each laid-out weight
// panel with before the next panel: a block's int8 codes stay within about kPanelRowBlockBytes
// (in L2 while every panel passes over them), 64 to 256 rows. One 2,048-row call at a time
// took about 1.2x the CPU time of 256-row blocks over SmolLM2-135M's shapes (AMD Zen 4, one
// thread; benchmarks/bench_quant_linear.py --rows 256,2048); the laid-out panels cost a block
// of 64 rows or more little.
constexpr int64_t kPanelRowBlockBytes = 256 << 10;

inline int64_t panel_row_block(int64_t k) {
  return std::clamp<int64_t>(kPanelRowBlockBytes / k / 4 * 4, 64, 256);
}

// fn(first row, rows) over [0, m) in blocks of panel_row_block(k) rows.
template <typename Fn>
inline void for_row_blocks(int64_t m, int64_t k, const Fn& fn) {
  const int64_t block = panel_row_block(k);
  for (int64_t r0 = 0; r0 < m; r0 += block) fn(r0, std::min(block, m - r0));
}

// fn(row, tile) for row = 0, Max, 2 Max, ... below m, `tile` a std::integral_constant<int, R>
// of the R rows from `row` the panel products compute together (Max, or the rest at the end;
// their kPanelRowTile / kQ4PanelRowTile).
template <int Max, int R = Max, typename Fn>
inline void row_tile(int64_t r, int64_t left, const Fn& fn) {
  if constexpr (R == 1) {
    fn(r, std::integral_constant<int, 1>{});
  } else {
    if (left >= R) fn(r, std::integral_constant<int, R>{});
    else row_tile<Max, R - 1>(r, left, fn);
  }
}
template <int Max, typename Fn>
inline void for_row_tiles(int64_t m, const Fn& fn) {
  for (int64_t r = 0; r < m; r += Max) row_tile<Max>(r, m - r, fn);
}

// What int4_tile_rows / int8_block_tile_rows return where the panel product runs every call:
// a row count no call reaches.
constexpr int64_t kEveryRow = int64_t{1} << 40;

// Bytes of expanded weight (in the activation dtype) a larger call expands at a time.
constexpr int64_t kExpandChunkBytes = 2 << 20;

// x [M, K] W^T (+ bias) with expand(start, stop) giving W's rows [start, stop) in x's dtype.
template <typename Expand>
at::Tensor expanded_linear(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias,
                           const Expand& expand) {
  const int64_t k = x.size(-1);
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->to(x.scalar_type())
                                                            : at::Tensor();
  const int64_t step = std::max<int64_t>(16, kExpandChunkBytes / (x.element_size() * k));
  if (step >= n) return at::linear(x, expand(0, n), b.defined() ? c10::optional<at::Tensor>(b)
                                                                : c10::nullopt);
  std::vector<at::Tensor> parts;
  for (int64_t start = 0; start < n; start += step) {
    const int64_t stop = std::min(n, start + step);
    parts.push_back(at::linear(x, expand(start, stop),
                               b.defined() ? c10::optional<at::Tensor>(b.slice(0, start, stop))
                                           : c10::nullopt));
  }
  return at::cat(parts, -1);
}

#if defined(PAGEDKV_QUANT_AMX)
// Palette 1 for an int8 product `kbytes` (16 or 32: one block of scales) deep: tiles 0-1 int32
// sums (16 x 16), 4-5 the weight codes (16 rows x kbytes), 6-7 the activations laid 4 codes a
// dword (kbytes / 4 x 16 rows x 4).
struct alignas(64) IntTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit IntTileConfig(int kbytes) {
    for (int t : {0, 1}) { colsb[t] = 64; rows[t] = 16; }
    for (int t : {4, 5}) { colsb[t] = static_cast<uint16_t>(kbytes); rows[t] = 16; }
    for (int t : {6, 7}) { colsb[t] = 64; rows[t] = static_cast<uint8_t>(kbytes / 4); }
  }
};
#endif

// The output shape of x [..., K] times W^T, W [N, K]: [..., N].
inline std::vector<int64_t> out_sizes(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  return sizes;
}

#if defined(__AVX2__)
// The int8 blocks' panel layout (quant_int8.cpp): r [i] (8 dwords each: row i) becomes the
// transpose, r [q] = dword q of rows 0..7. (On transpose8x8x2 below, 16 rows a pass, its decode
// step at 16 rows ran 1.07x slower on AMD Zen 5: SmolLM2 Q8_0, bench_decode_step.py.)
inline void transpose8x8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, 4-7
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x20);
    r[q + 4] = _mm256_permute2x128_si256(u[q], u[4 + q], 0x31);
  }
}
#endif

#if defined(__AVX512F__)
// The 4-bit panel layout (quant_int4.cpp): an 8 x 8 dword transpose on both 256-bit halves at
// once, r [i] = (row i, row 8 + i) becoming r [q] = (dword q of rows 0..7, of rows 8..15): the
// 16 rows' dword q in one vector (half the shuffles of two 256-bit ones).
inline void transpose8x8x2(__m512i r[8]) {
  __m512i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (and 8-11), 4-7 (and 12-15)
    u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  // Within each half, the 128-bit lanes paired (as _mm256_permute2x128_si256's 0x20 and 0x31).
  const __m512i low = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  const __m512i high = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm512_permutex2var_epi64(u[q], low, u[4 + q]);
    r[q + 4] = _mm512_permutex2var_epi64(u[q], high, u[4 + q]);
  }
}
#endif

}  // namespace quant_rows
}  // namespace pagedkv_cpu
