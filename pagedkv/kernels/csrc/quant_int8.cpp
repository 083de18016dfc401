// int8 weights with a float32 or float16 scale per block of 16 or 32 along each row (pagedkv/model/
// int8_blocks.py: GGUF Q8_0 blocks of 32, Q6_K's 6-bit codes with their per-16 scales), computed
// on the packed codes as llama.cpp's Q8_0 x Q8_0 dot does: each activation row is quantized per
// block to int8 (scale = the block's largest magnitude / 127, codes rounded to nearest even), the
// integer dot products are exact (int32), and each block's sum is scaled by the two scales in
// float32. Decode-sized calls (a few rows) run this; larger ones expand the weight to a dense one
// (`int8_block_expand`) for oneDNN's matmul (int8_block_linear.py).
//
// AVX-512 VNNI's vpdpbusd (unsigned times signed bytes, 64 codes an instruction, 4 codes a
// lane) takes the weight codes offset by 128 (an xor of the sign bit: unsigned, 0..255) and the
// activation codes as they are, from an accumulator of -128 * each lane's activation sum
// (computed once per call, not per weight row; see dot_chunk); AVX2's vpmaddubsw + vpmaddwd
// takes |w| (up to 128: every int8 code, -128 included) as the unsigned operand and x with w's
// sign as the signed one (x is within [-127, 127], so the negation is exact; pair sums up to
// 2 * 128 * 127, within int16). Output columns are split over threads, 4 computed together
// (independent sums in flight); each column's codes are read once for all rows. From 4 rows,
// AVX-512 VNNI runs the panel product instead (panel_columns: the weight rows' codes laid out
// per call so that a block's whole dot sums in an int32 lane).
// Registered as a fragment of the pagedkv_cpu library (bindings.cpp holds the rest).
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

#include "quant_rows.h"
#include "simd.h"

namespace pagedkv_cpu {
namespace {

// Activation rows quantized per block: codes int8 [M, K], and per 4-code lane the block's scale
// (float32 [M, K / 4]), the layout the dot loops multiply by lane, and -128 times the lane's
// code sum (int32 [M, K / 4]: the AVX-512 path's correction for its offset weight codes), and
// the blocks' scales once each (float32 [M, K / block]), in this thread's scratch (valid until
// its next call); in AVX2 builds also -128 times the code sum of each 16 codes, 8 a whole 128
// codes in the order the AVX2 product sums its dots (int32 [M, K / 16]: span_offsets).
struct QuantizedRows {
  const int8_t* codes;
  const int32_t* lane_offset;
  const float* lane_scale;
  const float* block_scale;
  const int32_t* span_offset = nullptr;
};

// A weight block's scale, stored as float32 or as float16 (Q8_0's own values: half the bytes a
// decode step reads for them), as float32.
inline float scale_value(const float* p) { return *p; }
inline float scale_value(const c10::Half* p) { return static_cast<float>(*p); }

// Every cache line of `bytes` bytes from p asked for into L2 (none where bytes <= 0).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) prefetch_l2(static_cast<const char*>(p) + b);
}

// Where a weight's block scales come from, a tile of weight rows at a time (`rows(r0, nr)`:
// rows r0 .. r0 + nr - 1's scales, K / B of them a row, as `type`; `prefetch(r0, nr, n)`: the
// same rows' bytes asked for into L2, those past row n not):
// - TableScales: a float32 or float16 table [N, K / B], read in place;
// - TwoLevelScales: Q6_K's two levels as the file has them (int8_blocks.q6_k_two_level), a
//   uint8 row of K / 16 int8 sub-scales then K / 256 float16 d's; scale = d * sub-scale,
//   exact in float32 (the float32 table's very values), materialized a tile's rows at a time
//   into this thread's scratch (valid until its next `rows`). 1.07 bytes a weight with the
//   codes where the float32 table takes 1.25 (the file: 0.82).
template <typename S>
struct TableScales {
  using type = S;
  const S* ws;
  int64_t kb;  // scales a row
  const S* rows(int64_t r0, int64_t) const { return ws + r0 * kb; }
  // Rows r0 .. r0 + nr - 1's scales asked for into L2 (rows past `n` not).
  void prefetch(int64_t r0, int64_t nr, int64_t n) const {
    prefetch_bytes(ws + r0 * kb, std::min(nr, n - r0) * kb * int64_t(sizeof(S)));
  }
};

struct TwoLevelScales {
  using type = float;
  const uint8_t* table;
  int64_t kb;  // blocks of 16 a row (a multiple of 16)
  int64_t row_bytes() const { return kb + kb / 8; }
  void prefetch(int64_t r0, int64_t nr, int64_t n) const {
    prefetch_bytes(table + r0 * row_bytes(), std::min(nr, n - r0) * row_bytes());
  }
  const float* rows(int64_t r0, int64_t nr) const {
    float* out = quant_rows::scratch<float, 16>(nr * kb);
    for (int64_t r = 0; r < nr; ++r) {
      const uint8_t* t = table + (r0 + r) * row_bytes();
      const uint8_t* d = t + kb;
      for (int64_t s = 0; s < kb / 16; ++s) {
        uint16_t bits;
        std::memcpy(&bits, d + 2 * s, sizeof(bits));
        const float dv = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
        const int8_t* sub = reinterpret_cast<const int8_t*>(t + 16 * s);
        float* o = out + r * kb + 16 * s;
#if defined(__AVX512F__)
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)))),
                                          _mm512_set1_ps(dv)));
#elif defined(__AVX2__)
        for (int h = 0; h < 2; ++h) {
          int64_t eight;
          std::memcpy(&eight, sub + 8 * h, sizeof(eight));
          _mm256_storeu_ps(o + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                        _mm_cvtsi64_si128(eight))),
                                                    _mm256_set1_ps(dv)));
        }
#else
        for (int i = 0; i < 16; ++i) o[i] = dv * static_cast<float>(sub[i]);
#endif
      }
    }
    return out;
  }
};

// Codes below 8 bits kept as compact as the file's (int8_blocks.packed_codes): per 64 codes of
// a row, 32 bytes of low nibbles (byte i: code i | code i + 32 << 4), then the high bits:
// Q6_K's 6-bit codes 16 bytes of pairs (byte i: codes i, i + 16, i + 32, i + 48, two bits
// each), Q5_0's 5-bit codes 8 bytes (bit j: code j's), each code stored plus kBias (0 ..
// 2^Bits - 1): 0.75 and 0.625 bytes a weight where an int8 code takes 1. Bits 4: IQ4_NL's and
// IQ4_XS's codes, the nibbles indices into kIq4Values (0.5 bytes a weight); kBias 128 (the
// values' offset to vpdpbusd's unsigned operand). Bits 3: Q3_K's codes, no nibbles: 16 bytes
// of their low pairs (laid as Q6_K's high pairs), then 8 bytes of their third bits (as Q5_0's
// fifth), 0.375 bytes a weight. Bits 8: int8 codes.
template <int Bits>
struct PackedBits {
  static_assert(Bits == 3 || Bits == 4 || Bits == 5 || Bits == 6 || Bits == 8,
                "codes of 3, 4, 5, 6 or 8 bits");
  static constexpr int64_t kChunkBytes = 8 * Bits;
  static constexpr int kBias = Bits == 4 ? 128 : 1 << (Bits - 1);
  // vpdpbusd's start for the stored codes: -kBias times each lane's activation code sum, the
  // quantized rows' -128 times it shifted right.
  static constexpr int kOffsetShift = Bits == 4 ? 0 : 8 - Bits;
  static int64_t row_bytes(int64_t k) { return k / 64 * kChunkBytes; }
};

// IQ4_NL's table (llama.cpp's kvalues_iq4nl; IQ4_XS's too): a 4-bit code's value.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

#if defined(__AVX512BW__)
// Codes 16L .. 16L + 15 of a chunk (128-bit lane L) from bits 2L, 2L + 1 of the 16 pair bytes
// at p, as bytes 0..3.
inline __m512i pair_codes(const uint8_t* p) {
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0x20002, 0x20002, 0x20002, 0x20002,
                                          0x40004, 0x40004, 0x40004, 0x40004,
                                          0x60006, 0x60006, 0x60006, 0x60006);
  return _mm512_and_si512(_mm512_srlv_epi16(pairs, shift), _mm512_set1_epi8(3));
}

