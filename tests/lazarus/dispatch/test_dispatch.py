"""Dispatcher (Algorithm 1): known cases, bad input, C++ vs torch, build fallback, nvcc."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lazarus.dispatch import compiled_backend, dispatch_counts, dispatch_permutation, load_ops

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "csrc"
BACKENDS = ["cpp", "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param == "cpp" and not load_ops().cpp:
        pytest.skip(f"C++ op not built: {load_ops().reason}")
    return request.param


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")
def test_compiled_op_loads_here() -> None:
    # With a compiler and ninja present the C++ op must build, not silently fall back.
    state = load_ops()
    assert state.cpp, state.reason
    assert compiled_backend() in ("cpp", "cuda")


def test_hand_checked_case(backend: str) -> None:
    # Expert 0: replicas on ranks 0 and 1, 7 tokens (5 on rank 0, 2 on rank 2). Fair share
    # 3.5 each; the leftover token goes to rank 0, which has local tokens beyond its floor.
    # Expert 1: ranks 1 (x1) and 2 (x2), 7 tokens (3, 3, 1): capacities 7/3, 14/3 -> 2, 5.
    R = torch.tensor([[1, 1, 0], [0, 1, 2]])
    T = torch.tensor([[5, 0, 2], [3, 3, 1]])
    table = dispatch_counts(R, T, backend=backend)
    expected = torch.zeros(3, 3, 2, dtype=torch.int64)
    expected[0, 0, 0] = 4  # rank 0 keeps 4 of its own
    expected[0, 1, 0] = 1  # and sends 1 to rank 1
    expected[2, 1, 0] = 2  # rank 2 has no replica of expert 0
    expected[0, 2, 1] = 3  # rank 0 has no replica of expert 1
    expected[1, 1, 1] = 2
    expected[1, 2, 1] = 1
    expected[2, 2, 1] = 1
    torch.testing.assert_close(table, expected)
    for i in range(3):
        send, recv = dispatch_counts(R, T, rank=i, backend=backend)
        torch.testing.assert_close(send, table[i])
        torch.testing.assert_close(recv, table[:, i])


def test_replicas_on_one_rank_take_the_larger_share(backend: str) -> None:
    R = torch.tensor([[2, 1]])
    T = torch.tensor([[0, 30]])
    table = dispatch_counts(R, T, backend=backend)
    assert table.sum(0)[:, 0].tolist() == [20, 10]


@pytest.mark.parametrize(
    "R, T, match",
    [
        (torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 2, dtype=torch.int64), "R has shape"),
        (torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3), "T must have an integer dtype"),
        (torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64), "R must be 2-D"),
        (-torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64), "R must be non-negative"),
        (torch.ones(2, 3, dtype=torch.int64), -torch.ones(2, 3, dtype=torch.int64), "T must be non-negative"),
        (torch.tensor([[1, 1], [0, 0]]), torch.tensor([[1, 1], [0, 3]]), r"zero replicas in R: \[1\]"),
        ([[1]], torch.ones(1, 1, dtype=torch.int64), "R must be an integer torch.Tensor"),
    ],
)
def test_bad_input_names_the_argument(R, T, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dispatch_counts(R, T)


@pytest.mark.parametrize("rank", [-1, 3, 1.0, True])
def test_bad_rank(rank) -> None:
    with pytest.raises(ValueError, match="rank must be an integer in"):
        dispatch_counts(torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64), rank)


def test_compiled_op_rejects_bad_values_itself() -> None:
    # Called directly (bypassing the Python checks) the op still refuses bad values.
    if not load_ops().cpp:
        pytest.skip("compiled op unavailable")
    with pytest.raises(ValueError):
        torch.ops.lazarus.dispatch_rank(torch.tensor([[0]]), torch.tensor([[4]]), 0)


def test_zero_replica_expert_without_tokens_is_fine(backend: str) -> None:
    R = torch.tensor([[1, 1], [0, 0]])
    T = torch.tensor([[3, 1], [0, 0]])
    assert int(dispatch_counts(R, T, backend=backend)[:, :, 1].sum()) == 0


def test_cpp_and_torch_agree_at_scale() -> None:
    if not load_ops().cpp:
        pytest.skip("C++ op not built")
    g = torch.Generator().manual_seed(0)
    E, N = 64, 256
    R = torch.randint(0, 3, (E, N), generator=g)
    R[:, 0] += 1
    T = torch.randint(0, 200, (E, N), generator=g) * torch.randint(0, 2, (E, N), generator=g)
    for i in (0, 17, N - 1):
        s1, r1 = dispatch_counts(R, T, i, backend="cpp")
        s2, r2 = dispatch_counts(R, T, i, backend="torch")
        assert torch.equal(s1, s2) and torch.equal(r1, r2)
        assert torch.equal(s1.sum(0), T[:, i])


def test_permutation_groups_by_destination_then_expert(backend: str) -> None:
    experts = torch.tensor([2, 0, 1, 0, 2, 0, 1, 2, 2])
    send = torch.tensor([[1, 0, 2], [2, 1, 0], [0, 1, 2]])  # [N_dst, E]
    perm = dispatch_permutation(experts, send, backend=backend)
    assert sorted(perm.tolist()) == list(range(9))
    # dst 0: expert 0 x1, expert 2 x2; dst 1: expert 0 x2, expert 1 x1; dst 2: expert 1, expert 2 x2
    assert experts[perm].tolist() == [0, 2, 2, 0, 0, 1, 1, 2, 2]
    # Within an expert, original order; the first send[0, e] go to rank 0.
    assert perm.tolist() == [1, 0, 4, 3, 5, 2, 6, 7, 8]


def test_permutation_bad_input() -> None:
    with pytest.raises(ValueError, match="send must send exactly"):
        dispatch_permutation(torch.tensor([0, 1]), torch.tensor([[2, 0]]))
    with pytest.raises(ValueError, match="experts must hold ids"):
        dispatch_permutation(torch.tensor([0, 5]), torch.tensor([[1, 1]]))


def _run_isolated(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=110)


_PROBE = """
    import logging, torch
    logging.basicConfig(level=logging.WARNING)
    from lazarus.dispatch import dispatch_counts, load_ops, compiled_backend
    R = torch.tensor([[1, 1], [1, 0]]); T = torch.tensor([[3, 1], [0, 2]])
    print(compiled_backend(), dispatch_counts(R, T, 0)[0].tolist())
