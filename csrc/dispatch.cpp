// Lazarus token dispatcher (Algorithm 1) as torch.library ops, CPU implementation.
//
//   lazarus::dispatch_table(Tensor replicas, Tensor tokens, bool check=True) -> Tensor   [N_src, N_dst, E]
//   lazarus::dispatch_rank(Tensor replicas, Tensor tokens, int rank, bool check=True) -> (Tensor send, Tensor recv)
//   lazarus::dispatch_permutation(Tensor experts, Tensor send, bool check=True) -> Tensor   gather order
//
// `check`: validate the values (non-negative counts, no tokens for an expert without
// replicas, ids in range, send consistent with experts). The CPU op always does (it costs
// nothing and its loops index by those values); on CUDA the checks need one host sync, so
// callers that validated already, or that produced the inputs themselves (the MoE layer,
// which checks on the device and reads the verdict with its one sync), pass false.
//
// replicas = R[E, N] and tokens = T[E, N] are int64. The rounding rule is documented in
// dispatch_core.h; the pure-torch fallback in lazarus/dispatch/_torch_impl.py reproduces
// it bit for bit, and the CUDA kernels (dispatch_kernels.cu) compute the same numbers with
// experts x ranks in parallel.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "dispatch_core.h"
#include "dispatch_msg.h"

namespace {

using lazarus_dispatch::msg;   // error messages without iostreams (dispatch_msg.h)

using lazarus_dispatch::beats;
using lazarus_dispatch::overlap;

// Per-expert quantities of the rounding rule, reused across experts of one worker thread.
struct ExpertPlan {
  std::vector<int64_t> q, rem, more, local, x, y, a, b;
  std::vector<int64_t> cand;
  explicit ExpertPlan(int64_t n)
      : q(n), rem(n), more(n), local(n), x(n), y(n), a(n), b(n) { cand.reserve(n); }

  // Fill every vector for expert row (R, T) of length n.
  void compute(const int64_t* R, const int64_t* T, int64_t n) {
    int64_t r = 0, t = 0;
    for (int64_t j = 0; j < n; ++j) { r += R[j]; t += T[j]; }
    int64_t sum_q = 0;
    cand.clear();
    for (int64_t j = 0; j < n; ++j) {
      if (r > 0) {
        const int64_t num = t * R[j];
        q[j] = num / r;
        rem[j] = num % r;
      } else {
        q[j] = 0;
        rem[j] = 0;
      }
      more[j] = T[j] > q[j] ? 1 : 0;
      sum_q += q[j];
      if (rem[j] > 0) cand.push_back(j);
    }
    const int64_t leftover = t - sum_q;  // < number of ranks with rem > 0
    if (leftover > 0 && leftover < static_cast<int64_t>(cand.size())) {
      auto cmp = [this](int64_t k, int64_t j) { return beats(rem[k], more[k], k, rem[j], more[j], j); };
      std::nth_element(cand.begin(), cand.begin() + leftover, cand.end(), cmp);
    }
    for (int64_t k = 0; k < leftover; ++k) q[cand[k]] += 1;  // q now holds the capacities
    int64_t acc_x = 0, acc_y = 0;
    for (int64_t j = 0; j < n; ++j) {
      local[j] = std::min(q[j], T[j]);
      x[j] = T[j] - local[j];
      y[j] = q[j] - local[j];
      a[j] = acc_x;
      b[j] = acc_y;
      acc_x += x[j];
      acc_y += y[j];
    }
  }
};

void check_counts(const at::Tensor& R, const at::Tensor& T) {
  TORCH_CHECK_VALUE(R.dim() == 2, msg("replicas must be a 2-D [E, N] tensor, got ", R.dim(), " dims"));
  TORCH_CHECK_VALUE(T.dim() == 2, msg("tokens must be a 2-D [E, N] tensor, got ", T.dim(), " dims"));
  TORCH_CHECK_VALUE(R.sizes() == T.sizes(), msg("replicas ", R.sizes(), " and tokens ", T.sizes(),
                    " must have the same [E, N] shape"));
  TORCH_CHECK_VALUE(R.scalar_type() == at::kLong && T.scalar_type() == at::kLong,
                    "replicas and tokens must be int64");
  TORCH_CHECK_VALUE(R.device().is_cpu() && T.device().is_cpu(), "expected CPU tensors");
  if (R.numel() == 0) return;
  TORCH_CHECK_VALUE(R.min().item<int64_t>() >= 0, "replicas must be non-negative");
  TORCH_CHECK_VALUE(T.min().item<int64_t>() >= 0, "tokens must be non-negative");
  const auto orphan = at::logical_and(R.sum(1) == 0, T.sum(1) > 0);
  TORCH_CHECK_VALUE(!orphan.any().item<bool>(), msg("tokens routes tokens to an expert with zero replicas (expert ",
                    orphan.nonzero().flatten()[0].item<int64_t>(), ")"));
}

int64_t grain(int64_t n) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(n, 1)); }

