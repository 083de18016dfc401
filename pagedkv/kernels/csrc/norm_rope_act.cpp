// A layer's elementwise ops: RMSNorm (rms_norm; add_rms_norm_ with the residual add first),
// SiLU-and-mul and rotate-half RoPE in place, each rounding where layers.py's reference rounds.
// Whole registers (vec_rows.h: 16 lanes with AVX-512, 8 with AVX2) and a scalar tail that
// rounds the same way.
#include <ATen/ops/empty.h>

#include "common.h"
#include "ops.h"
#include "simd.h"
#include "vec_rows.h"

namespace pagedkv_cpu {
namespace {

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name,
              ": expected a CPU [rows, n] tensor with a contiguous last dim");
}

// The sum of squares of x[0, n) in float32.
template <typename T> float sum_squares(const T* x, int64_t n) {
  vqf a = {}, b = {};
  int64_t j = 0;
  for (; j + 2 * QW <= n; j += 2 * QW) {
    const vqf u = load_q(x + j), v = load_q(x + j + QW);
    a = fma_q(u, u, a);
    b = fma_q(v, v, b);
  }
  for (; j + QW <= n; j += QW) { const vqf u = load_q(x + j); a = fma_q(u, u, a); }
  float ss = hsum_q(a + b);
  for (; j < n; j++) { const float v = to_f(x[j]); ss += v * v; }
  return ss;
}

// RMSNorm of one row: out = T(x * rsqrt(mean(x^2) + eps)) * w, rounded as layers.RMSNorm.
template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float scale = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t j = 0;
  for (; j + QW <= n; j += QW)
    store_q(out + j, rnd_q<T>(load_q(x + j) * scale) * load_q(w + j));
  for (; j < n; j++) out[j] = from_f<T>(rnd<T>(to_f(x[j]) * scale) * to_f(w[j]));
}

// r += x, rounded to T (the residual add).
template <typename T> void add_row(T* r, const T* x, int64_t n) {
  int64_t j = 0;
  for (; j + QW <= n; j += QW) store_q(r + j, load_q(r + j) + load_q(x + j));
  for (; j < n; j++) r[j] = from_f<T>(to_f(r[j]) + to_f(x[j]));
}

// silu(g) * u over n values: silu rounded to T, then the product rounded to T.
template <typename T> void silu_mul_row(const T* g, const T* u, T* out, int64_t n) {
  int64_t j = 0;
  for (; j + QW <= n; j += QW) {
    const vqf x = load_q(g + j);
#if PAGEDKV_QW == 16
    // simd.h's exp16: exp_q's polynomial with min/max, vrndscaleps and vscalefps (about
    // 30 instructions a register here instead of 37); it differs only where exp(-x)
    // overflows (x below -88.4: silu ~ -1e-37 instead of -0).
    const vqf e = (vqf)exp16((__m512)-x);
#else
    const vqf e = exp_q(-x);
#endif
    store_q(out + j, rnd_q<T>(x * recip_q(1.f + e)) * load_q(u + j));
  }
  for (; j < n; j++) {
    const float x = to_f(g[j]);
    out[j] = from_f<T>(rnd<T>(x / (1.f + fast_exp(-x))) * to_f(u[j]));
  }
}

// RoPE in place on one head v[0, 2 * half) (half a multiple of QW) with its position's cos /
// signed-sin rows c, s: each half's three roundings as rope_'s scalar loop.
template <typename T> void rope_head(T* v, const T* c, const T* s, int64_t half) {
  for (int64_t j = 0; j < half; j += QW) {
    const vqf x1 = load_q(v + j), x2 = load_q(v + half + j);
    const vqf o1 = rnd_q<T>(x1 * load_q(c + j)) + rnd_q<T>(x2 * load_q(s + j));
    const vqf o2 = rnd_q<T>(x2 * load_q(c + half + j)) + rnd_q<T>(x1 * load_q(s + half + j));
    store_q(v + j, o1);
    store_q(v + half + j, o2);
  }
}

// RoPE in place on `heads` heads of one token (v, heads d = 2 * NV * QW values apart) with the
// token's cos / signed-sin rows c, s held in registers across its heads (loaded once, not once
// a head): each half's three roundings as rope_head.
template <int NV, typename T>
void rope_token(T* v, int64_t heads, const T* c, const T* s) {
  constexpr int64_t half = NV * QW;
  vqf c1[NV], c2[NV], s1[NV], s2[NV];
  for (int k = 0; k < NV; k++) {
    c1[k] = load_q(c + k * QW);
    c2[k] = load_q(c + half + k * QW);
    s1[k] = load_q(s + k * QW);
    s2[k] = load_q(s + half + k * QW);
  }
  for (int64_t h = 0; h < heads; h++, v += 2 * half) {
    for (int k = 0; k < NV; k++) {
      const vqf x1 = load_q(v + k * QW), x2 = load_q(v + half + k * QW);
      store_q(v + k * QW, rnd_q<T>(x1 * c1[k]) + rnd_q<T>(x2 * s1[k]));
      store_q(v + half + k * QW, rnd_q<T>(x2 * c2[k]) + rnd_q<T>(x1 * s2[k]));
    }
  }
}

