// Causal grouped-query attention on CPU for short rows (up to ~1k positions), bf16 in and out,
// fp32 scores and softmax: one OpenMP parallel region per call, one task per (batch, kv group),
// single-threaded GEMMs and fused, vectorized softmax loops inside. SDPA's CPU flash kernel walks
// many small blocks with per-block bookkeeping; at L = 256 these loops run fwd+bwd in under half
// its time.
//
// Legend: B batch, L positions, H query heads, G kv groups (H = G r), A q/k head dim, U value head
// dim; a task stacks the r query heads of one group as r L rows. Scores and dP are fp32 dot
// products of the bf16 inputs (exact products, fp32 sums, like flash attention: AVX512-BF16 where
// the CPU has it, else fp32 GEMMs); P and dS are rounded to bf16 for the GEMMs that take them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "tasks.h"
#if defined(__x86_64__) && defined(__GNUC__)
#define FNMOE_BF16_DOT 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

// Whether scores use AVX512-BF16 dot products: the CPU has them, and tests may turn them off to
// check the fp32 GEMM path (use_bf16_dot).
std::atomic<bool> bf16_dot_on{true};

bool bf16_dot_supported() {
#ifdef FNMOE_BF16_DOT
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

#ifdef FNMOE_BF16_DOT
// A tile of MR rows x 16 NV columns: c[i, j] = sum over pairs p of a[i, 2p:2p+2] . bp[p, j] (vdpbf16ps,
// fp32 accumulation, exact products of bf16), columns j < n stored.
template <int MR, int NV>
__attribute__((target("avx512f,avx512bf16"))) void dot_tile(const at::BFloat16* a, int64_t lda, const int32_t* bp,
                                                             int64_t ldb, int64_t pairs, float* c, int64_t ldc,
                                                             int64_t n) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(bp + p * ldb + 16 * v);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], x, (__m512bh)b[v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      const int64_t left = n - 16 * v;
      const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      _mm512_mask_storeu_ps(c + i * ldc + 16 * v, m, acc[i][v]);
    }
}

template <int MR>
void dot_rows_of(const at::BFloat16* a, int64_t lda, const int32_t* bp, int64_t ldb, int64_t pairs, float* c,
                 int64_t ldc, int64_t n) {
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t cols = std::min<int64_t>(64, n - j);
    switch ((cols + 15) / 16) {
      case 4: dot_tile<MR, 4>(a, lda, bp + j, ldb, pairs, c + j, ldc, cols); break;
      case 3: dot_tile<MR, 3>(a, lda, bp + j, ldb, pairs, c + j, ldc, cols); break;
      case 2: dot_tile<MR, 2>(a, lda, bp + j, ldb, pairs, c + j, ldc, cols); break;
      default: dot_tile<MR, 1>(a, lda, bp + j, ldb, pairs, c + j, ldc, cols);
    }
  }
}
#endif

// Rows of a [R, K] dotted with rows of b [N, K] (both bf16) into fp32: AVX512-BF16 dot products
// where the CPU has them (and K is even), ~3x an fp32 GEMM here; else an fp32 GEMM of upcast copies.
// Either way each product is exact and sums run in fp32, as in flash attention's score GEMM.
struct Dots {
  at::Tensor a, b32, a32, bp;  // bp: b as [K/2, N rounded up to 16] int32 pairs (b[n, 2p], b[n, 2p + 1])
  Dots(const at::Tensor& a_RK, const at::Tensor& b_NK) : a(a_RK.contiguous()) {
    const int64_t N = b_NK.size(0), K = b_NK.size(1);
    if (bf16_dot_on && bf16_dot_supported() && K % 2 == 0) {
      bp = at::zeros({K / 2, (N + 15) / 16 * 16}, b_NK.options().dtype(at::kInt));
      bp.narrow(1, 0, N).copy_(b_NK.contiguous().view(at::kInt).t());
    } else {
      a32 = a.to(at::kFloat);
      b32 = b_NK.to(at::kFloat);
    }
  }
  // [rows, n] fp32: rows [row0, row0 + rows) of a against the first n rows of b.
  at::Tensor operator()(int64_t row0, int64_t rows, int64_t n) const {
    if (!bp.defined()) return at::mm(a32.narrow(0, row0, rows), b32.narrow(0, 0, n).t());
    at::Tensor c = at::empty({rows, n}, a.options().dtype(at::kFloat));
#ifdef FNMOE_BF16_DOT
    const int64_t K = a.size(1), ldb = bp.size(1);
    const at::BFloat16* ap = a.data_ptr<at::BFloat16>() + row0 * K;
    float* cp = c.data_ptr<float>();
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4) dot_rows_of<4>(ap + i * K, K, bp.data_ptr<int32_t>(), ldb, K / 2, cp + i * n, n, n);
    for (; i < rows; ++i) dot_rows_of<1>(ap + i * K, K, bp.data_ptr<int32_t>(), ldb, K / 2, cp + i * n, n, n);
#endif
    return c;
  }
};