// One 64-code chunk's stored codes (plus kBias, unsigned), in order, from its bytes at p.
template <int Bits>
inline __m512i packed_chunk(const uint8_t* p) {
  if constexpr (Bits == 3) {  // the low pairs, the third bits
    uint64_t bits;
    std::memcpy(&bits, p + 16, sizeof(bits));
    return _mm512_or_si512(pair_codes(p), _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(4)));
  }
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i m4 = _mm256_set1_epi8(15);
  const __m512i nibbles = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_and_si256(low, m4)),
      _mm256_and_si256(_mm256_srli_epi16(low, 4), m4), 1);
  if constexpr (Bits == 4) {  // the table's values plus 128, each 128-bit lane a copy
    const __m512i table = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values))),
        _mm512_set1_epi8(static_cast<char>(0x80)));
    return _mm512_shuffle_epi8(table, nibbles);
  } else if constexpr (Bits == 5) {
    uint64_t bits;
    std::memcpy(&bits, p + 32, sizeof(bits));
    return _mm512_or_si512(nibbles, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(16)));
  } else {
    return _mm512_or_si512(nibbles, _mm512_slli_epi16(pair_codes(p + 32), 4));
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512BW__)
// Codes 32h .. 32h + 31 of a chunk (codes 16L .. 16L + 15, L = 2h, 2h + 1, take bits 2L, 2L + 1)
// from the 16 pair bytes at p, as bytes 0..3.
inline __m256i pair_codes_avx2(const uint8_t* p, int h) {
  const __m256i pairs =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i shifted = h ? _mm256_blend_epi32(_mm256_srli_epi16(pairs, 4),
                                                 _mm256_srli_epi16(pairs, 6), 0xF0)
                            : _mm256_blend_epi32(pairs, _mm256_srli_epi16(pairs, 2), 0xF0);
  return _mm256_and_si256(shifted, _mm256_set1_epi8(3));
}

// As pair_codes_avx2, the two bits already at bits 4-5 (times 16: Q6_K's high pairs), one
// operation fewer (two at h = 1): the 16-bit shifts' spill into the next byte falls outside
// 0x30.
inline __m256i high_pairs_avx2(const uint8_t* p, int h) {
  const __m256i pairs =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i shifted = h ? _mm256_blend_epi32(pairs, _mm256_srli_epi16(pairs, 2), 0xF0)
                            : _mm256_blend_epi32(_mm256_slli_epi16(pairs, 4),
                                                 _mm256_slli_epi16(pairs, 2), 0xF0);
  return _mm256_and_si256(shifted, _mm256_set1_epi8(0x30));
}

// Codes 32h .. 32h + 31 of a 64-code chunk at p, stored (plus kBias), with AVX2 alone.
template <int Bits>
inline __m256i packed_half_avx2(const uint8_t* p, int h) {
  if constexpr (Bits == 3) {
    uint32_t bits;
    std::memcpy(&bits, p + 16 + 4 * h, sizeof(bits));
    return _mm256_or_si256(pair_codes_avx2(p, h), quant_rows::bits_to_bytes(bits, 4));
  }
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nibbles =
      _mm256_and_si256(h ? _mm256_srli_epi16(low, 4) : low, _mm256_set1_epi8(15));
  if constexpr (Bits == 4) {
    const __m256i table = _mm256_xor_si256(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values))),
        _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_shuffle_epi8(table, nibbles);
  } else if constexpr (Bits == 5) {  // bit j of the 32 -> byte j: 16 where set
    uint32_t bits;
    std::memcpy(&bits, p + 32 + 4 * h, sizeof(bits));
    return _mm256_or_si256(nibbles, quant_rows::bits_to_bytes(bits, 16));
  } else {
    return _mm256_or_si256(nibbles, high_pairs_avx2(p + 32, h));
  }
}
#endif

// One 64-code chunk's codes (signed) from its bytes at p into out.
template <int Bits>
inline void packed_unpack(const uint8_t* p, int8_t* out) {
  constexpr int kBias = PackedBits<Bits>::kBias;
#if defined(__AVX512BW__)
  _mm512_storeu_si512(out, _mm512_sub_epi8(packed_chunk<Bits>(p), _mm512_set1_epi8(kBias)));
#elif defined(__AVX2__)
  for (int h = 0; h < 2; ++h)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * h),
                        _mm256_sub_epi8(packed_half_avx2<Bits>(p, h), _mm256_set1_epi8(kBias)));
#else
  if constexpr (Bits == 4) {
    for (int i = 0; i < 32; ++i) {
      out[i] = kIq4Values[p[i] & 15];
      out[i + 32] = kIq4Values[p[i] >> 4];
    }
    return;
  }
  if constexpr (Bits == 3) {
    for (int i = 0; i < 64; ++i)
      out[i] = static_cast<int8_t>((((p[i % 16] >> (2 * (i / 16))) & 3) |
                                    ((p[16 + i / 8] >> (i % 8)) & 1) << 2) - kBias);
    return;
  }
  for (int i = 0; i < 32; ++i) {
    out[i] = static_cast<int8_t>(p[i] & 15);
    out[i + 32] = static_cast<int8_t>(p[i] >> 4);
  }
  for (int i = 0; i < 64; ++i) {
    const int high = Bits == 5 ? (p[32 + i / 8] >> (i % 8)) & 1
                               : (p[32 + i % 16] >> (2 * (i / 16))) & 3;
    out[i] = static_cast<int8_t>(out[i] + (high << 4) - kBias);
  }
#endif
}

// Where a weight's int8 codes come from, a tile of weight rows at a time (`rows(r0, nr)`: the
// rows' codes int8 [nr][K]): Codes<8>, int8 [N, K] read in place; Codes<6>, <5>, <4>, <3>, packed
// (PackedBits), unpacked into this thread's scratch (valid until its next `rows`), except by
// the AVX-512 VNNI decode product and the panel layout, which read them themselves.
// `bytes(r)`: row r's start.
template <int Bits>
struct Codes {
  static constexpr int kBits = Bits;
  const int8_t* w;
  int64_t k;  // a multiple of 64 below 8 bits
  int64_t row_bytes() const { return Bits == 8 ? k : PackedBits<Bits>::row_bytes(k); }
  const int8_t* bytes(int64_t r) const { return w + r * row_bytes(); }
  const int8_t* rows(int64_t r0, int64_t nr) const {
    if constexpr (Bits == 8) {
      return w + r0 * k;
    } else {
      int8_t* out = quant_rows::scratch<int8_t, 17>(nr * k);
      const uint8_t* packed = reinterpret_cast<const uint8_t*>(w);
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t c = 0; c < k / 64; ++c)
          packed_unpack<Bits>(packed + (r0 + r) * row_bytes() + c * PackedBits<Bits>::kChunkBytes,
                              out + r * k + 64 * c);
      return out;
    }
  }
};

// One block of x (values from v) into out: returns the step (max |x| / 127).
template <typename T, int64_t block>
inline float quantize_block(const T* v, int8_t* out) {
#if defined(PAGEDKV_QUANT_ROWS_512)
  __m512 x[block / 16];
  __m512 amax = _mm512_setzero_ps();
  for (int64_t h = 0; h < block / 16; ++h) {
    x[h] = quant_rows::load16(v + 16 * h);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(x[h]));
  }
  const float d = _mm512_reduce_max_ps(amax) / 127.f;
  const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
  for (int64_t h = 0; h < block / 16; ++h)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h), quant_rows::quantize16(x[h], id));
  return d;
#else
  float amax = 0.f;
  for (int64_t j = 0; j < block; ++j) amax = std::max(amax, std::fabs(static_cast<float>(v[j])));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  for (int64_t j = 0; j < block; ++j)
    out[j] = static_cast<int8_t>(std::nearbyint(static_cast<float>(v[j]) * id));
  return d;
#endif
}

#if defined(__AVX2__) && !defined(__AVX512BW__)
// span[r * K / 16 + 8 s + i] for each whole 128 codes s of row r: -128 times the code sum of
// codes 32i .. 32i + 15 of the span (i < 4), of codes 32(i - 4) + 16 .. 32(i - 4) + 31 (i >= 4):
// hadd_blocks8's order, from the lanes' -128 times their 4 codes' sums.
inline void span_offsets(const int32_t* lane_offset, int64_t m, int64_t k, int32_t* span) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t s = 0; s + 128 <= k; s += 128) {
      const int32_t* lane = lane_offset + (r * k + s) / 4;  // 32 lanes of 4 codes
      int32_t* out = span + (r * k + s) / 16;
      for (int i = 0; i < 4; ++i) {
        out[i] = lane[8 * i] + lane[8 * i + 1] + lane[8 * i + 2] + lane[8 * i + 3];
        out[4 + i] = lane[8 * i + 4] + lane[8 * i + 5] + lane[8 * i + 6] + lane[8 * i + 7];
      }
    }
}
#endif

