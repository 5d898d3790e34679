// Host launchers of the CUDA dispatcher kernels (dispatch_kernels.cu). No torch here: the
// torch binding (dispatch_cuda.cpp) passes raw device pointers and its current stream.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace lazarus_dispatch {

// Words of int64 workspace the plan needs: seven [E, N] arrays.
inline int64_t plan_workspace_size(int64_t E, int64_t N) { return 7 * E * N; }

// One block per expert: capacities (largest remainder), local/excess/residual counts and
// their exclusive prefix sums over ranks, written to ws.
cudaError_t launch_plan(const int64_t* R, const int64_t* T, int64_t E, int64_t N, int64_t* ws,
                        cudaStream_t stream);

// One thread per (expert, rank): send[N, E] and recv[N, E] of `rank` from a computed plan.
cudaError_t launch_rank(const int64_t* ws, int64_t E, int64_t N, int64_t rank, int64_t* send,
                        int64_t* recv, cudaStream_t stream);

// One thread per (source, destination, expert): the full [N, N, E] table from a plan.
cudaError_t launch_table(const int64_t* ws, int64_t E, int64_t N, int64_t* out, cudaStream_t stream);

}  // namespace lazarus_dispatch