"""


@pytest.mark.timeout(120)
def test_missing_sources_fall_back_with_warning(tmp_path: Path) -> None:
    out = _run_isolated(_PROBE, {"LAZARUS_CSRC": str(tmp_path / "nowhere"), "LAZARUS_EXT_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "torch"
    assert "pure-torch fallback" in out.stderr and "[rank -]" in out.stderr


@pytest.mark.timeout(120)
def test_broken_build_falls_back_with_warning(tmp_path: Path) -> None:
    src = tmp_path / "csrc"
    shutil.copytree(CSRC, src)
    (src / "dispatch.cpp").write_text("#error deliberately broken\n")
    out = _run_isolated(_PROBE, {"LAZARUS_CSRC": str(src), "LAZARUS_EXT_DIR": str(tmp_path / "ext")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "torch"
    assert "build failed" in out.stderr
    good = _run_isolated(_PROBE, {"LAZARUS_DISPATCH_BACKEND": "torch"})
    assert good.stdout.split(maxsplit=1)[1] == out.stdout.split(maxsplit=1)[1]


def test_backend_env_is_validated() -> None:
    out = _run_isolated(_PROBE, {"LAZARUS_DISPATCH_BACKEND": "fortran"})
    assert out.returncode != 0 and "LAZARUS_DISPATCH_BACKEND must be one of" in out.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.timeout(120)
def test_cuda_kernels_compile_with_nvcc(tmp_path: Path) -> None:
    # Pure CUDA source (no torch headers): compiles here even without a GPU.
    obj = tmp_path / "dispatch_kernels.o"
    out = subprocess.run(["nvcc", "-std=c++17", "-c", str(CSRC / "dispatch_kernels.cu"), "-I", str(CSRC),
                          "-o", str(obj)], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    assert obj.stat().st_size > 0