template <typename T, int64_t block>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k) {
  int8_t* codes = quant_rows::scratch<int8_t, 2>(m * k);
  int32_t* lane_offset = quant_rows::scratch<int32_t, 0>(m * k / 4);
  float* lane_scale = quant_rows::scratch<float, 3>(m * k / 4);
  float* block_scale = quant_rows::scratch<float, 9>(m * k / block);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < k / block; ++b) {
      const int64_t at = r * k + b * block;
      int8_t* out = codes + at;
      const float d = quantize_block<T, block>(x + at, out);
      block_scale[at / block] = d;
      std::fill_n(lane_scale + at / 4, block / 4, d);
      for (int64_t j = 0; j < block; j += 4)
        lane_offset[(at + j) / 4] = -128 * (int32_t(out[j]) + out[j + 1] + out[j + 2] + out[j + 3]);
    }
  }
  QuantizedRows q{codes, lane_offset, lane_scale, block_scale};
#if defined(__AVX2__) && !defined(__AVX512BW__)
  int32_t* span = quant_rows::scratch<int32_t, 2>(m * k / 16);
  span_offsets(lane_offset, m, k, span);
  q.span_offset = span;
#endif
  return q;
}

// How far ahead of the weight row being computed the products prefetch its codes and scales
// (into L1, once per tile of rows; where far_l2_prefetch holds, dot_chunk's far
// prefetch into L2 instead): a decode step streams every weight once (the tied LM head: 28 MiB
// of codes), and one core's outstanding misses bound its read bandwidth; about 2x on SmolLM2's
// head at one row, and 2 KiB ahead 5-10% less one-thread CPU time over a SmolLM2-shaped
// decode's linears than 4 KiB or 8 (on an Intel AMX Xeon).
constexpr int64_t kInt8PrefetchBytes = 2048;

// Weight rows dot_columns reads side by side (its kColTile): the far prefetch's tile.
constexpr int kFarTileRows = 4;

// Codes and scales of the weight row kInt8PrefetchBytes ahead of `w` (rows `row_bytes` of
// codes and `kb` scales apart).
template <typename S>
inline void prefetch_ahead(const int8_t* w, const S* ws, int64_t row_bytes, int64_t kb) {
  const int64_t rows = std::max<int64_t>(1, kInt8PrefetchBytes / row_bytes);
  __builtin_prefetch(ws + rows * kb);
  for (int64_t c = 0; c < row_bytes; c += 64)
    __builtin_prefetch(w + rows * row_bytes + c);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr const char* kInt8Isa = "avx512_vnni";
constexpr bool kInt8FarPrefetch = true;  // dot_chunk's far prefetch (AMD's cores)
constexpr bool kPackedInPlace = true;    // the decode product reads packed codes itself

// One 64-code chunk (its first `left` codes; 32 or 64) of NC weight rows from `w` (K codes
// apart; block scales from `ws`) against R rows of `q`, into acc[r * NC + j].
// vpdpbusd multiplies unsigned by signed bytes: the weight codes offset by 128 (w xor 0x80:
// unsigned, 0..255) times the activation codes (signed, -127..127), from an accumulator of -128
// times each lane's activation code sum, leaves each lane's exact dot sum(w * x).
inline __m512 load_scales(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_scales(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// The accumulators' start: -128 times each lane's activation code sum (the codes offset by 128),
// or -kBias times it (codes below 8 bits, stored plus kBias: PackedBits).
template <int Bits>
inline __m512i lane_offsets(__mmask16 lanes, const int32_t* p) {
  const __m512i offset = _mm512_maskz_loadu_epi32(lanes, p);
  if constexpr (PackedBits<Bits>::kOffsetShift == 0) return offset;  // int8 codes, IQ4's
  else return _mm512_srai_epi32(offset, PackedBits<Bits>::kOffsetShift);
}

// A chunk's 2 (block 32) or 4 (block 16) block scales in the low lanes, the rest zero.
inline __m128 chunk_scales(const float* p, __mmask8 m) { return _mm_maskz_loadu_ps(m, p); }
inline __m128 chunk_scales(const c10::Half* p, __mmask8 m) {
  return _mm_cvtph_ps(_mm_maskz_loadu_epi16(m, p));
}

// Far: AMD's tuning (far_l2_prefetch). Each chunk first asks for the codes
// `far` bytes ahead of each of its rows' (none where `far` is 0: past the weight's end),
// and the two scales (weight block, activation block) are multiplied in 128 bits before one
// permute spreads them over the lanes: 512-bit operations, which Zen 4 runs as two halves, go
// from 7 to 5 a chunk and weight row. Without it, the scales are spread first and multiplied
// in 512 bits, as measured best on Intel's cores.
// Bits below 8: the rows are packed codes (PackedBits, row_bytes apart): the codes plus kBias
// as read are vpdpbusd's unsigned operand as they are, from -kBias times each lane's activation
// code sum.
template <int R, int NC, int64_t block, typename S, bool Far, int Bits>
inline void dot_chunk(const int8_t* w, const S* ws, const QuantizedRows& q, int64_t row0,
                      int64_t k, int64_t c, int64_t left, __m512* acc, int64_t far) {
  constexpr bool kPacked = Bits != 8;
  const int64_t row_bytes = kPacked ? PackedBits<Bits>::row_bytes(k) : k;
  // The chunk's first byte in a row (c: a multiple of 64).
  const int64_t at = kPacked ? c / 64 * PackedBits<Bits>::kChunkBytes : c;
  if constexpr (Far) {
    if (far)
      for (int j = 0; j < NC; ++j) prefetch_l2(w + j * row_bytes + at + far);
  }
  // Lane l of the chunk (4 codes) is in block l / (block / 4) of it.
  const __m512i lane_block = _mm512_srli_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      block == 32 ? 3 : 2);
  const __mmask64 bytes = left == 64 ? ~0ull : (1ull << left) - 1;
  const __mmask16 lanes = left == 64 ? 0xFFFF : static_cast<__mmask16>((1u << (left / 4)) - 1);
  const __mmask16 blocks = static_cast<__mmask16>((1u << (left / block)) - 1);
  __m512i wu[NC];
  for (int j = 0; j < NC; ++j)
    wu[j] = kPacked
        ? packed_chunk<Bits>(reinterpret_cast<const uint8_t*>(w + j * row_bytes + at))
        : _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, w + j * k + c),
                           _mm512_set1_epi8(static_cast<char>(0x80)));
  if constexpr (Far) {
    const __mmask8 blocks8 = static_cast<__mmask8>(blocks);
    __m128 wsc[NC];
    for (int j = 0; j < NC; ++j) wsc[j] = chunk_scales(ws + j * (k / block) + c / block, blocks8);
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r;
      const __m512i xv = _mm512_maskz_loadu_epi8(bytes, q.codes + row * k + c);
      const __m512i offset = lane_offsets<Bits>(lanes, q.lane_offset + (row * k + c) / 4);
      const __m128 xscale = _mm_maskz_loadu_ps(blocks8, q.block_scale + (row * k + c) / block);
      for (int j = 0; j < NC; ++j) {
        const __m512i dot = _mm512_dpbusd_epi32(offset, wu[j], xv);
        const __m512 s = _mm512_permutexvar_ps(
            lane_block, _mm512_castps128_ps512(_mm_mul_ps(xscale, wsc[j])));
        acc[r * NC + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r * NC + j]);
      }
    }
    return;
  }
  __m512 wscale[NC];
  for (int j = 0; j < NC; ++j)
    wscale[j] = _mm512_permutexvar_ps(
        lane_block, load_scales(ws + j * (k / block) + c / block, blocks));
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + r;
    const __m512i xv = _mm512_maskz_loadu_epi8(bytes, q.codes + row * k + c);
    const __m512i offset = lane_offsets<Bits>(lanes, q.lane_offset + (row * k + c) / 4);
    const __m512 xscale = _mm512_maskz_loadu_ps(lanes, q.lane_scale + (row * k + c) / 4);
    for (int j = 0; j < NC; ++j) {
      const __m512i dot = _mm512_dpbusd_epi32(offset, wu[j], xv);
      acc[r * NC + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(xscale, wscale[j]),
                                        acc[r * NC + j]);
    }
  }
}

