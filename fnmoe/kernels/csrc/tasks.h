// Tasks over ATen's threads, each running single-threaded inside (shared by fnmoe's CPU kernels).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif

// fn(t) for t in [0, n), one OpenMP parallel region; ops inside run below autograd and on one
// thread (oneDNN must not nest a team inside ours).
template <typename Fn>
void one_thread_tasks(int64_t n, Fn fn) {
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // thread-local: each worker needs its own
#ifdef _OPENMP
    omp_set_num_threads(1);  // this task only
#endif
    for (int64_t t = lo; t < hi; ++t) fn(t);
  });
}
