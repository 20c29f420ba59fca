// Ragged grouped GEMMs on CPU, each one OpenMP parallel region: rows sorted by expert, every
// thread multiplies an equal share of rows, one single-threaded matmul per expert it meets.
// torch's CPU _grouped_mm (and a bmm over padded slabs) pay a thread wake-up per expert or a
// matmul over padding; these pay neither.
//
// Legend: R rows (sorted by expert), D in, F out, E experts; end_E[e] = one past expert e's
// last row (cumulative counts, int64). Weights may be stored in another dtype than x (fp32 master
// weights, bf16 compute): each thread casts the expert slices it multiplies, and the weight
// gradient comes back in the weights' dtype, so no cast of a whole stack runs either way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tasks.h"

#include <algorithm>
#include <vector>

namespace {

struct Piece {
  int64_t expert, start, stop;  // rows [start, stop) of expert
};

// The pieces of experts that rows [lo, hi) cover.
std::vector<Piece> pieces(const int64_t* end_E, int64_t E, int64_t lo, int64_t hi) {
  std::vector<Piece> out;
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = std::max(lo, start), f = std::min(hi, end_E[e]);
    if (f > s) out.push_back({e, s, f});
    start = end_E[e];
  }
  return out;
}

// fn(lo, hi) on an equal share of rows per thread; matmuls inside run single-threaded.
template <typename Fn>
void over_row_shares(int64_t R, Fn fn) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), R / 16));
  one_thread_tasks(n, [&](int64_t t) { fn(t * R / n, (t + 1) * R / n); });
}

void check(const at::Tensor& x_RD, const at::Tensor& end_E, int64_t E) {
  TORCH_CHECK(x_RD.dim() == 2 && x_RD.device().is_cpu(), "grouped GEMM: x must be a 2-D CPU tensor");
  TORCH_CHECK(end_E.scalar_type() == at::kLong && end_E.dim() == 1 && end_E.numel() == E,
              "grouped GEMM: end_E must hold one int64 row end per expert (", E, "), got ", end_E.sizes());
  TORCH_CHECK(E == 0 || end_E[E - 1].item<int64_t>() == x_RD.size(0),
              "grouped GEMM: the experts' rows must add up to the ", x_RD.size(0), " rows of x");
}

// a @ b (b cast to a's dtype); with fp32 and a bf16 a (a CPU without native bf16 GEMMs, which are
// 10-45x slower there), one fp32 GEMM of the bf16 values (exact in fp32), rounded once to bf16.
at::Tensor mm_in(const at::Tensor& a, const at::Tensor& b, bool fp32) {
  if (!fp32 || a.scalar_type() != at::kBFloat16) return at::mm(a, b.to(a.scalar_type()));
  return at::mm(a.to(at::kFloat), b.to(at::kBFloat16).to(at::kFloat)).to(at::kBFloat16);
}

// y_RF[r] = x_RD[r] @ w_EDF[expert of r] (w cast to x's dtype; fp32: mm_in's)
at::Tensor grouped_mm(const at::Tensor& x_RD, const at::Tensor& w_EDF, const at::Tensor& end_E_in, bool fp32) {
  TORCH_CHECK(w_EDF.dim() == 3 && w_EDF.size(1) == x_RD.size(1) && w_EDF.is_floating_point(),
              "grouped GEMM: w must be a float [E, D, F] with D = x.size(1)");
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // a kernel: autograd is the custom op's
  const at::Tensor end_E = end_E_in.contiguous();
  const int64_t E = w_EDF.size(0), R = x_RD.size(0);
  check(x_RD, end_E, E);
  at::Tensor y_RF = at::empty({R, w_EDF.size(2)}, x_RD.options());
  const int64_t* ends = end_E.data_ptr<int64_t>();
  over_row_shares(R, [&](int64_t lo, int64_t hi) {
    for (const Piece& p : pieces(ends, E, lo, hi)) {
      at::Tensor y = y_RF.narrow(0, p.start, p.stop - p.start);
      const at::Tensor x = x_RD.narrow(0, p.start, p.stop - p.start), w = w_EDF.select(0, p.expert);
      if (fp32 && x_RD.scalar_type() == at::kBFloat16) y.copy_(mm_in(x, w, true));
      else at::mm_out(y, x, w.to(x_RD.scalar_type()));
    }
  });
  return y_RF;
}

// g_EDF[e] = x_RD[rows of e]^T @ g_RF[rows of e] in dtype (zero for an expert without rows). An
// expert cut by a share boundary gets a partial product per share, summed in fp32 after the
// parallel region.
at::Tensor grouped_mm_wgrad(const at::Tensor& x_RD, const at::Tensor& g_RF, const at::Tensor& end_E_in,
                            at::ScalarType dtype, bool fp32) {
  TORCH_CHECK(g_RF.dim() == 2 && g_RF.size(0) == x_RD.size(0) && g_RF.scalar_type() == x_RD.scalar_type(),
              "grouped GEMM wgrad: g must be [R, F] of x's dtype");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const at::Tensor end_E = end_E_in.contiguous();
  const int64_t E = end_E.numel(), R = x_RD.size(0);
  check(x_RD, end_E, E);
  at::Tensor g_EDF = at::empty({E, x_RD.size(1), g_RF.size(1)}, x_RD.options().dtype(dtype));
  const int64_t* ends = end_E.data_ptr<int64_t>();
  std::vector<char> whole(E, 0);
  std::vector<std::vector<std::pair<int64_t, at::Tensor>>> partial(std::max<int64_t>(1, at::get_num_threads()));
  over_row_shares(R, [&](int64_t lo, int64_t hi) {
    auto& mine = partial[at::get_thread_num()];
    for (const Piece& p : pieces(ends, E, lo, hi)) {
      const at::Tensor xT = x_RD.narrow(0, p.start, p.stop - p.start).t();
      const at::Tensor g = g_RF.narrow(0, p.start, p.stop - p.start);
      if (p.start == (p.expert ? ends[p.expert - 1] : 0) && p.stop == ends[p.expert]) {
        at::Tensor out = g_EDF.select(0, p.expert);
        if (dtype == x_RD.scalar_type() && !fp32) at::mm_out(out, xT, g);
        else out.copy_(mm_in(xT, g, fp32));
        whole[p.expert] = 1;
      } else {
        mine.emplace_back(p.expert, mm_in(xT, g, fp32).to(at::kFloat));
      }
    }
  });
  std::vector<at::Tensor> sum(E);
  for (auto& mine : partial)
    for (auto& [e, t] : mine) sum[e] = sum[e].defined() ? sum[e].add_(t) : t;
  for (int64_t e = 0; e < E; ++e) {
    if (sum[e].defined()) g_EDF.select(0, e).copy_(sum[e]);
    else if (!whole[e]) g_EDF.select(0, e).zero_();
  }
  return g_EDF;
}

}  // namespace

// CPU kernels (fnmoe/cpu_gemm.py registers fake kernels for compile and the autograd formula)
TORCH_LIBRARY(fnmoe_cpu, m) {
  m.def("grouped_mm(Tensor x_RD, Tensor w_EDF, Tensor end_E, bool fp32) -> Tensor");
  m.def("grouped_mm_wgrad(Tensor x_RD, Tensor g_RF, Tensor end_E, ScalarType dtype, bool fp32) -> Tensor");
}

TORCH_LIBRARY_IMPL(fnmoe_cpu, CPU, m) {
  m.impl("grouped_mm", &grouped_mm);
  m.impl("grouped_mm_wgrad", &grouped_mm_wgrad);
}
