// CUDA registrations of the lazarus dispatcher ops. Compiled only when torch has CUDA and
// a GPU is present (see lazarus/dispatch/_build.py); the kernels live in
// dispatch_kernels.cu, the op schemas in dispatch.cpp.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dispatch_kernels.h"
#include "dispatch_msg.h"

namespace {

using lazarus_dispatch::msg;   // error messages without iostreams (dispatch_msg.h)

// Shapes, dtypes and devices: metadata only, never a host sync.
void check_count_shapes_cuda(const at::Tensor& R, const at::Tensor& T) {
  TORCH_CHECK_VALUE(R.dim() == 2, msg("replicas must be a 2-D [E, N] tensor, got ", R.dim(), " dims"));
  TORCH_CHECK_VALUE(T.dim() == 2, msg("tokens must be a 2-D [E, N] tensor, got ", T.dim(), " dims"));
  TORCH_CHECK_VALUE(R.sizes() == T.sizes(), msg("replicas ", R.sizes(), " and tokens ", T.sizes(),
                    " must have the same [E, N] shape"));
  TORCH_CHECK_VALUE(R.scalar_type() == at::kLong && T.scalar_type() == at::kLong,
                    "replicas and tokens must be int64");
  TORCH_CHECK_VALUE(R.is_cuda() && T.is_cuda() && R.device() == T.device(),
                    "replicas and tokens must be on the same CUDA device");
}

// Values: every condition evaluated on the device, read back with ONE host sync.
void check_count_values_cuda(const at::Tensor& R, const at::Tensor& T) {
  if (R.numel() == 0) return;
  const auto bad = at::stack({(R < 0).any(), (T < 0).any(),
                              at::logical_and(R.sum(1) == 0, T.sum(1) > 0).any()}).cpu();
  const bool* b = bad.data_ptr<bool>();
  TORCH_CHECK_VALUE(!b[0], "replicas must be non-negative");
  TORCH_CHECK_VALUE(!b[1], "tokens must be non-negative");
  TORCH_CHECK_VALUE(!b[2], "tokens routes tokens to an expert with zero replicas");
}

void check_cuda(cudaError_t err) { TORCH_CHECK(err == cudaSuccess, msg("lazarus dispatch kernel: ", cudaGetErrorString(err))); }

at::Tensor plan(const at::Tensor& R, const at::Tensor& T) {
  const int64_t E = R.size(0), N = R.size(1);
  auto ws = at::empty({lazarus_dispatch::plan_workspace_size(E, N)}, R.options());
  check_cuda(lazarus_dispatch::launch_plan(R.data_ptr<int64_t>(), T.data_ptr<int64_t>(), E, N,
                                           ws.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()));
  return ws;
}

at::Tensor dispatch_table_cuda(const at::Tensor& replicas, const at::Tensor& tokens, bool check) {
  check_count_shapes_cuda(replicas, tokens);
  if (check) check_count_values_cuda(replicas, tokens);
  const c10::cuda::CUDAGuard guard(replicas.device());
  const auto R = replicas.contiguous();
  const auto T = tokens.contiguous();
  const int64_t E = R.size(0), N = R.size(1);
  const auto ws = plan(R, T);
  auto out = at::empty({N, N, E}, R.options());
  check_cuda(lazarus_dispatch::launch_table(ws.data_ptr<int64_t>(), E, N, out.data_ptr<int64_t>(),
                                            c10::cuda::getCurrentCUDAStream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> dispatch_rank_cuda(const at::Tensor& replicas, const at::Tensor& tokens,
                                                      int64_t rank, bool check) {
  check_count_shapes_cuda(replicas, tokens);
  if (check) check_count_values_cuda(replicas, tokens);
  const c10::cuda::CUDAGuard guard(replicas.device());
  const auto R = replicas.contiguous();
  const auto T = tokens.contiguous();
  const int64_t E = R.size(0), N = R.size(1);
  TORCH_CHECK_VALUE(rank >= 0 && rank < N, msg("rank must be in [0, ", N - 1, "], got ", rank));
  const auto ws = plan(R, T);
  auto send = at::empty({N, E}, R.options());
  auto recv = at::empty({N, E}, R.options());
  check_cuda(lazarus_dispatch::launch_rank(ws.data_ptr<int64_t>(), E, N, rank, send.data_ptr<int64_t>(),
                                           recv.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()));
  return {send, recv};
}

// Same order as the CPU op, with ATen primitives: stable sort by expert, then chunks of
// send[j][e] tokens of expert e laid out destination-major. No host sync without `check`:
// the tokens per expert are send's column sums (equal to the experts' counts for a valid
// send), and every size passed to repeat_interleave is known on the host (M).
at::Tensor dispatch_permutation_cuda(const at::Tensor& experts, const at::Tensor& send, bool check) {
  TORCH_CHECK_VALUE(experts.dim() == 1 && experts.scalar_type() == at::kLong,
                    "experts must be a 1-D int64 tensor of expert ids");
  TORCH_CHECK_VALUE(send.dim() == 2 && send.scalar_type() == at::kLong, "send must be a 2-D int64 [N, E] tensor");
  const c10::cuda::CUDAGuard guard(experts.device());
  const int64_t M = experts.numel(), E = send.size(1);
  const auto sd = send.to(experts.device());
  const auto counts = sd.sum(0);
  if (check && M > 0) {
    // bincount would sync for its size; a scatter of ones into E + 1 bins (the last one
    // for ids out of range) does not. One host read for every condition.
    const auto in_range = at::logical_and(experts >= 0, experts < E);
    const auto bins = at::where(in_range, experts, at::full_like(experts, E));
    const auto routed = at::zeros({E + 1}, experts.options()).scatter_add_(0, bins, at::ones_like(experts));
    const auto bad = at::stack({at::logical_not(in_range).any(), (sd < 0).any(),
                                (routed.slice(0, 0, E) != counts).any()}).cpu();
    const bool* b = bad.data_ptr<bool>();
    TORCH_CHECK_VALUE(!b[0], msg("experts holds ids outside [0, ", E - 1, "]"));
    TORCH_CHECK_VALUE(!b[1], "send must be non-negative");
    TORCH_CHECK_VALUE(!b[2], "send does not send exactly the tokens experts routes");
  }
  const auto grouped = std::get<1>(experts.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const auto group_start = counts.cumsum(0) - counts;
  const auto within = sd.cumsum(0) - sd;  // tokens of e sent to lower ranks
  const auto sizes = sd.flatten();
  const auto starts = (group_start.unsqueeze(0) + within).flatten();
  const auto offsets = sizes.cumsum(0) - sizes;
  const auto pos = at::arange(M, experts.options()) - at::repeat_interleave(offsets, sizes, 0, M);
  return grouped.index_select(0, at::repeat_interleave(starts, sizes, 0, M) + pos);
}

}  // namespace

TORCH_LIBRARY_IMPL(lazarus, CUDA, m) {
  m.impl("dispatch_table", &dispatch_table_cuda);
  m.impl("dispatch_rank", &dispatch_rank_cuda);
  m.impl("dispatch_permutation", &dispatch_permutation_cuda);
}
