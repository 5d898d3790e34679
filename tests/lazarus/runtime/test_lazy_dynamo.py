"""The worker's deferred ``torch._dynamo`` import (lazarus.runtime.worker._lazy_dynamo), each case
in a fresh interpreter (pytest's own process may have imported dynamo already)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _run(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(300)
def test_training_with_torch_optim_never_imports_dynamo_and_compile_still_works() -> None:
    out = _run("""
        import sys, torch
        from lazarus.runtime.worker._lazy_dynamo import defer_dynamo_import, dynamo_loaded
        assert defer_dynamo_import()
        import torch.distributed as dist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)   # clears trace_rules' caches
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)]
        for opt in opts:
            for _ in range(3):
                opt.zero_grad()
                m(torch.randn(4, 8)).sum().backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                t = torch.ones(2)
                dist.all_reduce(t)
            opt.load_state_dict(opt.state_dict())
        print("loaded after training:", dynamo_loaded(), "torch._dynamo" in sys.modules and
              type(sys.modules["torch._dynamo"]).__name__)
        f = torch.compile(lambda x: (x * 2).sin(), backend="eager")
        print("compiled:", f(torch.ones(2)).tolist() == (torch.ones(2) * 2).sin().tolist(), dynamo_loaded())
        import torch._dynamo as d
        print("real:", type(sys.modules["torch._dynamo"]).__name__, d is sys.modules["torch._dynamo"],
              torch._dynamo is d, hasattr(d, "config"))
        # a function disabled through the stand-in now goes through torch's own wrapper
        opts[0].zero_grad()
        made = getattr(torch.optim.Optimizer.zero_grad.__wrapped__, "__dynamo_disable")
        cells = dict(zip(made.__code__.co_freevars, (c.cell_contents for c in made.__closure__)))
        print("wrapped:", len(cells["resolved"]) == 1 and cells["resolved"][0] is not cells["fn"])
        torch.compile(lambda: opts[0].step(), backend="eager")()
        print("compiled step ok")
    """)
    assert "loaded after training: False _DeferredDynamo" in out, out
    assert "compiled: True True" in out, out
    assert "real: module True True True" in out, out
    assert "wrapped: True" in out and "compiled step ok" in out, out


@pytest.mark.timeout(300)
def test_the_deferral_can_be_turned_off_and_never_replaces_a_loaded_dynamo() -> None:
    out = _run("""
        import torch
        from lazarus.runtime.worker._lazy_dynamo import defer_dynamo_import, dynamo_loaded
        print("off:", defer_dynamo_import(), dynamo_loaded())
    """, LAZARUS_DEFER_DYNAMO="0")
    assert "off: False False" in out, out
    out = _run("""
        import torch, torch._dynamo, sys
        from lazarus.runtime.worker._lazy_dynamo import defer_dynamo_import
        real = sys.modules["torch._dynamo"]
        print("loaded first:", defer_dynamo_import(), sys.modules["torch._dynamo"] is real)
    """)
    assert "loaded first: False True" in out, out