at::Tensor dispatch_table_cpu(const at::Tensor& replicas, const at::Tensor& tokens, bool /*check*/) {
  check_counts(replicas, tokens);
  const auto R = replicas.contiguous();
  const auto T = tokens.contiguous();
  const int64_t E = R.size(0), N = R.size(1);
  auto out = at::zeros({N, N, E}, R.options());
  const int64_t* Rp = R.data_ptr<int64_t>();
  const int64_t* Tp = T.data_ptr<int64_t>();
  int64_t* D = out.data_ptr<int64_t>();
  at::parallel_for(0, E, grain(N), [&](int64_t begin, int64_t end) {
    ExpertPlan p(N);
    for (int64_t e = begin; e < end; ++e) {
      p.compute(Rp + e * N, Tp + e * N, N);
      for (int64_t i = 0; i < N; ++i) {
        D[(i * N + i) * E + e] = p.local[i];
        if (p.x[i] == 0) continue;
        for (int64_t j = 0; j < N; ++j) {
          if (p.y[j] == 0) continue;
          D[(i * N + j) * E + e] += overlap(p.a[i], p.x[i], p.b[j], p.y[j]);
        }
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> dispatch_rank_cpu(const at::Tensor& replicas, const at::Tensor& tokens,
                                                     int64_t rank, bool /*check*/) {
  check_counts(replicas, tokens);
  const auto R = replicas.contiguous();
  const auto T = tokens.contiguous();
  const int64_t E = R.size(0), N = R.size(1);
  TORCH_CHECK_VALUE(rank >= 0 && rank < N, msg("rank must be in [0, ", N - 1, "], got ", rank));
  auto send = at::zeros({N, E}, R.options());
  auto recv = at::zeros({N, E}, R.options());
  const int64_t* Rp = R.data_ptr<int64_t>();
  const int64_t* Tp = T.data_ptr<int64_t>();
  int64_t* S = send.data_ptr<int64_t>();
  int64_t* V = recv.data_ptr<int64_t>();
  at::parallel_for(0, E, grain(N), [&](int64_t begin, int64_t end) {
    ExpertPlan p(N);
    for (int64_t e = begin; e < end; ++e) {
      p.compute(Rp + e * N, Tp + e * N, N);
      S[rank * E + e] = p.local[rank];
      V[rank * E + e] = p.local[rank];
      const int64_t xi = p.x[rank], yi = p.y[rank];
      for (int64_t j = 0; j < N; ++j) {
        if (xi > 0 && p.y[j] > 0) S[j * E + e] += overlap(p.a[rank], xi, p.b[j], p.y[j]);
        if (yi > 0 && p.x[j] > 0) V[j * E + e] += overlap(p.a[j], p.x[j], p.b[rank], yi);
      }
    }
  });
  return {send, recv};
}

at::Tensor dispatch_permutation_cpu(const at::Tensor& experts, const at::Tensor& send, bool /*check*/) {
  TORCH_CHECK_VALUE(experts.dim() == 1 && experts.scalar_type() == at::kLong,
                    "experts must be a 1-D int64 tensor of expert ids");
  TORCH_CHECK_VALUE(send.dim() == 2 && send.scalar_type() == at::kLong, "send must be a 2-D int64 [N, E] tensor");
  const auto ex = experts.contiguous();
  const auto sd = send.contiguous();
  const int64_t M = ex.numel(), N = sd.size(0), E = sd.size(1);
  const int64_t* xp = ex.data_ptr<int64_t>();
  const int64_t* sp = sd.data_ptr<int64_t>();
  std::vector<int64_t> count(E, 0), start(E, 0), cursor(E, 0);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK_VALUE(xp[m] >= 0 && xp[m] < E, msg("experts holds id ", xp[m], " outside [0, ", E - 1, "]"));
    count[xp[m]] += 1;
  }
  for (int64_t e = 0; e < E; ++e) {
    int64_t s = 0;
    for (int64_t j = 0; j < N; ++j) {
      TORCH_CHECK_VALUE(sp[j * E + e] >= 0, "send must be non-negative");
      s += sp[j * E + e];
    }
    TORCH_CHECK_VALUE(s == count[e], msg("send sends ", s, " tokens of expert ", e, " but experts routes ", count[e]));
    if (e > 0) start[e] = start[e - 1] + count[e - 1];
  }
  // Stable counting sort: tokens of each expert in their original order.
  std::vector<int64_t> grouped(M);
  for (int64_t e = 0; e < E; ++e) cursor[e] = start[e];
  for (int64_t m = 0; m < M; ++m) grouped[cursor[xp[m]]++] = m;
  // Destination-major, then expert: expert e's next send[j][e] tokens go to rank j.
  auto perm = at::empty({M}, ex.options());
  int64_t* out = perm.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) cursor[e] = start[e];
  int64_t pos = 0;
  for (int64_t j = 0; j < N; ++j) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = sp[j * E + e];
      std::copy(grouped.begin() + cursor[e], grouped.begin() + cursor[e] + n, out + pos);
      cursor[e] += n;
      pos += n;
    }
  }
  return perm;
}

}  // namespace

TORCH_LIBRARY(lazarus, m) {
  m.def("dispatch_table(Tensor replicas, Tensor tokens, bool check=True) -> Tensor");
  m.def("dispatch_rank(Tensor replicas, Tensor tokens, int rank, bool check=True) -> (Tensor, Tensor)");
  m.def("dispatch_permutation(Tensor experts, Tensor send, bool check=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(lazarus, CPU, m) {
  m.impl("dispatch_table", &dispatch_table_cpu);
  m.impl("dispatch_rank", &dispatch_rank_cpu);
  m.impl("dispatch_permutation", &dispatch_permutation_cpu);
}