bool use_bf16_dot(bool on) {
  bf16_dot_on = on;
  return on && bf16_dot_supported();
}

// fn(b, g) for every (batch, group) task; GEMMs inside run single-threaded.
template <typename Fn>
void over_groups(int64_t B, int64_t G, Fn fn) {
  one_thread_tasks(B * G, [&](int64_t t) { fn(t / G, t % G); });
}

// The r heads of group g in batch b of x [B, L, H, A], stacked as [r L, A] in dtype.
at::Tensor stacked(const at::Tensor& x_BLHA, int64_t b, int64_t g, int64_t r, at::ScalarType dtype) {
  const int64_t L = x_BLHA.size(1), A = x_BLHA.size(3);
  at::Tensor out = at::empty({r * L, A}, x_BLHA.options().dtype(dtype));
  out.view({r, L, A}).copy_(x_BLHA.select(0, b).narrow(1, g * r, r).transpose(0, 1));
  return out;
}

void unstack(const at::Tensor& s_RA, at::Tensor& x_BLHA, int64_t b, int64_t g, int64_t r) {
  const int64_t L = x_BLHA.size(1);
  x_BLHA.select(0, b).narrow(1, g * r, r).transpose(0, 1).copy_(s_RA.view({r, L, s_RA.size(1)}));
}

float row_max(const float* s, int64_t n) {
  Vec m(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + W <= n; j += W) m = at::vec::maximum(m, Vec::loadu(s + j));
  float out = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
  for (; j < n; ++j) out = std::max(out, s[j]);
  return out;
}

// p[j] = exp(s[j] * scale - shift) for j < n (in place); returns their sum.
float exp_row(float* s, int64_t n, float scale, float shift) {
  const Vec vs(scale), vh(shift);
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    Vec p = (Vec::loadu(s + j) * vs - vh).exp_u20();
    p.store(s + j);
    acc = acc + p;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] * scale - shift));
  return sum;
}

// Causal blocks: fn(row0, rows, pos0, keys) for each block of <= 128 query positions of each stacked
// head (rows [row0, row0 + rows) of the stack, positions from pos0), which sees keys [0, keys).
// The fp32 GEMMs then skip the blocks above the diagonal (at L = 256, a quarter of their work;
// 64-query blocks skip more but lose it again to per-call overhead: measured 3.6 vs 3.4 ms).
template <typename Fn>
void causal_blocks(int64_t r, int64_t L, Fn fn) {
  constexpr int64_t Q = 128;
  for (int64_t h = 0; h < r; ++h)
    for (int64_t p0 = 0; p0 < L; p0 += Q) fn(h * L + p0, std::min(Q, L - p0), p0, std::min(L, p0 + Q));
}

