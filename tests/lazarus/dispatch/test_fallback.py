"""The compiled dispatcher is only used where it runs: the CUDA build's cache key names the
GPU (compute capability) and the CUDA version it was built for, a build that loads but
cannot run (probed at load, or failing at its first real use) falls back to the torch
implementation with ONE warning, and the answers stay the torch implementation's.

Without a GPU the CUDA probe cannot run here: the failing op stands in for a CUDA build
made for another GPU, raising what that raises ("no kernel image is available for
execution on the device", a RuntimeError), at the same place.
"""

from __future__ import annotations

import logging

import pytest
import torch

from lazarus.dispatch import _api, _build, _torch_impl, dispatch_counts, dispatch_permutation

SRC = _build.csrc_dir()
NO_KERNEL = "CUDA error: no kernel image is available for execution on the device"


def test_the_cuda_cache_key_names_the_gpu_and_the_cuda_version(monkeypatch) -> None:
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    h100 = _build.cuda_build_key((9, 0), "12.8")
    a100 = _build.cuda_build_key((8, 0), "12.8")
    h100_cu126 = _build.cuda_build_key((9, 0), "12.6")
    assert (h100, a100, h100_cu126) == ("sm90-cu12.8", "sm80-cu12.8", "sm90-cu12.6")
    names = {_build.build_name(SRC, True, key) for key in (h100, a100, h100_cu126)}
    assert len(names) == 3                                    # three builds, never one for another
    assert _build.build_name(SRC, True, h100).startswith("lazarus_dispatch_cuda_sm90_")
    assert _build.build_name(SRC, True, h100) == _build.build_name(SRC, True, h100)   # stable
    assert _build.build_name(SRC, False) == f"lazarus_dispatch_cpu_{_build._tag(SRC, False)}"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")  # what the build compiles for then
    assert _build.cuda_build_key((9, 0), "12.8") == "arch80_90_PTX-cu12.8"


def _fresh_state(monkeypatch) -> None:
    monkeypatch.setattr(_build, "_state", None)
    monkeypatch.setattr(_build, "_disabled_warned", set())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "lazarus" in r.name]


def test_a_build_that_loads_but_cannot_run_falls_back_with_one_warning(monkeypatch, caplog) -> None:
    """The library loads (the C++ op of this machine), the CUDA probe fails as a build for
    another GPU does: CUDA tensors dispatch with the torch implementation, one warning."""
    _fresh_state(monkeypatch)
    if _build._missing_tools(SRC, False):
        pytest.fail(f"no C++ toolchain to build the op here: {_build._missing_tools(SRC, False)}")
    monkeypatch.setattr(_build, "_cuda_usable", lambda: True)
    real_compile = _build._compile                 # the build this machine can make: the C++ op
    monkeypatch.setattr(_build, "_compile", lambda src, with_cuda: real_compile(src, False))
    real_probe = _build._probe
    monkeypatch.setattr(_build, "_probe", lambda device: NO_KERNEL if device == "cuda" else real_probe(device))
    with caplog.at_level(logging.WARNING):
        state = _build.load_ops()
        again = _build.load_ops()
    assert state is again and state.cpp and not state.cuda
    assert "does not run on this GPU" in state.reason and "no kernel image" in state.reason
    assert _api.dispatch_device(torch.device("cuda", 0)) == torch.device("cpu")   # host dispatch instead
    warned = _warnings(caplog)
    assert len(warned) == 1 and "torch implementation" in warned[0], warned


def test_an_op_failing_at_first_use_is_disabled_with_one_warning(monkeypatch, caplog) -> None:
    state = _build.load_ops()
    if not state.cpp:
        pytest.fail(f"the C++ op did not load here: {state.reason}")
    monkeypatch.setattr(_build, "_disabled_warned", set())
    monkeypatch.setattr(state, "cpp", True)     # restored afterwards: the real op stays usable
    monkeypatch.setattr(state, "reason", "")
    calls = []

    class Broken:
        def __getattr__(self, name):
            def op(*args, **kwargs):
                calls.append(name)
                raise RuntimeError(NO_KERNEL)
            return op

    monkeypatch.setattr(_api.torch.ops, "lazarus", Broken())
    g = torch.Generator().manual_seed(1)
    R = torch.randint(0, 3, (6, 3), generator=g)
    R[:, 0] += (R.sum(1) == 0).long()
    T = torch.randint(0, 50, (6, 3), generator=g)
    with caplog.at_level(logging.WARNING):
        send, recv = dispatch_counts(R, T, 1)
        table = dispatch_counts(R, T)
        experts = torch.repeat_interleave(torch.arange(6), T[:, 1])
        perm = dispatch_permutation(experts, send)
    ref_send, ref_recv = _torch_impl.dispatch_rank(R, T, 1)
    assert torch.equal(send, ref_send) and torch.equal(recv, ref_recv)
    assert torch.equal(table, _torch_impl.dispatch_table(R, T))
    assert torch.equal(perm, _torch_impl.dispatch_permutation(experts, ref_send))
    assert calls == ["dispatch_rank"]           # disabled after the first failure, never called again
    assert not state.cpp and "failed at use" in state.reason and "no kernel image" in state.reason
    warned = _warnings(caplog)
    assert len(warned) == 1 and "no kernel image" in warned[0], warned
    with pytest.raises(RuntimeError, match="not available"):     # a forced compiled op says why
        dispatch_counts(R, T, 1, backend="cpp")


def test_bad_input_is_the_callers_error_not_a_reason_to_fall_back(monkeypatch) -> None:
    state = _build.load_ops()
    if not state.cpp:
        pytest.fail(f"the C++ op did not load here: {state.reason}")
    with pytest.raises(ValueError, match="non-negative"):
        dispatch_counts(torch.tensor([[1, -1]]), torch.tensor([[1, 1]]), 0)
    with pytest.raises(ValueError, match=r"ids in \[0, 1\]"):
        dispatch_permutation(torch.tensor([0, 2]), torch.tensor([[2, 0]]))
    with pytest.raises(ValueError, match="exactly the tokens"):
        dispatch_permutation(torch.tensor([0, 1]), torch.tensor([[2, 0]]))
    assert _build.load_ops().cpp                 # still in use
