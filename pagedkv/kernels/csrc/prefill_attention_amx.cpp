// Causal attention of fresh prompts (no cached prefix) on Intel AMX tiles, bfloat16: both
// products (Q K^T and P V) as tile dot products (tdpbf16ps, float32 accumulators), the softmax
// in float32 with AVX-512 between them. Builds without AMX (or a kernel that cannot get the
// tile state from the OS) say so through amx_prefill_supported and keep the other paths.
//
// A work item is 16 query tokens of one query head of one chunk: its scores against every key
// it sees (S = Q K^T, 16 x up to the chunk's length, float32 in a per-thread buffer), the exact
// softmax of each row over its causal keys (P rounded to bfloat16 as flash attention rounds
// it), then O = P V over 64 head dims at a time in four accumulator tiles, divided by the row
// sums and rounded once. The chunk's K and V are first re-laid per KV head in the layouts the
// tiles read (K transposed in pairs of dims, V in pairs of keys: "VNNI"), shared by the query
// heads of the KV head. Items run longest first off a shared counter (causal rows cost in
// proportion to their position), each thread configuring its tiles once.
#include <atomic>

#include "common.h"
#include "ops.h"
#include "simd.h"
#include "vec_rows.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define PAGEDKV_AMX 1
#include "amx.h"
#endif

namespace pagedkv_cpu {
namespace {

#ifdef PAGEDKV_AMX
constexpr int64_t AMX_ROWS = 16;   // query tokens per item (a tile's rows)
constexpr int64_t AMX_KEYS = 64;   // keys per score step (four 16-key tiles)

// Palette 1, eight tiles of 16 rows x 64 bytes: 0-3 accumulators, 4 A, 6 B.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; t++) { colsb[t] = 64; rows[t] = 16; }
  }
};

// One chunk's K and V for every KV head, re-laid for the tiles:
// K: [kv_heads][keys / 16][D / 32][16 dim pairs][16 keys] dim pairs as uint32 (B of Q K^T);
// V: [kv_heads][keys / 32][D / 16][16 key pairs][16 dims][2] (B of P V); keys padded with zeros.
struct Packed {
  std::vector<uint32_t> k;
  std::vector<uint32_t> v;
  int64_t keys_k = 0, keys_v = 0;  // padded key counts (multiples of 64 and 32)
};

// K and V of `len` keys of every KV head, key t of head h at k_row(h, t) / v_row(h, t), the 16
// keys of each aligned group of 16 `group_stride` elements apart in K (the gather's stride).
template <typename KRow, typename VRow>
void pack_keys(KRow k_row, VRow v_row, int64_t group_stride, int64_t len, int64_t kv_heads,
               int64_t d, Packed& p);

void pack_chunk(const c10::BFloat16* kp, const c10::BFloat16* vp, int64_t sk, int64_t sv,
                int64_t len, int64_t kv_heads, int64_t d, Packed& p) {
  pack_keys([&](int64_t h, int64_t t) { return kp + t * sk + h * d; },
            [&](int64_t h, int64_t t) { return vp + t * sv + h * d; }, sk, len, kv_heads, d, p);
}

// r[i][j] := r[j][i] for sixteen rows of sixteen 32-bit lanes: pairs of rows interleaved by 32
// then 64 bits (each 128-bit lane then holds four rows of one column), then the 128-bit lanes
// transposed as a 4 x 4 matrix.
inline void transpose16x16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; i++) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // b[4m + e], 128-bit lane L: column 4L + e of rows 4m .. 4m + 3.
  for (int m = 0; m < 4; m++) {
    b[4 * m] = _mm512_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
    b[4 * m + 1] = _mm512_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
    b[4 * m + 2] = _mm512_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
    b[4 * m + 3] = _mm512_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
  }
  for (int e = 0; e < 4; e++) {  // column 4L + e: lane L of b[e], b[4 + e], b[8 + e], b[12 + e]
    const __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44);
    const __m512i c1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
}

