// The 4-bit product at 16-64 activation rows with AMX-INT8 tiles (Intel Sapphire Rapids and
// later), on the same packed codes and the same int8 activations per group of 32 as the VNNI
// product (quant_int4.cpp's Q8Act): the integer dot of each (weight row, activation row, group)
// is exact either way, and each group's sum is scaled in float32 the same way, so the result is
// that product's up to float32 summation order.
// Per block of 16 weight rows: their codes unpacked once to bytes [group][16 rows][32] (tile A,
// unsigned 0..15), per tile of 16 activation rows and group one tdpbusd against the activations
// laid as tile B ([8 dwords of 4 codes][16 rows][4]: built once per call) leaves a 16 x 16 int32
// tile, whose rows are scaled by the weight row's scale times the activation steps and summed
// in float32 (plus the offset times the group's activation sum). Against the 4-code-lane vector
// product it was 2-4x faster at 16-64 rows (benchmarks/bench_quant_linear.py --rows 16,32,64,
// on an Intel AMX Xeon); the VNNI panel product (quant_int4.cpp) that now runs from 4 rows
// where there are no tiles has not been measured against it.
#pragma once

#if defined(PAGEDKV_QUANT_AMX) && defined(PAGEDKV_INT_VNNI)
#define PAGEDKV_INT4_AMX 1

namespace pagedkv_cpu {
namespace {

// Rows from which int4_gemv runs on tiles (where it has them): below, the vector product is
// faster; and up to which the packed linear runs the product at all (int4_linear), where the
// weight expanded for oneDNN's bfloat16 matmul is faster beyond (SmolLM2's linears: 1.2-1.9x
// faster at 16-64 rows than the expansion, on a par at 96; benchmarks/bench_quant_linear.py).
constexpr int64_t kAmxMinRows = 10;
constexpr int64_t kAmxMaxRows = 64;

// The activations of Q8Act `a` (m rows) as tile B: [tile of 16 rows][group][8][16][4] int8
// (codes 4c .. 4c + 3 of the group at dword c), rows past m zero; and per tile and group the
// 16 rows' steps and sums ([tile][group][16] float32).
struct Int4AmxAct {
  const int8_t* b;
  const float* d;
  const float* sum;
  int64_t tiles;
};

Int4AmxAct amx_activations(const Q8Act& a, int64_t m) {
  const int64_t tiles = (m + 15) / 16, groups = a.groups;
  int8_t* b = quant_rows::scratch<int8_t, 3>(tiles * groups * 512);
  float* d = quant_rows::scratch<float, 4>(tiles * groups * 16);
  float* sum = quant_rows::scratch<float, 5>(tiles * groups * 16);
  std::memset(b, 0, tiles * groups * 512);
  std::memset(d, 0, tiles * groups * 16 * sizeof(float));
  std::memset(sum, 0, tiles * groups * 16 * sizeof(float));
  for (int64_t r = 0; r < m; ++r) {
    const int64_t t = r / 16, i = r % 16;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* q = a.q + (r * a.chunks + g / 4) * 128 + (g % 4) * 16;
      int8_t* tile = b + (t * groups + g) * 512;
      for (int c = 0; c < 8; ++c)  // codes 0-15 from the low half, 16-31 from the high one
        std::memcpy(tile + c * 64 + i * 4, c < 4 ? q + 4 * c : q + 64 + 4 * (c - 4), 4);
      d[(t * groups + g) * 16 + i] = a.d[r * a.padded() + g];
      sum[(t * groups + g) * 16 + i] = a.sum[r * a.padded() + g];
    }
  }
  return Int4AmxAct{b, d, sum, tiles};
}

// Weight rows n0 .. n0 + 15's codes as bytes [group][16][32] (tile A) and their scales and
// offsets as float32 [group][16] each, into the given buffers.
template <typename S>
void amx_unpack_block(const uint8_t* codes, const S* scales, int64_t groups, uint8_t* a,
                      float* scale, float* offset) {
  const __m128i low4 = _mm_set1_epi8(15);
  const int64_t row_bytes = groups * 16;
  for (int64_t i = 0; i < 16; ++i) {
    const uint8_t* row = codes + i * row_bytes;
    const S* s = scales + i * 2 * groups;
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g));
      uint8_t* dst = a + (g * 16 + i) * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_and_si128(w, low4));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16),
                       _mm_and_si128(_mm_srli_epi16(w, 4), low4));
      scale[g * 16 + i] = scale_f(s, g);
      offset[g * 16 + i] = scale_f(s, groups + g);
    }
  }
}