// Up to R rows against NC weight rows from `w` (codes [NC, K], block scales `ws`):
// out[r * out_stride + j] = row r's dot with weight row j. Several weight rows at once keep
// independent sums in flight: one alone is bound by its chain of float adds.
template <int R, int NC, int64_t block, typename S, bool Far, int Bits>
void dot_tile(const int8_t* w, const S* ws, const QuantizedRows& q, int64_t row0, int64_t k,
              float* out, int64_t out_stride, const int8_t* w_end) {
  __m512 acc[R * NC];
  for (int i = 0; i < R * NC; ++i) acc[i] = _mm512_setzero_ps();
  // The far prefetch's distance, 0 where it would pass the weight's end for some chunk of
  // these rows (those last rows are already on their way); their scales: dot_columns asks for a
  // tile's whole, a tile ahead.
  const int64_t row_bytes = Bits == 8 ? k : PackedBits<Bits>::row_bytes(k);
  int64_t far = 0;
  if constexpr (Far) {
    far = quant_rows::whole_tiles_ahead(quant_rows::kFarPrefetchBytes, row_bytes, kFarTileRows);
    if (w + NC * row_bytes + far > w_end) far = 0;
  }
  int64_t c = 0;
  for (; c + 64 <= k; c += 64)
    dot_chunk<R, NC, block, S, Far, Bits>(w, ws, q, row0, k, c, 64, acc, far);
  if (c < k)  // 32 codes left (int8 codes alone: packed ones have K a multiple of 64)
    dot_chunk<R, NC, block, S, Far, 8>(w, ws, q, row0, k, c, k - c, acc, far);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NC; ++j) out[r * out_stride + j] = _mm512_reduce_add_ps(acc[r * NC + j]);
}
#elif defined(__AVX2__)
constexpr const char* kInt8Isa = "avx2";
constexpr bool kInt8FarPrefetch = true;  // dot_rows' far prefetch (AMD's cores: Zen 3)
constexpr bool kPackedInPlace = true;  // dot_rows unpacks 32 codes at a time in registers

// Codes c .. c + 31 of weight row w (int8, or packed in Bits bits: PackedBits) as int8.
template <int Bits>
inline __m256i codes32_avx2(const int8_t* w, int64_t c) {
  if constexpr (Bits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
  } else {
    const uint8_t* chunk =
        reinterpret_cast<const uint8_t*>(w) + c / 64 * PackedBits<Bits>::kChunkBytes;
    return _mm256_sub_epi8(packed_half_avx2<Bits>(chunk, static_cast<int>(c % 64 / 32)),
                           _mm256_set1_epi8(static_cast<char>(PackedBits<Bits>::kBias)));
  }
}

// The scales of the blocks 128 codes from p hold (8 of 16 codes, or 4 of 32) in the order
// hadd_blocks8 leaves their sums: blocks 0, 2, 4, 6, then 1, 3, 5, 7 (16 codes); blocks 0-3
// twice (32 codes: each block's two halves).
template <int64_t block, typename S>
inline __m256 block_scales8(const S* p) {
  constexpr int n = block == 16 ? 8 : 4;
  __m256 v;
  if constexpr (std::is_same_v<S, float>) {
    v = n == 8 ? _mm256_loadu_ps(p) : _mm256_castps128_ps256(_mm_loadu_ps(p));
  } else {
#if defined(__F16C__)
    v = _mm256_cvtph_ps(n == 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                               : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float f[8] = {};
    for (int i = 0; i < n; ++i) f[i] = scale_value(p + i);
    v = _mm256_load_ps(f);
#endif
  }
  return _mm256_permutevar8x32_ps(v, block == 16 ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)
                                                 : _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3));
}

// Four 32-code dots' int32 lanes (4 codes a lane) summed by three vphaddd: lanes 0-3 hold the
// first halves' sums of registers 0-3, lanes 4-7 the second halves' (a half: one block of 16,
// or half a block of 32).
inline __m256i hadd_blocks8(const __m256i* d) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
}

// One weight row (codes from w: int8, or packed in Bits bits: PackedBits) against R rows;
// each 64 codes first ask for the row's bytes `far` ahead into L2 (none where far is 0). Per
// 128 codes the four 32-code dots are summed to one int32 a block (half block at 32 codes:
// hadd_blocks8) and scaled by the blocks' two scales with one convert and one multiply-add,
// the last codes 32 at a time. (Scaling each 32 codes' lanes as they came chained every 32
// codes through the row's accumulator: a 1B-shaped Q6_K weight's product at about 22 GB/s on
// two Zen 4 cores, compute-bound.)
template <int R, int64_t block, typename S, int Bits>
void dot_rows(const int8_t* w, const S* ws, const QuantizedRows& q, int64_t row0, int64_t k,
              float* out, int64_t out_stride, int64_t far) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const auto prefetch = [&](int64_t c) {
    if (far) prefetch_l2(w + (Bits == 8 ? c : c / 64 * PackedBits<Bits>::kChunkBytes) + far);
  };
  // Packed codes of 6, 5 or 3 bits meet x as stored (plus kBias: 0 .. 63 at most, vpmaddubsw's
  // unsigned operand with its pair sums within int16), and each 16 codes' sum then takes
  // -kBias times x's codes' sum (span_offset), exact in int32 as the int8 codes' |w| and
  // x * sign(w) are: the same sums, 3 fewer operations a 32 codes.
  constexpr bool kStored = Bits == 6 || Bits == 5 || Bits == 3;
  int64_t c = 0;
  for (; c + 128 <= k; c += 128) {
    prefetch(c);
    prefetch(c + 64);
    __m256i wv[4], wabs[4];
    for (int u = 0; u < 4; ++u) {
      if constexpr (kStored) {
        wv[u] = packed_half_avx2<Bits>(reinterpret_cast<const uint8_t*>(w) +
                                           (c / 64 + u / 2) * PackedBits<Bits>::kChunkBytes,
                                       u % 2);
      } else {
        wv[u] = codes32_avx2<Bits>(w, c + 32 * u);
        wabs[u] = _mm256_abs_epi8(wv[u]);
      }
    }
    const __m256 wscale = block_scales8<block>(ws + c / block);
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r;
      __m256i dot[4];
      for (int u = 0; u < 4; ++u) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(q.codes + row * k + c + 32 * u));
        if constexpr (kStored)
          dot[u] = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[u], xv), ones);
        else  // x * sign(w); w = 0 gives 0 either way
          dot[u] = _mm256_madd_epi16(
              _mm256_maddubs_epi16(wabs[u], _mm256_sign_epi8(xv, wv[u])), ones);
      }
      __m256i sums = hadd_blocks8(dot);
      if constexpr (kStored)
        sums = _mm256_add_epi32(
            sums, _mm256_srai_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                        q.span_offset + (row * k + c) / 16)),
                                    PackedBits<Bits>::kOffsetShift));
      const __m256 xscale = block_scales8<block>(q.block_scale + (row * k + c) / block);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(xscale, wscale), acc[r]);
    }
  }
  for (; c < k; c += 32) {
    if (c % 64 == 0) prefetch(c);
    const __m256i wv = codes32_avx2<Bits>(w, c);
    const __m256i wabs = _mm256_abs_epi8(wv);
    const __m256 wscale = block == 32
        ? _mm256_set1_ps(scale_value(ws + c / 32))
        : _mm256_setr_m128(_mm_set1_ps(scale_value(ws + c / 16)),
                           _mm_set1_ps(scale_value(ws + c / 16 + 1)));
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r;
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.codes + row * k + c));
      const __m256i xs = _mm256_sign_epi8(xv, wv);  // x * sign(w); w = 0 gives 0 either way
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), ones);
      const __m256 xscale = _mm256_loadu_ps(q.lane_scale + (row * k + c) / 4);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(xscale, wscale), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum8(reinterpret_cast<v8f>(acc[r]));  // simd.h
}
#else
constexpr const char* kInt8Isa = "scalar";
constexpr bool kInt8FarPrefetch = false;
constexpr bool kPackedInPlace = false;