template <typename KRow, typename VRow>
void pack_keys(KRow k_row, VRow v_row, int64_t group_stride, int64_t len, int64_t kv_heads,
               int64_t d, Packed& p) {
  p.keys_k = (len + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
  p.keys_v = (len + 31) / 32 * 32;
  const int64_t dp = d / 2, dsteps = d / 32;  // dim pairs per key; 32-dim steps
  p.k.resize(kv_heads * p.keys_k * dp);
  p.v.resize(kv_heads * p.keys_v * dp);
  // K: each 16-key x 16-dim-pair block transposed in registers (keys past the chunk read as
  // zeros).
  const int64_t row_stride = group_stride / 2;  // uint32 units
  for (int64_t h = 0; h < kv_heads; h++) {
    uint32_t* kh = p.k.data() + h * p.keys_k * dp;
    for (int64_t kb = 0; kb < p.keys_k / 16; kb++) {
      const int64_t left = std::min<int64_t>(16, std::max<int64_t>(0, len - kb * 16));
      const uint32_t* base = left ? reinterpret_cast<const uint32_t*>(k_row(h, kb * 16))
                                  : nullptr;
      for (int64_t s = 0; s < dsteps; s++) {
        __m512i r[16];
        for (int64_t t = 0; t < 16; t++)
          r[t] = t < left ? _mm512_loadu_si512(base + t * row_stride + s * 16)
                          : _mm512_setzero_si512();
        transpose16x16(r);
        uint32_t* dst = kh + (kb * dsteps + s) * 256;
        for (int64_t j = 0; j < 16; j++) _mm512_storeu_si512(dst + j * 16, r[j]);
      }
    }
  }
  // V: each pair of keys' rows interleaved 16 dims at a time (a tile row of B for P V).
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  for (int64_t h = 0; h < kv_heads; h++) {
    uint32_t* vh = p.v.data() + h * p.keys_v * dp;
    for (int64_t t = 0; t < p.keys_v; t += 2) {
      const int64_t vb = t / 32, vr = (t % 32) / 2;
      for (int64_t j = 0; j < d; j += 16) {  // block (vb, j / 16), row vr
        const __m256i a = t < len ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                        v_row(h, t) + j)) : _mm256_setzero_si256();
        const __m256i b = t + 1 < len ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                            v_row(h, t + 1) + j))
                                      : _mm256_setzero_si256();
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_storeu_si512(vh + vb * 16 * d + ((j / 16) * 16 + vr) * 16,
                            _mm512_permutexvar_epi16(pairs, ab));
      }
    }
  }
}

// Per-thread buffers of one item: scores, probabilities, the Q tile, the output tile.
struct Scratch {
  std::vector<float> s;
  std::vector<c10::BFloat16> p;
  std::vector<float> o;
  std::vector<c10::BFloat16> q;
  Scratch(int64_t keys, int64_t d) : s(AMX_ROWS * keys), p(AMX_ROWS * keys), o(AMX_ROWS * 64),
                                     q(AMX_ROWS * d) {}
  Scratch() = default;
};

// This thread's Scratch for rows of `keys` keys and head size d: kept between calls and grown
// when too small (no allocation, zeroing or page faults per call).
Scratch& thread_scratch(int64_t keys, int64_t d) {
  static thread_local Scratch w;
  if (static_cast<int64_t>(w.s.size()) < AMX_ROWS * keys) {
    w.s.resize(AMX_ROWS * keys);
    w.p.resize(AMX_ROWS * keys);
  }
  if (static_cast<int64_t>(w.q.size()) < AMX_ROWS * d) w.q.resize(AMX_ROWS * d);
  if (w.o.empty()) w.o.resize(AMX_ROWS * 64);
  return w;
}

