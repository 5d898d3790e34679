"""Counting the host syncs a piece of code would make on a GPU, on the CPU.

On a GPU a host sync is a read of device memory by the host: ``.item()``, ``.tolist()``,
``.cpu()``, ``bool()``/``int()``/``float()`` of a tensor, ``.numpy()``, and the ops whose
output size depends on the values (``nonzero``, ``bincount``, ``unique``,
``masked_select``, ``repeat_interleave`` without ``output_size``, ``equal``). Run on the
CPU, the same code makes none of them visibly, so :class:`SyncAudit` records them:

* every host read of a tensor NOT produced by :func:`lazarus.moe._host.to_host` (the
  dispatch's one sanctioned read) or computed from one (such tensors live on the host on a
  GPU too, and reading them costs nothing);
* every value-dependent-size op, on any tensor;
* the calls of ``to_host``.

The code under audit must run its device path on the CPU: the MoE layer does (its
dispatcher runs where the tokens are, the CPU here).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = {"tolist", "cpu", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_aten = torch.ops.aten
SIZE_FROM_VALUES = {_aten.nonzero.default, _aten.bincount.default, _aten.equal.default,
                    _aten.masked_select.default, _aten._unique2.default, _aten.unique_consecutive.default,
                    _aten.unique_dim.default}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _is_host(t: torch.Tensor) -> bool:
    return bool(getattr(t, "_lz_host", False))


def _tag(tree: Any) -> None:
    for t in _tensors(tree):
        try:
            t._lz_host = True
        except (AttributeError, RuntimeError):
            pass


class _Reads(TorchFunctionMode):
    def __init__(self, audit: "SyncAudit") -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        host = any(_is_host(t) for t in _tensors((args, kwargs)))
        if name in HOST_READS and not host and self.audit.depth == 0:
            self.audit.device_reads.append(name)
        out = func(*args, **kwargs)
        if host:
            _tag(out)
        return out


class _Ops(TorchDispatchMode):
    def __init__(self, audit: "SyncAudit") -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SIZE_FROM_VALUES or (func is _aten.repeat_interleave.Tensor
                                        and kwargs.get("output_size") is None):
            self.audit.sync_ops.append(str(func))
        return func(*args, **kwargs)


class SyncAudit:
    """``with SyncAudit() as a: ...`` then ``a.device_reads``, ``a.sync_ops``,
    ``a.to_host_calls``; :attr:`syncs` is what a GPU would have paid."""

    def __init__(self) -> None:
        self.device_reads: list[str] = []
        self.sync_ops: list[str] = []
        self.to_host_calls = 0
        self.depth = 0
        self._patched: list[tuple[Any, Any]] = []

    @property
    def syncs(self) -> int:
        return len(self.device_reads) + len(self.sync_ops)

    def __enter__(self) -> "SyncAudit":
        from lazarus.moe import _host, _layer

        real = _host.to_host

        def to_host(t: torch.Tensor) -> torch.Tensor:
            self.to_host_calls += 1
            self.device_reads.append("to_host")
            self.depth += 1
            try:
                out = real(t)
            finally:
                self.depth -= 1
            _tag(out)
            return out

        for mod in (_host, _layer):
            self._patched.append((mod, mod.to_host))
            mod.to_host = to_host
        self._modes = [_Reads(self), _Ops(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        for mod, fn in self._patched:
            mod.to_host = fn