template <int R, int64_t block, typename S, int Bits>
void dot_rows(const int8_t* w, const S* ws, const QuantizedRows& q, int64_t row0, int64_t k,
              float* out, int64_t out_stride, int64_t) {
  for (int r = 0; r < R; ++r) {
    const int8_t* x = q.codes + (row0 + r) * k;
    float acc = 0.f;
    for (int64_t b = 0; b < k / block; ++b) {
      int32_t dot = 0;
      for (int64_t j = b * block; j < (b + 1) * block; ++j) dot += int32_t(w[j]) * int32_t(x[j]);
      acc += float(dot) * q.lane_scale[((row0 + r) * k + b * block) / 4] * scale_value(ws + b);
    }
    out[r * out_stride] = acc;
  }
}
#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// NC weight rows one at a time (dot_rows above), with the far prefetch where Far (as the VNNI
// tile's: whole tiles ahead, none where it would pass the weight's end).
template <int R, int NC, int64_t block, typename S, bool Far, int Bits>
void dot_tile(const int8_t* w, const S* ws, const QuantizedRows& q, int64_t row0, int64_t k,
              float* out, int64_t out_stride, const int8_t* w_end) {
  static_assert(Bits == 8 || kPackedInPlace, "packed codes are unpacked first in this build");
  const int64_t row_bytes = Bits == 8 ? k : PackedBits<Bits>::row_bytes(k);
  int64_t far = 0;
  if constexpr (Far) {
    far = quant_rows::whole_tiles_ahead(quant_rows::kFarPrefetchBytes, row_bytes, kFarTileRows);
    if (w + NC * row_bytes + far > w_end) far = 0;
  }
  for (int j = 0; j < NC; ++j)
    dot_rows<R, block, S, Bits>(w + j * row_bytes, ws + j * (k / block), q, row0, k, out + j,
                                out_stride, far);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define PAGEDKV_INT8_PANEL 1
// The product from a few activation rows on (kInt8PanelMinRows), a panel of 16 weight rows
// (output columns) at a time: the panel's codes are laid out once per call, 4 codes (a dword)
// of 8 weight rows a 256-bit half (an 8 x 8 dword transpose per 32 codes, offset by 128 as
// above), the two halves one 512-bit vector of the 16 rows, its block scales as float32 16
// weight rows a vector; then each activation row's 4 codes at a time, broadcast, meet the 16
// weight rows' in one vpdpbusd, a whole block's dot summed in each int32 lane (from -128 times
// the activation block's code sum) before one convert and one multiply-add by the two scales,
// 8 activation rows at a time. Per activation row and 16 weight rows a block costs 8 vpdpbusd
// (4 at 16-code blocks) and 3 float operations, where the decode tile above spends 4 beside
// each vpdpbusd (its lanes run along K: each 64-code chunk spans two blocks' scales); the
// layout's cost (about the products' own at 4 rows) is shared by all the rows. From 4 rows: at
// 2-3 it measured no faster than the decode tile (AMD Zen 4; at 3, on the head's weights from
// memory, 0.85-0.95x its speed). 512-bit vectors and 8-row tiles against 256-bit ones and
// 4-row tiles: on AMD Zen 5 over the 1B-shaped layer's linears, one thread, Q8_0 1.25x at 16
// rows and 1.48x at 256, Q6_K 1.37x and 1.52x (bench_quant_linear.py --paths q8gemv,q6k6).
constexpr int64_t kInt8PanelMinRows = 4;
constexpr int kPanelCols = 16;    // weight rows a panel: one 512-bit vector of int32 lanes
constexpr int kPanelRowTile = 8;  // activation rows computed together
// How far ahead of the panel being laid out its codes are asked for into L2 (rounded to whole
// panels, at least the next): 8 KiB measured a little ahead of 32 and 64 on SmolLM2's head at
// 4-16 rows (AMD Zen 4, weights from memory), within the noise of a shared machine.
constexpr int64_t kPanelPrefetchBytes = 8 << 10;
// Codes along K laid out at a time: 256 (8 KiB of layout for 16 weight rows).
constexpr int64_t kPanelChunk = 256;

// Up to 8 block scales from p (count of them) as float32, the rest zero.
inline __m256 panel_scales(const float* p, __mmask8 m) { return _mm256_maskz_loadu_ps(m, p); }
inline __m256 panel_scales(const c10::Half* p, __mmask8 m) {
  return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(m, p));
}

// Lays out codes [c0, c0 + len) of weight rows w [nc, K] (nc <= 16; scales ws [nc, K / B])
// into pw (len / 4 x 2 vectors: dword d of rows 0-7, of rows 8-15; codes offset by 128) and ps
// (len / B x 16 floats), rows past nc as zero codes and scales. `next`: the same codes of a
// panel further on (nullptr past the weight's end; next_rows of its rows), asked for into L2
// meanwhile. Writes pw and ps.
// Codes [at, at + 32) of a packed row (PackedBits; at a multiple of 32), as int8 (signed).
// Codes 32 .. 63 (`upper`) or 0 .. 31 of a chunk from its 16 pair bytes at p (as
// pair_codes_avx2), as bytes 0..3.
inline __m256i panel_pair_codes(const uint8_t* p, bool upper) {
  const __m256i pairs =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i shift = upper ? _mm256_setr_epi32(0x40004, 0x40004, 0x40004, 0x40004,
                                                  0x60006, 0x60006, 0x60006, 0x60006)
                              : _mm256_setr_epi32(0, 0, 0, 0, 0x20002, 0x20002, 0x20002,
                                                  0x20002);
  return _mm256_and_si256(_mm256_srlv_epi16(pairs, shift), _mm256_set1_epi8(3));
}

template <int Bits>
inline __m256i packed_half(const uint8_t* row, int64_t at) {
  const uint8_t* p = row + at / 64 * PackedBits<Bits>::kChunkBytes;
  const bool upper = at % 64 != 0;  // codes 32..63 of the chunk: the high nibbles
  if constexpr (Bits == 3) {  // the low pairs (as Q6_K's high ones), the third bits
    uint32_t bits;
    std::memcpy(&bits, p + 16 + (upper ? 4 : 0), sizeof(bits));
    const __m256i codes = _mm256_or_si256(panel_pair_codes(p, upper),
                                          _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(4)));
    return _mm256_sub_epi8(codes, _mm256_set1_epi8(PackedBits<Bits>::kBias));
  }
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nibbles = _mm256_and_si256(upper ? _mm256_srli_epi16(low, 4) : low,
                                           _mm256_set1_epi8(15));
  if constexpr (Bits == 4)
    return _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values))),
        nibbles);
  __m256i high;
  if constexpr (Bits == 5) {
    uint32_t bits;
    std::memcpy(&bits, p + 32 + (upper ? 4 : 0), sizeof(bits));
    high = _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(16));
  } else {
    high = _mm256_slli_epi16(panel_pair_codes(p + 32, upper), 4);
  }
  return _mm256_sub_epi8(_mm256_or_si256(nibbles, high),
                         _mm256_set1_epi8(PackedBits<Bits>::kBias));
}

// Bits below 8: w holds the rows as packed codes (PackedBits, unpacked 32 codes at a time
// here), `next` too.
template <int64_t B, bool Full, int Bits, typename S>
void lay_out_panel(const int8_t* w, const S* ws, int64_t nc, int64_t k, int64_t c0, int64_t len,
                   __m256i* pw, float* ps, const int8_t* next, int64_t next_rows) {
  if constexpr (Full) nc = kPanelCols;  // (a constant: no test per row)
  const int64_t kb = k / B;
  constexpr bool kPacked = Bits != 8;
  const int64_t row_bytes = kPacked ? PackedBits<Bits>::row_bytes(k) : k;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t c = 0; c < len; c += 32) {
    if (next != nullptr && c % 64 == 0)
      for (int64_t j = 0; j < next_rows; ++j)
        prefetch_l2(next + j * row_bytes +
                    (kPacked ? (c0 + c) / 64 * PackedBits<Bits>::kChunkBytes : c0 + c));
    for (int g = 0; g < 2; ++g) {
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t row = 8 * g + i;
        if (row >= nc)
          r[i] = _mm256_setzero_si256();
        else if constexpr (kPacked)
          r[i] = packed_half<Bits>(reinterpret_cast<const uint8_t*>(w + row * row_bytes), c0 + c);
        else
          r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + row * k + c0 + c));
      }
      quant_rows::transpose8x8(r);
      for (int q = 0; q < 8; ++q)
        _mm256_storeu_si256(pw + (c / 4 + q) * 2 + g, _mm256_xor_si256(r[q], bias));
    }
  }
  const int64_t blocks = len / B;
  for (int64_t b = 0; b < blocks; b += 8) {
    const __mmask8 m = static_cast<__mmask8>((1u << std::min<int64_t>(8, blocks - b)) - 1);
    for (int g = 0; g < 2; ++g) {
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t row = 8 * g + i;
        r[i] = row < nc ? _mm256_castps_si256(panel_scales(ws + row * kb + c0 / B + b, m))
                        : _mm256_setzero_si256();
      }
      quant_rows::transpose8x8(r);
      for (int q = 0; q < 8 && b + q < blocks; ++q)
        _mm256_storeu_ps(ps + (b + q) * kPanelCols + 8 * g, _mm256_castsi256_ps(r[q]));
    }
  }
}

// A call's quantized activation rows in the order the panel tiles read them: for each tile of
// kPanelRowTile rows and each block of B codes, the rows' codes one after another (then their
// block scales, and -128 times their code sums), so a tile reads one run of memory from one
// pointer. Rows past the call's last are zeros.
struct TileRows {
  const int8_t* codes = nullptr;     // [tiles][K / B][kPanelRowTile][B]
  const float* scale = nullptr;      // [tiles][K / B][kPanelRowTile]
  const int32_t* offset = nullptr;   // [tiles][K / B][kPanelRowTile]
  int64_t blocks = 0;                // K / B
};