// S[16][n] = Q K^T for the first n keys (n a multiple of 64; Q in scratch.q, [16][d]). The
// four B tiles of a step rotate over three registers (5, 6, 7), so that a tile's load need not
// wait for the product before it to have read its register.
void scores(Scratch& w, const uint32_t* kh, int64_t n, int64_t ks, int64_t d) {
  const int64_t dsteps = d / 32;
  for (int64_t k0 = 0; k0 < n; k0 += AMX_KEYS) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < dsteps; s++) {
      _tile_loadd(4, w.q.data() + s * 32, d * 2);
      const uint32_t* b = kh + ((k0 / 16) * dsteps + s) * 256;
      _tile_loadd(5, b, 64);
      _tile_loadd(6, b + dsteps * 256, 64);
      _tile_loadd(7, b + 2 * dsteps * 256, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 3 * dsteps * 256, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* out = w.s.data() + k0;
    _tile_stored(0, out, ks * 4);
    _tile_stored(1, out + 16, ks * 4);
    _tile_stored(2, out + 32, ks * 4);
    _tile_stored(3, out + 48, ks * 4);
  }
}

// 16 floats to bfloat16, round to nearest even.
inline void store_bf16x16(c10::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  store_q(p, (vqf)v);
#endif
}

// Row r of S (its first `len` keys visible): P = bf16(exp(scale * (S - max))) over them,
// zeros up to `width`; returns the sum of the unrounded exponentials.
// `row_max`, where given, receives the row's largest score (unscaled).
float softmax_row(const float* s, c10::BFloat16* p, int64_t len, int64_t width, float scale,
                  float* row_max = nullptr) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
  float m = _mm512_reduce_max_ps(mv);
  for (; j < len; j++) m = std::max(m, s[j]);
  if (row_max) *row_max = m;
  const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m * scale);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= len; j += 16) {
    const __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vs, vm));
    sum = _mm512_add_ps(sum, e);
    store_bf16x16(p + j, e);
  }
  if (j < len) {  // the tail, masked: exp of the visible keys, zeros after them
    const __mmask16 keep = static_cast<__mmask16>((1u << (len - j)) - 1u);
    const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(keep, s + j), vs, vm);
    const __m512 e = _mm512_maskz_mov_ps(keep, exp16(x));
    sum = _mm512_add_ps(sum, e);
    store_bf16x16(p + j, e);
    j += 16;
  }
  for (; j < width; j += 16) store_bf16x16(p + j, _mm512_setzero_ps());
  return _mm512_reduce_add_ps(sum);
}

// O[16][64 dims from d0] = P V over the first n keys (n a multiple of 32), into scratch.o (B
// tiles rotating over three registers, as in `scores`).
void values(Scratch& w, const uint32_t* vh, int64_t n, int64_t ks, int64_t d, int64_t d0) {
  const int64_t dblocks = d / 16;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < n; k0 += 32) {
    _tile_loadd(4, w.p.data() + k0, ks * 2);
    const uint32_t* b = vh + ((k0 / 32) * dblocks + d0 / 16) * 256;
    _tile_loadd(5, b, 64);
    _tile_loadd(6, b + 256, 64);
    _tile_loadd(7, b + 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 768, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, w.o.data(), 256);
  _tile_stored(1, w.o.data() + 16, 256);
  _tile_stored(2, w.o.data() + 32, 256);
  _tile_stored(3, w.o.data() + 48, 256);
}

struct Item {
  int64_t chunk, head, row0;
};
#endif

}  // namespace

bool amx_prefill_supported(int64_t head_dim, at::ScalarType dtype) {
#ifdef PAGEDKV_AMX
  return dtype == at::kBFloat16 && head_dim > 0 && head_dim % 64 == 0 && amx_permitted();
#else
  (void)head_dim;
  (void)dtype;
  return false;
#endif
}

// Causal attention of C fresh prompts: chunk c is rows [starts[c], ends[c]) of q [T, heads, D],
// k, v [T, kv_heads, D] (bfloat16; rows may be strided, heads contiguous), each seeing its own
// keys only; writes those rows of out [T, heads, D].
void amx_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& starts, const at::Tensor& ends, double scale,
                           at::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(amx_prefill_supported(d, q.scalar_type()),
              "amx_prefill_attention: no AMX path for this build, dtype or head size ", d);
