// CUDA version of the Lazarus dispatcher (Algorithm 1): experts and ranks in parallel.
// Pure CUDA (no torch headers); the numbers equal the CPU op and the torch fallback
// exactly, since all arithmetic is integer and follows dispatch_core.h.
#include "dispatch_core.h"
#include "dispatch_kernels.h"

namespace lazarus_dispatch {
namespace {

constexpr int kBlock = 256;

// Sum of v over the block; every thread gets the result. Uses `buf` (kBlock words).
__device__ int64_t block_sum(int64_t v, int64_t* buf) {
  buf[threadIdx.x] = v;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
    __syncthreads();
  }
  const int64_t out = buf[0];
  __syncthreads();
  return out;
}

// Workspace layout: q (then capacity), rem, local, x, y, a, b; each [E, N].
__global__ void plan_kernel(const int64_t* __restrict__ R, const int64_t* __restrict__ T, int64_t E,
                            int64_t N, int64_t* __restrict__ ws) {
  __shared__ int64_t buf[kBlock];
  __shared__ int64_t chunk_x[kBlock];
  __shared__ int64_t chunk_y[kBlock];
  const int64_t e = blockIdx.x;
  const int64_t row = e * N;
  int64_t* q = ws;
  int64_t* rem = ws + E * N;
  int64_t* local = ws + 2 * E * N;
  int64_t* x = ws + 3 * E * N;
  int64_t* y = ws + 4 * E * N;
  int64_t* a = ws + 5 * E * N;
  int64_t* b = ws + 6 * E * N;

  int64_t r_part = 0, t_part = 0;
  for (int64_t j = threadIdx.x; j < N; j += kBlock) {
    r_part += R[row + j];
    t_part += T[row + j];
  }
  const int64_t r = block_sum(r_part, buf);
  const int64_t t = block_sum(t_part, buf);

  int64_t q_part = 0;
  for (int64_t j = threadIdx.x; j < N; j += kBlock) {
    const int64_t num = t * R[row + j];
    const int64_t qj = r > 0 ? num / r : 0;
    q[row + j] = qj;
    rem[row + j] = r > 0 ? num % r : 0;
    q_part += qj;
  }
  const int64_t leftover = t - block_sum(q_part, buf);  // block_sum syncs: q/rem visible

  // Largest remainder: rank j gets a leftover token when fewer than `leftover` ranks beat it.
  for (int64_t j = threadIdx.x; j < N; j += kBlock) {
    const int64_t qj = q[row + j], rj = rem[row + j], tj = T[row + j];
    int64_t cap = qj;
    if (leftover > 0 && rj > 0) {
      const int64_t mj = tj > qj ? 1 : 0;
      int64_t ahead = 0;
      for (int64_t k = 0; k < N && ahead < leftover; ++k) {
        const int64_t mk = T[row + k] > q[row + k] ? 1 : 0;
        if (beats(rem[row + k], mk, k, rj, mj, j)) ++ahead;
      }
      if (ahead < leftover) cap += 1;
    }
    const int64_t loc = cap < tj ? cap : tj;
    local[row + j] = loc;
    x[row + j] = tj - loc;
    y[row + j] = cap - loc;
  }
  __syncthreads();
  // q is overwritten only now (other threads were reading it above).
  for (int64_t j = threadIdx.x; j < N; j += kBlock) q[row + j] = local[row + j] + y[row + j];

  // Exclusive prefix sums of x and y over ranks: contiguous chunk per thread.
  const int64_t chunk = (N + kBlock - 1) / kBlock;
  const int64_t lo = threadIdx.x * chunk;
  const int64_t hi = lo + chunk < N ? lo + chunk : N;
  int64_t sx = 0, sy = 0;
  for (int64_t j = lo; j < hi; ++j) {
    sx += x[row + j];
    sy += y[row + j];
  }
  chunk_x[threadIdx.x] = sx;
  chunk_y[threadIdx.x] = sy;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t ax = 0, ay = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int64_t vx = chunk_x[i], vy = chunk_y[i];
      chunk_x[i] = ax;
      chunk_y[i] = ay;
      ax += vx;
      ay += vy;
    }
  }
  __syncthreads();
  int64_t ax = chunk_x[threadIdx.x], ay = chunk_y[threadIdx.x];
  for (int64_t j = lo; j < hi; ++j) {
    a[row + j] = ax;
    b[row + j] = ay;
    ax += x[row + j];
    ay += y[row + j];
  }
}

__global__ void rank_kernel(const int64_t* __restrict__ ws, int64_t E, int64_t N, int64_t rank,
                            int64_t* __restrict__ send, int64_t* __restrict__ recv) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= E * N) return;
  const int64_t e = idx / N, j = idx % N;
  const int64_t row = e * N;
  const int64_t* local = ws + 2 * E * N;
  const int64_t* x = ws + 3 * E * N;
  const int64_t* y = ws + 4 * E * N;
  const int64_t* a = ws + 5 * E * N;
  const int64_t* b = ws + 6 * E * N;
  const int64_t own = j == rank ? local[row + rank] : 0;
  send[j * E + e] = own + overlap(a[row + rank], x[row + rank], b[row + j], y[row + j]);
  recv[j * E + e] = own + overlap(a[row + j], x[row + j], b[row + rank], y[row + rank]);
}

__global__ void table_kernel(const int64_t* __restrict__ ws, int64_t E, int64_t N, int64_t* __restrict__ out) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * N * E) return;
  const int64_t e = idx % E, j = (idx / E) % N, i = idx / (E * N);
  const int64_t row = e * N;
  const int64_t* local = ws + 2 * E * N;
  const int64_t* x = ws + 3 * E * N;
  const int64_t* y = ws + 4 * E * N;
  const int64_t* a = ws + 5 * E * N;
  const int64_t* b = ws + 6 * E * N;
  out[idx] = (i == j ? local[row + i] : 0) + overlap(a[row + i], x[row + i], b[row + j], y[row + j]);
}

unsigned int grid_for(int64_t n) { return static_cast<unsigned int>((n + kBlock - 1) / kBlock); }

}  // namespace

cudaError_t launch_plan(const int64_t* R, const int64_t* T, int64_t E, int64_t N, int64_t* ws,
                        cudaStream_t stream) {
  if (E == 0 || N == 0) return cudaSuccess;
  plan_kernel<<<static_cast<unsigned int>(E), kBlock, 0, stream>>>(R, T, E, N, ws);
  return cudaGetLastError();
}

cudaError_t launch_rank(const int64_t* ws, int64_t E, int64_t N, int64_t rank, int64_t* send,
                        int64_t* recv, cudaStream_t stream) {
  if (E == 0 || N == 0) return cudaSuccess;
  rank_kernel<<<grid_for(E * N), kBlock, 0, stream>>>(ws, E, N, rank, send, recv);
  return cudaGetLastError();
}

cudaError_t launch_table(const int64_t* ws, int64_t E, int64_t N, int64_t* out, cudaStream_t stream) {
  if (E == 0 || N == 0) return cudaSuccess;
  table_kernel<<<grid_for(N * N * E), kBlock, 0, stream>>>(ws, E, N, out);
  return cudaGetLastError();
}

}  // namespace lazarus_dispatch