// Scores S (rows x keys, fp32, overwritten) of positions pos0.. -> probabilities P (bf16, rows x
// keys, zero past the diagonal) and each row's log-sum-exp.
void softmax_rows(float* s, int64_t rows, int64_t keys, int64_t pos0, at::BFloat16* p, float* lse, float scale) {
  for (int64_t i = 0; i < rows; ++i, s += keys, p += keys) {
    const int64_t n = pos0 + i + 1;
    const float m = row_max(s, n) * scale;
    const float sum = exp_row(s, n, scale, m);
    lse[i] = m + std::log(sum);
    at::vec::map([inv = 1.f / sum](Vec x) { return x * Vec(inv); }, s, s, n);
    at::vec::convert(s, p, n);
    std::fill(p + n, p + keys, at::BFloat16(0.f));
  }
}

// y_BLHU = softmax(q k^T scale, causal) v; lse_BHL = the rows' log-sum-exp (of scaled scores).
std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q_BLHA, const at::Tensor& k_BLGA,
                                                 const at::Tensor& v_BLGU, double scale) {
  TORCH_CHECK(q_BLHA.dim() == 4 && k_BLGA.dim() == 4 && v_BLGU.dim() == 4 &&
                  v_BLGU.sizes().slice(0, 3) == k_BLGA.sizes().slice(0, 3),
              "cpu attention: q [B, L, H, A], k [B, L, G, A], v [B, L, G, U]");
  TORCH_CHECK(q_BLHA.scalar_type() == at::kBFloat16 && k_BLGA.scalar_type() == at::kBFloat16 &&
                  v_BLGU.scalar_type() == at::kBFloat16, "cpu attention: bf16 q, k, v");
  const int64_t B = q_BLHA.size(0), L = q_BLHA.size(1), H = q_BLHA.size(2), G = k_BLGA.size(2);
  TORCH_CHECK(k_BLGA.size(0) == B && k_BLGA.size(1) == L && k_BLGA.size(3) == q_BLHA.size(3) && H % G == 0,
              "cpu attention: q ", q_BLHA.sizes(), " and k ", k_BLGA.sizes(), " do not match");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t r = H / G;
  at::Tensor y_BLHU = at::empty({B, L, H, v_BLGU.size(3)}, q_BLHA.options());
  at::Tensor lse_BHL = at::empty({B, H, L}, q_BLHA.options().dtype(at::kFloat));
  over_groups(B, G, [&](int64_t b, int64_t g) {
    const Dots qk(stacked(q_BLHA, b, g, r, at::kBFloat16), k_BLGA.select(0, b).select(1, g));
    const at::Tensor v_LU = v_BLGU.select(0, b).select(1, g);
    at::Tensor y_RU = at::empty({r * L, v_LU.size(1)}, q_BLHA.options());
    float* lse_R = lse_BHL.select(0, b).narrow(0, g * r, r).data_ptr<float>();
    causal_blocks(r, L, [&](int64_t row0, int64_t rows, int64_t pos0, int64_t keys) {
      at::Tensor S = qk(row0, rows, keys);
      at::Tensor P = at::empty({rows, keys}, q_BLHA.options());  // one block's: the forward keeps none
      softmax_rows(S.data_ptr<float>(), rows, keys, pos0, P.data_ptr<at::BFloat16>(), lse_R + row0,
                   static_cast<float>(scale));
      at::Tensor y = y_RU.narrow(0, row0, rows);
      at::mm_out(y, P, v_LU.narrow(0, 0, keys));
    });
    unstack(y_RU, y_BLHU, b, g, r);
  });
  return {y_BLHU, lse_BHL};
}