#ifdef PAGEDKV_AMX
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->stride(2) == 1 &&
                    t->stride(1) == d && t->size(2) == d,
                "amx_prefill_attention: expected bfloat16 [T, heads, D] with contiguous heads");
  TORCH_CHECK(heads % kv_heads == 0 && v.size(1) == kv_heads && out.size(1) == heads,
              "amx_prefill_attention: heads must be a multiple of the KV heads");
  auto st = starts.to(at::kLong).contiguous(), en = ends.to(at::kLong).contiguous();
  const int64_t chunks = st.numel(), g = heads / kv_heads;
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t* ep = en.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t c = 0; c < chunks; c++) {
    TORCH_CHECK(0 <= sp[c] && sp[c] <= ep[c] && ep[c] <= q.size(0) && ep[c] <= k.size(0),
                "amx_prefill_attention: chunk ", c, " outside the rows");
    longest = std::max(longest, ep[c] - sp[c]);
  }
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = k.data_ptr<c10::BFloat16>();
  const auto* vp = v.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  std::vector<Packed> packed(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; c++)
      pack_chunk(kp + sp[c] * k.stride(0), vp + sp[c] * v.stride(0), k.stride(0), v.stride(0),
                 ep[c] - sp[c], kv_heads, d, packed[c]);
  });
  std::vector<Item> items;
  for (int64_t c = 0; c < chunks; c++)
    for (int64_t h = 0; h < heads; h++)
      for (int64_t r = 0; r < ep[c] - sp[c]; r += AMX_ROWS) items.push_back({c, h, r});
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.row0 > b.row0; });
  const int64_t width = (longest + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
  const float sc = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    TileConfig cfg;
    _tile_loadconfig(&cfg);
    Scratch w(width, d);
    for (int64_t i; (i = next.fetch_add(1)) < n_items;) {
      const Item it = items[i];
      const Packed& pk = packed[it.chunk];
      const int64_t len = ep[it.chunk] - sp[it.chunk], kvh = it.head / g;
      const int64_t rows = std::min(AMX_ROWS, len - it.row0);
      const int64_t seen = it.row0 + rows;  // keys the item's last row sees
      const int64_t n_s = (seen + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
      const int64_t n_v = (seen + 31) / 32 * 32;
      for (int64_t r = 0; r < AMX_ROWS; r++) {
        c10::BFloat16* dst = w.q.data() + r * d;
        if (r < rows)
          std::memcpy(dst, qp + (sp[it.chunk] + it.row0 + r) * q.stride(0) + it.head * d, d * 2);
        else
          std::memset(dst, 0, d * 2);
      }
      scores(w, pk.k.data() + kvh * pk.keys_k * (d / 2), n_s, width, d);
      float sums[AMX_ROWS];
      for (int64_t r = 0; r < AMX_ROWS; r++)
        sums[r] = r < rows ? softmax_row(w.s.data() + r * width, w.p.data() + r * width,
                                         it.row0 + r + 1, n_v, sc)
                           : (std::fill_n(w.p.data() + r * width, n_v,
                                          c10::BFloat16(0, c10::BFloat16::from_bits())), 1.f);
      const uint32_t* vh = pk.v.data() + kvh * pk.keys_v * (d / 2);
      for (int64_t d0 = 0; d0 < d; d0 += 64) {
        values(w, vh, n_v, width, d, d0);
        for (int64_t r = 0; r < rows; r++) {
          c10::BFloat16* dst = op + (sp[it.chunk] + it.row0 + r) * out.stride(0) + it.head * d + d0;
          const float inv = 1.f / sums[r];
          for (int64_t j = 0; j < 64; j += QW) store_q(dst + j, row_vec(w.o.data() + r * 64 + j) * inv);
        }
      }
    }
    _tile_release();
  });
#else
  (void)q; (void)k; (void)v; (void)starts; (void)ends; (void)scale; (void)out;
  (void)heads; (void)kv_heads;
#endif
}