// The m rows of `q` (K codes each, blocks of B) as TileRows, into this thread's scratch (valid
// until its next call; read by the panel threads meanwhile).
template <int64_t B>
TileRows tile_rows(const QuantizedRows& q, int64_t m, int64_t k) {
  constexpr int64_t T = kPanelRowTile;
  const int64_t kb = k / B, tiles = (m + T - 1) / T;
  int8_t* codes = quant_rows::scratch<int8_t, 8>(tiles * kb * T * B);
  float* scale = quant_rows::scratch<float, 18>(tiles * kb * T);
  int32_t* offset = quant_rows::scratch<int32_t, 4>(tiles * kb * T);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < kb; ++b)
      for (int64_t r = 0; r < T; ++r) {
        const int64_t row = t * T + r, at = (t * kb + b) * T + r;
        if (row >= m) {
          std::memset(codes + at * B, 0, B);
          scale[at] = 0.f;
          offset[at] = 0;
          continue;
        }
        std::memcpy(codes + at * B, q.codes + row * k + b * B, B);
        scale[at] = q.block_scale[row * kb + b];
        int32_t sum = 0;
        for (int64_t l = 0; l < B / 4; ++l) sum += q.lane_offset[(row * kb + b) * (B / 4) + l];
        offset[at] = sum;
      }
  return {codes, scale, offset, kb};
}

// Tile `tile`'s first R activation rows, codes [c0, c0 + len), against a laid-out panel (pw,
// ps): y [r * 16 + j] (plus its value unless `first`) += row r's product with the panel's
// weight row j. Writes y.
template <int R, int64_t B>
inline void panel_tile(const __m256i* pw, const float* ps, const TileRows& a, int64_t tile,
                       int64_t c0, int64_t len, float* y, bool first) {
  constexpr int64_t D = B / 4;  // dwords a block
  __m512 acc[R];
  for (int r = 0; r < R; ++r)
    acc[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * kPanelCols);
  for (int64_t b = 0; b < len / B; ++b) {
    const int64_t at = (tile * a.blocks + c0 / B + b) * kPanelRowTile;  // row 0's, this block
    const int8_t* x = a.codes + at * B;  // row r's codes at x + B r
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_set1_epi32(a.offset[at + r]);
    const __m256i* wb = pw + b * D * 2;
    for (int64_t d = 0; d < D; ++d) {
      const __m512i w = _mm512_loadu_si512(wb + 2 * d);
      for (int r = 0; r < R; ++r) {
        int32_t xd;
        std::memcpy(&xd, x + B * r + 4 * d, sizeof(xd));
        dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(xd));
      }
    }
    const __m512 s = _mm512_loadu_ps(ps + b * kPanelCols);
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(a.scale[at + r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(s, xs), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * kPanelCols, acc[r]);
}

// out [m, n] (T) = x's quantized rows `q` times the weight, a panel of 16 weight rows at a time
// (panels over threads, on the calling thread below quant_rows::kInlineBytes of weights), each
// kPanelChunk codes along K laid out and met by all the rows before the next (the layout stays
// in L1 at any K).
template <int64_t B, typename T, typename CodeSrc, typename Src>
void panel_columns(const QuantizedRows& q, int64_t m, const CodeSrc& codes, const Src& src,
                   int64_t n, int64_t k, T* out) {
  const TileRows tiled = tile_rows<B>(q, m, k);
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols;
  const int64_t passes = (m + kPanelRowTile - 1) / kPanelRowTile;
  // The panel whose codes are asked for while this one is laid out: about kPanelPrefetchBytes
  // ahead.
  const int64_t ahead = std::max<int64_t>(1, kPanelPrefetchBytes / (kPanelCols * k));
  quant_rows::run_blocks(panels, n * k * passes, [&](int64_t p_begin, int64_t p_end) {
    const int64_t chunk = std::min(k, kPanelChunk);
    __m256i* pw = reinterpret_cast<__m256i*>(
        quant_rows::scratch<int8_t, 5>(chunk / 4 * 2 * sizeof(__m256i)));
    float* ps = quant_rows::scratch<float, 10>(chunk / B * kPanelCols);
    float* y = quant_rows::scratch<float, 11>(m * kPanelCols);
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t col = p * kPanelCols;
      const int64_t nc = std::min<int64_t>(kPanelCols, n - col);
      const int64_t next_col = col + ahead * kPanelCols;
      const auto* tile_scales = src.rows(col, nc);
      const int64_t next_rows = std::min<int64_t>(kPanelCols, n - next_col);
      // The next panel's codes, asked for while this one is laid out.
      const int8_t* next = next_col < n ? codes.bytes(next_col) : nullptr;
      for (int64_t c0 = 0; c0 < k; c0 += chunk) {
        const int64_t len = std::min(chunk, k - c0);
        if (nc == kPanelCols) {
          lay_out_panel<B, true, CodeSrc::kBits>(codes.bytes(col), tile_scales, nc, k, c0, len, pw,
                                              ps, next, next_rows);
        } else {
          lay_out_panel<B, false, CodeSrc::kBits>(codes.bytes(col), tile_scales, nc, k, c0, len,
                                               pw, ps, next, next_rows);
        }
        quant_rows::for_row_tiles<kPanelRowTile>(m, [&](int64_t r, auto tile) {
          panel_tile<decltype(tile)::value, B>(pw, ps, tiled, r / kPanelRowTile, c0, len,
                                               y + r * kPanelCols, c0 == 0);
        });
      }
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < nc; ++j)
          out[r * n + col + j] = static_cast<T>(y[r * kPanelCols + j]);
    }
  });
}
#endif

constexpr int kRowTile = 4;
constexpr int kColTile = 4;  // weight rows computed together
static_assert(kColTile == kFarTileRows, "the far prefetch's tile is dot_columns' tile");

// The bits of a weight's codes: 8 (int8), or packed (uint8): with two-level scales (K/16 + K/128
// bytes a row) 6 (Q6_K) or 3 (Q3_K: 3K/8 bytes a row); with a float16 or float32 table
// (blocks of 32), 5 (Q5_0: 20 bytes a block) or 4 (IQ4: 16).
int code_bits(const at::Tensor& codes, const at::Tensor& scales) {
  if (codes.scalar_type() != at::kByte) return 8;
  if (scales.scalar_type() == at::kByte)
    return codes.size(1) == PackedBits<3>::row_bytes(scales.size(1) / 9 * 128) ? 3 : 6;
  return scales.size(1) > 0 && codes.size(1) == 16 * scales.size(1) ? 4 : 5;
}

// K of a weight's codes: int8 [N, K], or packed (uint8 [N, K / 64 * chunk bytes]: PackedBits).
int64_t weight_k(const at::Tensor& codes, const at::Tensor& scales) {
  switch (code_bits(codes, scales)) {
    case 6: return codes.size(1) / PackedBits<6>::kChunkBytes * 64;
    case 3: return codes.size(1) / PackedBits<3>::kChunkBytes * 64;
    case 5: return codes.size(1) / PackedBits<5>::kChunkBytes * 64;
    case 4: return codes.size(1) * 2;
    default: return codes.size(1);
  }
}

void check_weight(const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                  const char* op) {
  TORCH_CHECK(block == 16 || block == 32, op, ": block must be 16 or 32, got ", block);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() &&
                  (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte), op,
              ": codes must be a contiguous int8 [N, K] or packed uint8 [N, K / 64 * 8 bits]");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == codes.size(0), op,
              ": scales must be contiguous [N, ...]");
  const int bits = code_bits(codes, scales);
  const int64_t k = weight_k(codes, scales);
  TORCH_CHECK(k % 32 == 0, op, ": K must be a multiple of 32, got ", k);
  TORCH_CHECK(bits == 8 || codes.size(1) % (8 * bits) == 0, op,
              ": packed codes must be whole chunks of 64");
  if (scales.scalar_type() == at::kByte) {  // Q6_K's two levels (TwoLevelScales)
    TORCH_CHECK(block == 16 && k % 256 == 0 && scales.size(1) == k / 16 + k / 128, op,
                ": two-level scales (uint8) need blocks of 16, K a multiple of 256 and ",
                "K / 16 + K / 128 bytes a row");
    return;
  }
  TORCH_CHECK(bits == 8 || block == 32, op, ": 4- and 5-bit codes take blocks of 32");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                  scales.size(1) == k / block,
              op, ": scales must be float32 or float16 [N, K / block] or uint8 two levels");
}

// A tile's products y [r, j] (stride NC) into out [M, N] of T.
template <typename T>
inline void store_tile(const float* y, int rows, int nc, T* out, int64_t n, int64_t row0,
                       int64_t col) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < nc; ++j) out[(row0 + r) * n + col + j] = static_cast<T>(y[r * nc + j]);
}