// rope_token's function for half = nv * QW (nv 1, 2, 4 or 8), else nullptr.
template <typename T> auto rope_token_for(int64_t nv) -> void (*)(T*, int64_t, const T*, const T*) {
  switch (nv) {
    case 1: return rope_token<1, T>;
    case 2: return rope_token<2, T>;
    case 4: return rope_token<4, T>;
    case 8: return rope_token<8, T>;
    default: return nullptr;
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), sx = x.stride(0);
  auto out = at::empty({rows, n}, x.options());
  auto wc = w.contiguous();
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; i++) rms_row(xp + i * sx, wp, op + i * n, n, (float)eps);
    });
  });
  return out;
}

// residual += x (rounded to T); returns RMSNorm(residual) * w (vLLM's fused_add_rms_norm).
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                         double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: x and residual differ in shape or dtype");
  const int64_t rows = x.size(0), n = x.size(1), sx = x.stride(0), sr = residual.stride(0);
  auto out = at::empty({rows, n}, x.options());
  auto wc = w.contiguous();
  dispatch(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; i++) {
        scalar_t* r = rp + i * sr;
        const scalar_t* xi = xp + i * sx;
        add_row(r, xi, n);
        rms_row(r, wp, op + i * n, n, (float)eps);
      }
    });
  });
  return out;
}

// silu(gate) * up for gate_up [T, 2I] = [gate | up]: silu rounded to T, then the product.
at::Tensor silu_and_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_and_mul");
  const int64_t rows = gu.size(0), n = gu.size(1) / 2, s = gu.stride(0);
  auto out = at::empty({rows, n}, gu.options());
  dispatch(gu.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* g = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; i++) silu_mul_row(g + i * s, g + i * s + n, o + i * n, n);
    });
  });
  return out;
}

// Rotate-half RoPE in place on x [T, heads, D] (rows may be strided; heads contiguous), with
// cos / signed-sin tables [P, D] (layers.RotaryEmbedding) gathered at positions [T]:
// x = T(T(x * cos) + T(swap_halves(x) * sin)), the reference's three roundings.
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope_: expected x [T, heads, D] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type()
              && sin.scalar_type() == x.scalar_type(), "rope_: tables must be contiguous, x's dtype");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2, sx = x.stride(0);
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t table_len = cos.size(0);
  for (int64_t i = 0; i < t; i++)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < table_len, "rope_: position ", pp[i], " outside the table");
  dispatch(x.scalar_type(), "rope_", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const auto token_fn = half % QW == 0 ? rope_token_for<scalar_t>(half / QW) : nullptr;
    if (token_fn != nullptr) {
      at::parallel_for(0, t, 32, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; i++)
          token_fn(xp + i * sx, heads, cp + pp[i] * d, sp + pp[i] * d);
      });
      return;
    }
    if (half % QW == 0) {
      at::parallel_for(0, t, 8, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; i++)
          for (int64_t h = 0; h < heads; h++)
            rope_head(xp + i * sx + h * d, cp + pp[i] * d, sp + pp[i] * d, half);
      });
      return;
    }
    at::parallel_for(0, t, 8, [&](int64_t b, int64_t e) {
      std::vector<float> cf(d), sf(d), xf(d);
      for (int64_t i = b; i < e; i++) {
        const scalar_t* c = cp + pp[i] * d;
        const scalar_t* s = sp + pp[i] * d;
        for (int64_t j = 0; j < d; j++) { cf[j] = to_f(c[j]); sf[j] = to_f(s[j]); }
        for (int64_t h = 0; h < heads; h++) {
          scalar_t* __restrict v = xp + i * sx + h * d;
          float* __restrict x = xf.data();
          for (int64_t j = 0; j < d; j++) x[j] = to_f(v[j]);
          const float* __restrict cc = cf.data();
          const float* __restrict ss = sf.data();
          for (int64_t j = 0; j < half; j++)
            v[j] = from_f<scalar_t>(rnd<scalar_t>(x[j] * cc[j]) + rnd<scalar_t>(x[j + half] * ss[j]));
          for (int64_t j = half; j < d; j++)
            v[j] = from_f<scalar_t>(rnd<scalar_t>(x[j] * cc[j]) + rnd<scalar_t>(x[j - half] * ss[j]));
        }
      }
    });
  });
}

}  // namespace pagedkv_cpu