// acc[i] (lanes: the tile's 16 activation rows) += weight row i's scale * steps * sums[i] +
// its offset * the activations' sums, for one group's int32 tile `sums` [16][16].
inline void amx_scale_group(const int32_t* sums, const float* scale, const float* offset,
                            const float* d, const float* xsum, __m512* acc) {
  const __m512 dv = _mm512_loadu_ps(d), sv = _mm512_loadu_ps(xsum);
  for (int i = 0; i < 16; ++i) {
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + 16 * i));
    acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(scale[i])), acc[i]);
    acc[i] = _mm512_fmadd_ps(sv, _mm512_set1_ps(offset[i]), acc[i]);
  }
}

// out [m, n] (T) = the activations times weight rows (codes, scales) + bias; n a multiple of 16.
template <typename S, typename T>
void int4_amx_product(const Int4AmxAct& act, int64_t m, const uint8_t* codes, const S* scales,
                      const TwoLevel& two, int64_t n, int64_t groups, const float* bias, T* out) {
  const int64_t blocks = n / 16, row_bytes = groups * 16;
  quant_rows::run_blocks(blocks, n * row_bytes * act.tiles, [&](int64_t b0, int64_t b1) {
    uint8_t* a = quant_rows::scratch<uint8_t, 0>(groups * 512);
    float* scale = quant_rows::scratch<float, 6>(groups * 16);
    float* offset = quant_rows::scratch<float, 7>(groups * 16);
    alignas(64) int32_t sums[2][256];
    alignas(64) float y[256];
    const quant_rows::IntTileConfig config(32);
    _tile_loadconfig(&config);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * 16;
      const S* block_scales = two.table
          ? reinterpret_cast<const S*>(
                two_level_rows(two, n0, 16, quant_rows::scratch<float, 15>(16 * 2 * groups)))
          : scales + n0 * 2 * groups;
      amx_unpack_block(codes + n0 * row_bytes, block_scales, groups, a, scale, offset);
      for (int64_t t = 0; t < act.tiles; ++t) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        const int8_t* bt = act.b + t * groups * 512;
        const float* dt = act.d + t * groups * 16;
        const float* st = act.sum + t * groups * 16;
        for (int64_t g = 0; g < groups; g += 2) {
          const bool pair = g + 1 < groups;
          _tile_zero(0);
          _tile_loadd(4, a + g * 512, 32);
          _tile_loadd(6, bt + g * 512, 64);
          _tile_dpbusd(0, 4, 6);
          if (pair) {
            _tile_zero(1);
            _tile_loadd(5, a + (g + 1) * 512, 32);
            _tile_loadd(7, bt + (g + 1) * 512, 64);
            _tile_dpbusd(1, 5, 7);
          }
          _tile_stored(0, sums[0], 64);
          if (pair) _tile_stored(1, sums[1], 64);
          amx_scale_group(sums[0], scale + g * 16, offset + g * 16, dt + g * 16, st + g * 16,
                          acc);
          if (pair)
            amx_scale_group(sums[1], scale + (g + 1) * 16, offset + (g + 1) * 16,
                            dt + (g + 1) * 16, st + (g + 1) * 16, acc);
        }
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(y + 16 * i, acc[i]);
        const int64_t rows = std::min<int64_t>(16, m - 16 * t);
        for (int64_t r = 0; r < rows; ++r)
          for (int i = 0; i < 16; ++i)
            out[(16 * t + r) * n + n0 + i] =
                static_cast<T>(y[16 * i + r] + (bias ? bias[n0 + i] : 0.f));
      }
    }
    _tile_release();
  });
}

}  // namespace
}  // namespace pagedkv_cpu
#endif
