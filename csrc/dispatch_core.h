// Shared arithmetic of the Lazarus token dispatcher (Algorithm 1), used by the CPU op
// (dispatch.cpp) and the CUDA kernels (dispatch_kernels.cu). Plain C++: no torch headers,
// so the CUDA file compiles with a bare `nvcc -c`.
//
// For one expert e with replicas R[j] and routed tokens T[j] on ranks j = 0..N-1:
//   r = sum R, t = sum T, fair share of rank j = t * R[j] / r.
//   cap[j]   = largest-remainder rounding of the fair shares (sums to t exactly);
//              the leftover tokens go to the largest remainders, ties to ranks that have
//              local tokens beyond their floor share (saves a transfer), then lower rank.
//   local[j] = min(cap[j], T[j])        tokens a rank keeps for its own replica
//   x[j]     = T[j] - local[j]          excess it must send away
//   y[j]     = cap[j] - local[j]        residual capacity it receives into
//   sum x == sum y, and x[j] > 0 implies y[j] == 0 (and vice versa).
// Excesses are matched to residuals by filling in rank order: lay the excesses of all
// sources end to end on [0, S) and the residuals of all destinations likewise; source i
// sends to destination j the length of the overlap of their intervals. Row sums are the
// excesses and column sums the residuals, exactly, every pair is computed in O(1) from two
// exclusive prefix sums, and each expert needs at most (#sources + #destinations - 1)
// messages instead of the all-pairs spread of proportional splitting.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define LZ_HD __host__ __device__ __forceinline__
#else
#define LZ_HD inline
#endif

namespace lazarus_dispatch {

// Length of [a, a + x) intersected with [b, b + y).
LZ_HD int64_t overlap(int64_t a, int64_t x, int64_t b, int64_t y) {
  const int64_t lo = a > b ? a : b;
  const int64_t hi = (a + x) < (b + y) ? (a + x) : (b + y);
  return hi > lo ? hi - lo : 0;
}

// Strict "k wins the leftover token before j" order of the largest-remainder rule.
// rem: t * R % r; more: 1 when the rank has local tokens beyond its floor share.
LZ_HD bool beats(int64_t rem_k, int64_t more_k, int64_t k, int64_t rem_j, int64_t more_j, int64_t j) {
  if (rem_k != rem_j) return rem_k > rem_j;
  if (more_k != more_j) return more_k > more_j;
  return k < j;
}

}  // namespace lazarus_dispatch