// dq, dk, dv of attention_fwd, given dy_BLHU, its y_BLHU and lse_BHL.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(const at::Tensor& dy_BLHU, const at::Tensor& q_BLHA,
                                                             const at::Tensor& k_BLGA, const at::Tensor& v_BLGU,
                                                             const at::Tensor& y_BLHU, const at::Tensor& lse_BHL,
                                                             double scale_d) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t B = q_BLHA.size(0), L = q_BLHA.size(1), H = q_BLHA.size(2), G = k_BLGA.size(2), A = q_BLHA.size(3);
  const int64_t U = dy_BLHU.size(3), r = H / G;
  const float scale = static_cast<float>(scale_d);
  at::Tensor dq_BLHA = at::empty(q_BLHA.sizes(), q_BLHA.options());
  at::Tensor dk_BLGA = at::empty(k_BLGA.sizes(), k_BLGA.options());
  at::Tensor dv_BLGU = at::empty(v_BLGU.sizes(), v_BLGU.options());
  const at::Tensor lse = lse_BHL.contiguous();
  over_groups(B, G, [&](int64_t b, int64_t g) {
    const at::Tensor q_RA = stacked(q_BLHA, b, g, r, at::kBFloat16), dy_RU = stacked(dy_BLHU, b, g, r, at::kBFloat16);
    const at::Tensor dyf_RU = dy_RU.to(at::kFloat), yf_RU = stacked(y_BLHU, b, g, r, at::kFloat);
    const at::Tensor k_LA = k_BLGA.select(0, b).select(1, g), v_LU = v_BLGU.select(0, b).select(1, g);
    const Dots qk(q_RA, k_LA), dyv(dy_RU, v_LU);
    at::Tensor P_RL = at::empty({r * L, L}, q_BLHA.options()), dS_RL = at::empty({r * L, L}, q_BLHA.options());
    at::Tensor dq_RA = at::empty({r * L, A}, q_BLHA.options());
    const float* lse_R = lse.select(0, b).narrow(0, g * r, r).data_ptr<float>();
    const float *dyf = dyf_RU.data_ptr<float>(), *yf = yf_RU.data_ptr<float>();
    at::BFloat16 *p_base = P_RL.data_ptr<at::BFloat16>(), *ds_base = dS_RL.data_ptr<at::BFloat16>();
    causal_blocks(r, L, [&](int64_t row0, int64_t rows, int64_t pos0, int64_t keys) {
      at::Tensor S = qk(row0, rows, keys), dP = dyv(row0, rows, keys);
      float *s = S.data_ptr<float>(), *dp = dP.data_ptr<float>();
      for (int64_t i = 0; i < rows; ++i, s += keys, dp += keys) {
        const int64_t n = pos0 + i + 1, row = row0 + i;
        const float delta = at::vec::map2_reduce_all<float>(
            [](Vec a, Vec b) { return a * b; }, [](Vec a, Vec b) { return a + b; },
            dyf + row * U, yf + row * U, U);
        exp_row(s, n, scale, lse_R[row]);  // s now holds P
        at::vec::map2([scale, delta](Vec pp, Vec d) { return pp * (d - Vec(delta)) * Vec(scale); }, dp, s, dp, n);
        at::BFloat16 *p = p_base + row * L, *ds = ds_base + row * L;
        at::vec::convert(s, p, n);
        at::vec::convert(dp, ds, n);
        std::fill(p + n, p + L, at::BFloat16(0.f));
        std::fill(ds + n, ds + L, at::BFloat16(0.f));
      }
      at::Tensor dq = dq_RA.narrow(0, row0, rows);
      at::mm_out(dq, dS_RL.narrow(0, row0, rows).narrow(1, 0, keys), k_LA.narrow(0, 0, keys));
    });
    dv_BLGU.select(0, b).select(1, g).copy_(at::mm(P_RL.t(), dy_RU));
    dk_BLGA.select(0, b).select(1, g).copy_(at::mm(dS_RL.t(), q_RA));
    unstack(dq_RA, dq_BLHA, b, g, r);
  });
  return {dq_BLHA, dk_BLGA, dv_BLGU};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fnmoe_cpu, m) {
  m.def("attention(Tensor q_BLHA, Tensor k_BLGA, Tensor v_BLGU, float scale) -> (Tensor, Tensor)");
  m.def("attention_bwd(Tensor dy_BLHU, Tensor q_BLHA, Tensor k_BLGA, Tensor v_BLGU, Tensor y_BLHU, "
        "Tensor lse_BHL, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("use_bf16_dot(bool on) -> bool", &use_bf16_dot);  // tests: the fp32 GEMM path on any CPU
}

TORCH_LIBRARY_IMPL(fnmoe_cpu, CPU, m) {
  m.impl("attention", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
}