namespace {

// amx_prefix_attention, and with `merge` amx_prefix_attention_merge_: out and lse hold the
// queries' attention over their other keys on entry and the attention over both on exit.
void prefix_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_ids, double scale, at::Tensor& out, at::Tensor& lse,
                      bool merge, const char* name) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(0);
  TORCH_CHECK(amx_prefill_supported(d, q.scalar_type()), name,
              ": no AMX path for this build, dtype or head size ", d);
#ifdef PAGEDKV_AMX
  for (const at::Tensor* t : {&q, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->stride(2) == 1 &&
                    t->stride(1) == d && t->size(1) == heads && t->size(2) == d,
                name, ": expected bfloat16 [n, heads, D] with contiguous heads");
  const int64_t bs = k_cache.size(2);
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == at::kBFloat16 && c->dim() == 4 && c->is_contiguous() &&
                    c->size(0) == kv_heads && c->size(2) == bs && c->size(3) == d,
                name, ": expected contiguous bfloat16 caches [kv_heads, blocks, block_size, D]");
  TORCH_CHECK(bs % 16 == 0, name, ": block size ", bs, " not a multiple of 16");
  TORCH_CHECK(heads % kv_heads == 0, name, ": heads must be a multiple of the KV heads");
  TORCH_CHECK(out.size(0) == n && lse.scalar_type() == at::kFloat && lse.dim() == 2 &&
                  lse.size(0) == n && lse.size(1) == heads && lse.stride(1) == 1,
              name, ": out [n, heads, D] and lse [n, heads] float32 (heads contiguous) expected");
  auto ids = block_ids.to(at::kLong).contiguous();
  const int64_t nb = ids.numel(), blocks = k_cache.size(1), len = nb * bs, g = heads / kv_heads;
  const int64_t* bp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < nb; i++)
    TORCH_CHECK(0 <= bp[i] && bp[i] < blocks, name, ": block id ", bp[i], " outside the cache");
  if (n == 0 || len == 0) return;
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kc = k_cache.data_ptr<c10::BFloat16>();
  const auto* vc = v_cache.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  float* lp = lse.data_ptr<float>();
  const int64_t ls = lse.stride(0);
  auto row = [&](const c10::BFloat16* c, int64_t h, int64_t t) {
    return c + ((h * blocks + bp[t / bs]) * bs + t % bs) * d;
  };
  // The caller's thread keeps the re-laid K/V between calls (grown, never shrunk: every element
  // is rewritten by pack_keys), so a call allocates and zeroes nothing.
  // (A reference: the workers below must use this thread's, not their own.)
  static thread_local std::vector<Packed> kept;
  if (static_cast<int64_t>(kept.size()) < kv_heads) kept.resize(kv_heads);
  std::vector<Packed>& packed = kept;
  at::parallel_for(0, kv_heads, 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; h++)
      pack_keys([&](int64_t, int64_t t) { return row(kc, h, t); },
                [&](int64_t, int64_t t) { return row(vc, h, t); }, d, len, 1, d, packed[h]);
  });
  const int64_t rows_per_head = n * g, tiles = (rows_per_head + AMX_ROWS - 1) / AMX_ROWS;
  const int64_t width = (len + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS, n_v = (len + 31) / 32 * 32;
  const float sc = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t n_items = kv_heads * tiles;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    TileConfig cfg;
    _tile_loadconfig(&cfg);
    Scratch& w = thread_scratch(width, d);
    for (int64_t i; (i = next.fetch_add(1)) < n_items;) {
      const int64_t kvh = i / tiles, r0 = (i % tiles) * AMX_ROWS;
      const int64_t rows = std::min(AMX_ROWS, rows_per_head - r0);
      // Tile row r is the KV head's query row r0 + r: request (r0 + r) / g, its query head
      // kvh * g + (r0 + r) % g.
      auto req = [&](int64_t r) { return (r0 + r) / g; };
      auto head = [&](int64_t r) { return kvh * g + (r0 + r) % g; };
      auto q_row = [&](int64_t r) { return req(r) * q.stride(0) + head(r) * d; };
      auto o_row = [&](int64_t r) { return req(r) * out.stride(0) + head(r) * d; };
      for (int64_t r = 0; r < AMX_ROWS; r++) {
        c10::BFloat16* dst = w.q.data() + r * d;
        if (r < rows)
          std::memcpy(dst, qp + q_row(r), d * 2);
        else
          std::memset(dst, 0, d * 2);
      }
      scores(w, packed[kvh].k.data(), width, width, d);
      // Row r's output is acc * own_w[r] + (merge: the output on entry) * other_w[r].
      float own_w[AMX_ROWS], other_w[AMX_ROWS];
      for (int64_t r = 0; r < AMX_ROWS; r++) {
        float m = 0.f;
        const float sum = r < rows ? softmax_row(w.s.data() + r * width, w.p.data() + r * width,
                                                 len, n_v, sc, &m)
                                   : (std::fill_n(w.p.data() + r * width, n_v,
                                                  c10::BFloat16(0, c10::BFloat16::from_bits())),
                                      1.f);
        if (r >= rows) continue;
        float* l = lp + req(r) * ls + head(r);
        const float mine = m * sc + std::log(sum);
        if (!merge) {
          *l = mine;
          own_w[r] = 1.f / sum, other_w[r] = 0.f;
          continue;
        }
        // FlashInfer's merge_state: weights of the two parts by their log-sum-exps.
        const float top = std::max(mine, *l);
        const float a = std::exp(mine - top), b = std::exp(*l - top);  // exp(-inf) = 0
        own_w[r] = a / ((a + b) * sum), other_w[r] = b / (a + b);
        *l = top + std::log(a + b);
      }
      for (int64_t d0 = 0; d0 < d; d0 += 64) {
        values(w, packed[kvh].v.data(), n_v, width, d, d0);
        for (int64_t r = 0; r < rows; r++) {
          c10::BFloat16* dst = op + o_row(r) + d0;
          const float* acc = w.o.data() + r * 64;
          if (merge)
            for (int64_t j = 0; j < 64; j += QW)
              store_q(dst + j, row_vec(acc + j) * own_w[r] + load_q(dst + j) * other_w[r]);
          else
            for (int64_t j = 0; j < 64; j += QW) store_q(dst + j, row_vec(acc + j) * own_w[r]);
        }
      }
    }
    _tile_release();
  });