// out [M, N] (T) = x's quantized rows `q` times the weight (block scales from `src`, 16 weight
// rows at a time), columns over threads (on the calling thread below quant_rows::kInlineBytes
// of weights).
// out [M, N] (T) = x's quantized rows `q` times the weight (codes from `codes`, block scales
// from `src`, 16 weight rows at a time), columns over threads (on the calling thread below
// quant_rows::kInlineBytes of weights).
template <int64_t B, bool Far, typename T, typename CodeSrc, typename Src>
void dot_columns(const QuantizedRows& q, int64_t m, const CodeSrc& codes, const Src& src,
                 int64_t n, int64_t k, T* out) {
  using S = typename Src::type;
  // Read in place (packed codes too where kPackedInPlace), or unpacked a tile at a time.
  constexpr bool kUnpacked = CodeSrc::kBits != 8 && !kPackedInPlace;
  constexpr int kBits = kUnpacked ? 8 : CodeSrc::kBits;
  const int64_t row_bytes = kUnpacked ? k : codes.row_bytes();
  const int64_t passes = (m + kRowTile - 1) / kRowTile;
  const int64_t tasks = (n + 15) / 16;
  const int8_t* w_end = codes.bytes(n);
  quant_rows::run_blocks(tasks, n * k * passes, [&](int64_t t_begin, int64_t t_end) {
    const int64_t end = std::min(n, t_end * 16);
    float y[kRowTile * kColTile];
    const S* tile_scales = nullptr;       // weight rows col & ~15 .. + 15's
    const int8_t* tile_codes = nullptr;   // their codes, where unpacked
    for (int64_t col = t_begin * 16; col < end;) {
      if (col % 16 == 0) {
        const int64_t rows = std::min<int64_t>(16, end - col);
        // The next tile's scales, whole: the codes' far prefetch asks for one line of a row's
        // scales, and at K = 8,192 a row has 9 (Q6_K's two levels) to 32 (a float32 table):
        // 2048 x 8192 read 1.2x slower per byte than 8192 x 2048 without this (Zen 4). Without
        // the far prefetch too: the near one reads a two-level table's materialized copy.
        if (col + 16 < end) src.prefetch(col + 16, 16, end);
        tile_scales = src.rows(col, rows);
        if constexpr (kUnpacked) tile_codes = codes.rows(col, rows);
      }
      const int8_t* wrow = kUnpacked ? tile_codes + (col % 16) * k : codes.bytes(col);
      const S* srow = tile_scales + (col % 16) * (k / B);
      if (col + kColTile <= end) {
        if constexpr (!Far)
          for (int j = 0; j < kColTile; ++j)
            prefetch_ahead(wrow + j * row_bytes, srow + j * (k / B), row_bytes, k / B);
        int64_t r = 0;
        for (; r + kRowTile <= m; r += kRowTile) {
          dot_tile<kRowTile, kColTile, B, S, Far, kBits>(wrow, srow, q, r, k, y, kColTile, w_end);
          store_tile(y, kRowTile, kColTile, out, n, r, col);
        }
        for (; r < m; ++r) {
          dot_tile<1, kColTile, B, S, Far, kBits>(wrow, srow, q, r, k, y, kColTile, w_end);
          store_tile(y, 1, kColTile, out, n, r, col);
        }
        col += kColTile;
        continue;
      }
      if constexpr (!Far) prefetch_ahead(wrow, srow, row_bytes, k / B);
      int64_t r = 0;
      for (; r + kRowTile <= m; r += kRowTile) {
        dot_tile<kRowTile, 1, B, S, Far, kBits>(wrow, srow, q, r, k, y, 1, w_end);
        store_tile(y, kRowTile, 1, out, n, r, col);
      }
      for (; r < m; ++r) {
        dot_tile<1, 1, B, S, Far, kBits>(wrow, srow, q, r, k, y, 1, w_end);
        store_tile(y, 1, 1, out, n, r, col);
      }
      ++col;
    }
  });
}

#if defined(PAGEDKV_QUANT_AMX)
#define PAGEDKV_INT8_AMX 1
// The product at 10-64 activation rows on AMX-INT8 tiles (as quant_int4_amx.h: the same int8
// activations per block, each (weight row, activation row, block) dot exact in int32, scaled
// by the two scales in float32): per block of 16 weight rows, per tile of 16 activation rows
// and block of scales, one tdpbssd of the weight codes (tile A, loaded straight from the
// codes, K apart) against the activations laid 4 codes a dword (tile B, built once per call).
constexpr int64_t kInt8AmxMinRows = 10;
constexpr int64_t kInt8AmxMaxRows = 64;

struct Int8AmxAct {
  const int8_t* b;  // [tile][block][B / 4][16 rows][4]
  const float* d;   // [tile][block][16 rows]: the activation steps
  int64_t tiles;
};

template <int64_t B>
Int8AmxAct int8_amx_activations(const QuantizedRows& q, int64_t m, int64_t k) {
  const int64_t tiles = (m + 15) / 16, blocks = k / B;
  int8_t* b = quant_rows::scratch<int8_t, 4>(tiles * blocks * B * 16);
  float* d = quant_rows::scratch<float, 8>(tiles * blocks * 16);
  std::memset(b, 0, tiles * blocks * B * 16);
  std::memset(d, 0, tiles * blocks * 16 * sizeof(float));
  for (int64_t r = 0; r < m; ++r) {
    const int64_t t = r / 16, i = r % 16;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int8_t* src = q.codes + r * k + blk * B;
      int8_t* tile = b + (t * blocks + blk) * B * 16;
      for (int64_t c = 0; c < B / 4; ++c) std::memcpy(tile + c * 64 + i * 4, src + 4 * c, 4);
      d[(t * blocks + blk) * 16 + i] = q.lane_scale[(r * k + blk * B) / 4];
    }
  }
  return Int8AmxAct{b, d, tiles};
}

// acc[i] (lanes: the tile's activation rows) += one block's int32 sums [16][16] times weight
// row i's scale (ws[i * stride]) times the activation steps d.
template <typename S>
inline void int8_amx_scale(const int32_t* sums, const S* ws, int64_t stride, const float* d,
                           __m512* acc) {
  const __m512 dv = _mm512_loadu_ps(d);
  for (int i = 0; i < 16; ++i)
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(sums + 16 * i)),
                             _mm512_mul_ps(dv, _mm512_set1_ps(scale_value(ws + i * stride))), acc[i]);
}

// out [m, n] (T) = the activations times the weight (codes w, block scales from src);
// n % 16 == 0.
template <int64_t B, typename T, typename CodeSrc, typename Src>
void int8_amx_product(const Int8AmxAct& act, int64_t m, const CodeSrc& codes, const Src& src,
                      int64_t n, int64_t k, T* out) {
  const int64_t blocks = k / B;
  quant_rows::run_blocks(n / 16, n * k * act.tiles, [&](int64_t b0, int64_t b1) {
    alignas(64) int32_t sums[2][256];
    alignas(64) float y[256];
    const quant_rows::IntTileConfig config(B);
    _tile_loadconfig(&config);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t n0 = nb * 16;
      const int8_t* wb = codes.rows(n0, 16);
      const auto* sb = src.rows(n0, 16);
      for (int64_t t = 0; t < act.tiles; ++t) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        const int8_t* bt = act.b + t * blocks * B * 16;
        const float* dt = act.d + t * blocks * 16;
        for (int64_t j = 0; j < blocks; j += 2) {
          const bool pair = j + 1 < blocks;
          _tile_zero(0);
          _tile_loadd(4, wb + j * B, k);
          _tile_loadd(6, bt + j * B * 16, 64);
          _tile_dpbssd(0, 4, 6);
          if (pair) {
            _tile_zero(1);
            _tile_loadd(5, wb + (j + 1) * B, k);
            _tile_loadd(7, bt + (j + 1) * B * 16, 64);
            _tile_dpbssd(1, 5, 7);
          }
          _tile_stored(0, sums[0], 64);
          if (pair) _tile_stored(1, sums[1], 64);
          int8_amx_scale(sums[0], sb + j, blocks, dt + j * 16, acc);
          if (pair) int8_amx_scale(sums[1], sb + j + 1, blocks, dt + (j + 1) * 16, acc);
        }
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(y + 16 * i, acc[i]);
        const int64_t rows = std::min<int64_t>(16, m - 16 * t);
        for (int64_t r = 0; r < rows; ++r)
          for (int i = 0; i < 16; ++i)
            out[(16 * t + r) * n + n0 + i] = static_cast<T>(y[16 * i + r]);
      }
    }
    _tile_release();
  });
}
#endif

// Rows up to which the packed linear runs int8_block_linear where it runs on AMX tiles (64) or
// the panel product (every call: kEveryRow); 0 without either (INT8_BLOCK_ROWS then). The panel
// product at 64 rows took 0.6-0.65x the one-thread CPU time of the weight expanded to bfloat16
// and oneDNN's matmul over SmolLM2-135M's shapes on AMD Zen 4, 0.8x at 512 and 2,048 rows
// (benchmarks/bench_quant_linear.py --paths q8gemv,q8expand); AVX2's product stays at
// INT8_BLOCK_ROWS.
int64_t int8_block_tile_rows() {
#if defined(PAGEDKV_INT8_AMX)
  if (amx_permitted()) return kInt8AmxMaxRows;
#endif
#if defined(PAGEDKV_INT8_PANEL)
  return quant_rows::kEveryRow;
#else
  return 0;
#endif
}

// out [m, n] (T) = x's rows, quantized per block of B, times the weight: on AMX tiles where
// they run (rows from kInt8AmxMinRows, n a multiple of 16), else the vector product.
template <int64_t B, typename T, typename CodeSrc, typename Src>
void block_product(const T* x, int64_t m, int64_t k, const CodeSrc& w, const Src& ws, int64_t n,
                   T* out) {
  const QuantizedRows q = quantize_rows<T, B>(x, m, k);
#if defined(PAGEDKV_INT8_AMX)
  if (m >= kInt8AmxMinRows && n % 16 == 0 && amx_permitted()) {
    int8_amx_product<B>(int8_amx_activations<B>(q, m, k), m, w, ws, n, k, out);
    return;
  }
#endif
#if defined(PAGEDKV_INT8_PANEL)
  if (m >= kInt8PanelMinRows) {
    quant_rows::for_row_blocks(m, k, [&](int64_t r0, int64_t rows) {
      const QuantizedRows block{q.codes + r0 * k, q.lane_offset + r0 * k / 4,
                                q.lane_scale + r0 * k / 4, q.block_scale + r0 * (k / B)};
      panel_columns<B>(block, rows, w, ws, n, k, out + r0 * n);
    });
    return;
  }
#endif
  if (kInt8FarPrefetch && far_l2_prefetch()) {
    dot_columns<B, true>(q, m, w, ws, n, k, out);
  } else {
    dot_columns<B, false>(q, m, w, ws, n, k, out);
  }
}

// fn(block, the codes' source, the scales' source) for a checked weight (check_weight): int8
// codes with a float16 or float32 table or Q6_K's two levels, or Q6_K's 6-bit codes (Q3_K's
// 3-bit ones) with its two levels; block a compile-time 16 or 32 (16 alone with two levels).
template <typename Fn>
inline void with_weight(const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                        const Fn& fn) {
  const int64_t k = weight_k(codes, scales);
  using B16 = std::integral_constant<int64_t, 16>;
  using B32 = std::integral_constant<int64_t, 32>;
  const int8_t* w = reinterpret_cast<const int8_t*>(codes.data_ptr());
  if (scales.scalar_type() == at::kByte) {
    const TwoLevelScales two{scales.data_ptr<uint8_t>(), k / 16};
    if (codes.scalar_type() != at::kByte)
      fn(B16{}, Codes<8>{w, k}, two);
    else if (code_bits(codes, scales) == 3)
      fn(B16{}, Codes<3>{w, k}, two);  // Q3_K's
    else
      fn(B16{}, Codes<6>{w, k}, two);
    return;
  }
  auto with_table = [&](const auto& src) {
    if (codes.scalar_type() == at::kByte && code_bits(codes, scales) == 4)
      fn(B32{}, Codes<4>{w, k}, src);  // IQ4's
    else if (codes.scalar_type() == at::kByte) fn(B32{}, Codes<5>{w, k}, src);  // Q5_0's
    else if (block == 32) fn(B32{}, Codes<8>{w, k}, src);
    else fn(B16{}, Codes<8>{w, k}, src);
  };
  if (scales.scalar_type() == at::kHalf)
    with_table(TableScales<c10::Half>{scales.data_ptr<c10::Half>(), scales.size(1)});
  else
    with_table(TableScales<float>{scales.data_ptr<float>(), scales.size(1)});
}

// x: [..., K] (float32, bfloat16 or float16); codes int8 [N, K]; scales float32 or float16
// [N, K / block];
// returns x W^T [..., N] in x's dtype, W = codes times their block's scale.
at::Tensor int8_block_linear(const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& scales, int64_t block) {
  check_weight(codes, scales, block, "int8_block_linear");
  const int64_t n = codes.size(0), k = weight_k(codes, scales);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "int8_block_linear: x must be [..., ", k, "]");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.numel() / k;
  at::Tensor out = at::empty(quant_rows::out_sizes(xc, n), xc.options());
  dispatch(xc.scalar_type(), "int8_block_linear", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = xc.data_ptr<T>();
    T* o = out.data_ptr<T>();
    with_weight(codes, scales, block, [&](auto b, const auto& w, const auto& ws) {
      block_product<decltype(b)::value>(xp, m, k, w, ws, n, o);
    });
  });
  return out;
}

// float32 to bfloat16 bits, round to nearest even (the values are finite), in a form the
// compiler vectorizes (c10::BFloat16's conversion, with its NaN branch, it does not).
inline uint16_t bf16_bits_nearest_even(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// One block's values, rounded once to T.
template <typename T, int64_t block>
inline void expand_block(const int8_t* c, float s, T* o) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // 16 codes a step, vcvtneps2bf16
    const __m512 scale = _mm512_set1_ps(s);
    for (int64_t j = 0; j < block; j += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j)))), scale);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint16_t* bits = reinterpret_cast<uint16_t*>(o);
    for (int64_t j = 0; j < block; ++j)
      bits[j] = bf16_bits_nearest_even(static_cast<float>(c[j]) * s);
  } else {
    for (int64_t j = 0; j < block; ++j) o[j] = static_cast<T>(static_cast<float>(c[j]) * s);
  }
}

template <typename T>
void expand_as(const at::Tensor& codes, const at::Tensor& scales, int64_t block, at::Tensor& out) {
  const int64_t n = codes.size(0), k = weight_k(codes, scales);
  T* dst = out.data_ptr<T>();
  with_weight(codes, scales, block, [&](auto b, const auto& w, const auto& src) {
    constexpr int64_t B = decltype(b)::value;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const auto* ws = src.rows(r, 1);
        const int8_t* c = w.rows(r, 1);
        for (int64_t j = 0; j < k / B; ++j)
          expand_block<T, B>(c + j * B, scale_value(ws + j), dst + r * k + j * B);
      }
    });
  });
}

// W [N, K] in `dtype` (float32, bfloat16 or float16): each code times its block's scale in
// float32, rounded once.
at::Tensor int8_block_expand(const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                             at::ScalarType dtype) {
  check_weight(codes, scales, block, "int8_block_expand");
  at::Tensor out = at::empty({codes.size(0), weight_k(codes, scales)}, codes.options().dtype(dtype));
  switch (dtype) {
    case at::kFloat: expand_as<float>(codes, scales, block, out); break;
    case at::kBFloat16: expand_as<c10::BFloat16>(codes, scales, block, out); break;
    case at::kHalf: expand_as<c10::Half>(codes, scales, block, out); break;
    default: TORCH_CHECK(false, "int8_block_expand: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

// The packed linear's forward: x [..., K] W^T (+ bias) [..., N] in x's dtype, by
// int8_block_linear up to `gemv_rows` rows (Int8BlockLinear's product_rows:
// int8_block_tile_rows() where tiles run), else on the weight expanded (int8_block_expand, a
// chunk of rows at a time) by the dense matmul.
at::Tensor int8_block_forward(const at::Tensor& x, const at::Tensor& codes,
                              const at::Tensor& scales, int64_t block,
                              const c10::optional<at::Tensor>& bias, int64_t gemv_rows) {
  const int64_t n = codes.size(0), k = weight_k(codes, scales);
  if (x.numel() <= gemv_rows * k) {
    at::Tensor y = int8_block_linear(x, codes, scales, block);
    if (bias.has_value() && bias->defined()) y.add_(*bias);
    return y;
  }
  check_weight(codes, scales, block, "int8_block_forward");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "int8_block_forward: x must be [..., ", k, "]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor y = quant_rows::expanded_linear(xc.view({-1, k}), n, bias,
                                                   [&](int64_t start, int64_t stop) {
    return int8_block_expand(codes.slice(0, start, stop), scales.slice(0, start, stop), block,
                             xc.scalar_type());
  });
  return y.view(quant_rows::out_sizes(xc, n));
}

std::string int8_block_isa() { return kInt8Isa; }

}  // namespace
}  // namespace pagedkv_cpu

TORCH_LIBRARY_FRAGMENT(pagedkv_cpu, m) {
  m.def("int8_block_linear(Tensor x, Tensor codes, Tensor scales, int block) -> Tensor",
        &pagedkv_cpu::int8_block_linear);
  m.def("int8_block_expand(Tensor codes, Tensor scales, int block, ScalarType dtype) -> Tensor",
        &pagedkv_cpu::int8_block_expand);
  m.def("int8_block_forward(Tensor x, Tensor codes, Tensor scales, int block, Tensor? bias, "
        "int gemv_rows) -> Tensor", &pagedkv_cpu::int8_block_forward);
  m.def("int8_block_tile_rows() -> int", &pagedkv_cpu::int8_block_tile_rows);
  m.def("int8_block_isa() -> str", &pagedkv_cpu::int8_block_isa);
}