#else
  (void)q; (void)k_cache; (void)v_cache; (void)block_ids; (void)scale; (void)out; (void)lse;
  (void)n; (void)heads; (void)kv_heads; (void)merge;
#endif
}

}  // namespace

// Attention of n queries q [n, heads, D] over a shared prefix of whole cache blocks (every query
// sees every key: cascade attention's prefix part), bfloat16 on AMX tiles: the prefix's
// `block_ids` [nb] of k_cache, v_cache [kv_heads, num_blocks, block_size, D] (block_size a
// multiple of 16) are re-laid once per KV head and shared by all n x (heads / kv_heads) query
// rows of it, 16 rows a work item. Writes out [n, heads, D] and lse [n, heads] (float32, the
// natural log of each row's sum of exp(scale * score)).
void amx_prefix_attention(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_ids, double scale,
                          at::Tensor& out, at::Tensor& lse) {
  prefix_attention(q, k_cache, v_cache, block_ids, scale, out, lse, false,
                   "amx_prefix_attention");
}

// amx_prefix_attention merged in place into the queries' attention over their other keys
// (cascade attention's own part): out [n, heads, D] and lse [n, heads] (float32; rows may be
// strided, heads contiguous) hold that part on entry (lse -inf: no other keys) and the
// attention over the prefix and those keys together on exit, merged exactly by log-sum-exp
// (FlashInfer's merge_state) before the one rounding to bfloat16.
void amx_prefix_attention_merge_(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_ids,
                                 double scale, at::Tensor& out, at::Tensor& lse) {
  prefix_attention(q, k_cache, v_cache, block_ids, scale, out, lse, true,
                   "amx_prefix_attention_merge_");
}

}  // namespace pagedkv_cpu
