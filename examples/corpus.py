"""A real, offline, byte-level text corpus: the running interpreter's standard library.

:class:`ByteCorpus` concatenates the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
(sorted by relative path; ``site-packages``, ``dist-packages``, ``test``/``tests``,
``idle_test`` and ``__pycache__`` directories skipped) into one ``uint8`` tensor, capped at
``max_bytes``. The last ``val_fraction`` (5%) of it is the validation split, the rest the
training split. Nothing is downloaded; the same interpreter always yields the same bytes.

Data stream (what makes elastic training reproducible): the *global* batch of step ``s``
is ``batch_size`` windows of ``seq_len + 1`` bytes whose start offsets are drawn with a
generator seeded by ``(seed, s)`` only. Rank ``r`` of a world of ``W`` ranks takes the
sequences ``r, r + W, r + 2W, ...`` (``offsets[r::W]``) of that global batch. So:

* the global batch of a step never depends on the world size; after a reconfiguration
  from ``W`` to ``W'`` ranks the ranks of step ``s`` jointly see exactly the sequences an
  uninterrupted (or single-process) run sees at step ``s``;
* the ranks' slices partition the global batch; when ``batch_size`` is divisible by
  ``W`` they are equal, and the mean of the per-rank mean losses (what averaged
  gradients optimise) is exactly the mean loss over the global batch. Otherwise slices
  differ by one sequence; weight a rank's loss by ``local / batch_size * W`` (see
  :meth:`ByteCorpus.local_batch_size`) for the exact global mean.

The concatenated bytes are cached under ``~/.cache/lazarus/corpus/`` (override with
``cache_dir`` or ``$LAZARUS_CORPUS_CACHE``), keyed by the Python version, the stdlib
location and the cap, with a CRC check, so a new process loads the corpus in a few
milliseconds. An unwritable or corrupt cache is ignored and the files are read instead.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import sys
import sysconfig
import tempfile
import zlib
from pathlib import Path

import torch

__all__ = ["ByteCorpus", "stdlib_source_files", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_MAGIC = b"LZCORPUS1\n"
_MASK64 = (1 << 64) - 1
_TRAIN_STREAM = 0x7472
_VAL_STREAM = 0x76616C


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


def _mix(*parts: int) -> int:
    """Stable 63-bit seed from integers (splitmix64 chain); never Python's salted hash()."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h >> 1


def stdlib_source_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The ``.py`` files of the standard library, sorted by path relative to ``root``
    (default: this interpreter's stdlib), third-party and test directories skipped."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ValueError(f"standard library directory {str(base)!r} does not exist")
    rel: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        here = Path(dirpath).relative_to(base)
        rel.extend((here / f).as_posix() for f in filenames if f.endswith(".py"))
    return [base / r for r in sorted(rel)]


def _read_sources(files: list[Path], max_bytes: int) -> tuple[bytes, int]:
    parts: list[bytes] = []
    total = 0
    used = 0
    for path in files:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable file: skipped the same way on every run
        if not data:
            continue
        data = data[: max_bytes - total]
        parts.append(data)
        total += len(data)
        used += 1
    return b"".join(parts), used


def _default_cache_dir() -> Path:
    env = os.environ.get("LAZARUS_CORPUS_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "lazarus" / "corpus"


def _cache_name(stdlib: str, max_bytes: int) -> str:
    impl = sys.implementation.name
    ver = "{}.{}.{}".format(*sys.version_info[:3])
    where = hashlib.sha256(os.path.realpath(stdlib).encode()).hexdigest()[:12]
    return f"stdlib-{impl}{ver}-{where}-cap{max_bytes}.bin"


def _load_cache(path: Path) -> tuple[bytes, int] | None:
    try:
        with open(path, "rb") as f:
            if f.readline() != _MAGIC:
                return None
            meta = json.loads(f.readline())
            data = f.read()
    except (OSError, ValueError):
        return None
    if len(data) != meta.get("nbytes") or zlib.crc32(data) != meta.get("crc32"):
        return None
    return data, int(meta.get("files", 0))


def _store_cache(path: Path, data: bytes, files: int) -> bool:
    meta = {"nbytes": len(data), "crc32": zlib.crc32(data), "files": files, "python": sys.version}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC)
            f.write(json.dumps(meta).encode() + b"\n")
            f.write(data)
        os.replace(tmp, path)  # atomic: concurrent ranks never see a partial file
        return True
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


class ByteCorpus:
    """Byte-level language-modelling corpus with a deterministic, rank-sliced data stream.

    Args:
        max_bytes: cap on the corpus size (bytes; the last file is cut to fit).
        val_fraction: trailing fraction used for validation, in (0, 0.5].
        cache_dir: where the concatenated bytes are cached (default
            ``$LAZARUS_CORPUS_CACHE`` or ``~/.cache/lazarus/corpus``).
        use_cache: ``False`` always reads the source files and writes no cache.
        stdlib: directory to read instead of this interpreter's stdlib (tests).

    Attributes:
        data: uint8 [N] all bytes; ``train``/``val``: views of the two splits.
        num_files: source files that contributed; ``from_cache``: loaded from the cache.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        val_fraction: float = 0.05,
        cache_dir: str | os.PathLike[str] | None = None,
        use_cache: bool = True,
        stdlib: str | os.PathLike[str] | None = None,
    ) -> None:
        max_bytes = _check_int("max_bytes", max_bytes, 1024)
        root = str(stdlib if stdlib is not None else sysconfig.get_paths()["stdlib"])
        cache_path = Path(cache_dir if cache_dir is not None else _default_cache_dir()) / _cache_name(root, max_bytes)
        loaded = _load_cache(cache_path) if use_cache else None
        self.from_cache = loaded is not None
        if loaded is None:
            loaded = _read_sources(stdlib_source_files(root), max_bytes)
            if use_cache:
                _store_cache(cache_path, *loaded)
        data, self.num_files = loaded
        self.max_bytes = max_bytes
        self.cache_path = cache_path if use_cache else None
        self._init_splits(data, val_fraction)

    @classmethod
    def from_bytes(cls, data: bytes, *, val_fraction: float = 0.05) -> "ByteCorpus":
        """A corpus over given bytes (no files, no cache)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"data must be bytes, got {type(data).__name__}")
        self = cls.__new__(cls)
        self.from_cache = False
        self.num_files = 0
        self.max_bytes = len(data)
        self.cache_path = None
        self._init_splits(bytes(data), val_fraction)
        return self

    def _init_splits(self, data: bytes, val_fraction: float) -> None:
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real) or not 0 < val_fraction <= 0.5:
            raise ValueError(f"val_fraction must be a number in (0, 0.5], got {val_fraction!r}")
        if len(data) < 2:
            raise ValueError(f"the corpus needs at least 2 bytes, got {len(data)}")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        n_val = max(1, int(round(len(data) * float(val_fraction))))
        self.val_fraction = float(val_fraction)
        self.train = self.data[: len(data) - n_val]
        self.val = self.data[len(data) - n_val :]

    def __len__(self) -> int:
        return int(self.data.numel())

    def __repr__(self) -> str:
        return (f"ByteCorpus({len(self)} bytes from {self.num_files} files, train {self.train.numel()}, "
                f"val {self.val.numel()}, cached={self.from_cache})")

    # ----- batches ---------------------------------------------------------------------------
    @staticmethod
    def local_batch_size(rank: int, world: int, batch_size: int) -> int:
        """Sequences rank ``rank`` gets of a global batch of ``batch_size`` (``r::W`` slice)."""
        world = _check_int("world", world, 1)
        rank = _check_int("rank", rank, 0, world - 1)
        batch_size = _check_int("batch_size", batch_size, 1)
        return len(range(rank, batch_size, world))

    def _draw(self, split: torch.Tensor, name: str, stream: int, index: int, rank: int, world: int,
              batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = _check_int("step" if stream == _TRAIN_STREAM else "index", index, 0)
        world = _check_int("world", world, 1)
        rank = _check_int("rank", rank, 0, world - 1)
        batch_size = _check_int("batch_size", batch_size, 1)
        if batch_size < world:
            raise ValueError(
                f"batch_size (the global batch) = {batch_size} is smaller than world = {world}: every rank "
                f"needs at least one sequence"
            )
        seq_len = _check_int("seq_len", seq_len, 1)
        seed = _check_int("seed", seed, 0)
        n = int(split.numel())
        if seq_len + 1 > n:
            raise ValueError(f"seq_len = {seq_len} needs {seq_len + 1} bytes but the {name} split has {n}")
        gen = torch.Generator().manual_seed(_mix(seed, stream, index))
        starts = torch.randint(0, n - seq_len, (batch_size,), generator=gen)[rank::world]
        windows = split[starts[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def batch(self, step: int, rank: int, world: int, batch_size: int, seq_len: int, *,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Training inputs and next-byte targets of rank ``rank`` at step ``step``.

        Args:
            step: training step (>= 0); with ``seed`` it alone fixes the global batch.
            rank, world: this rank's slot; it gets sequences ``rank::world`` of the global
                batch (so ``world`` must not exceed ``batch_size``).
            batch_size: GLOBAL batch size (sequences over all ranks).
            seq_len: sequence length.

        Returns:
            ``(x, y)`` int64 ``[local, seq_len]`` with ``y[:, t] = x[:, t + 1]`` shifted
            along the corpus; ``local = local_batch_size(rank, world, batch_size)``.
        """
        return self._draw(self.train, "train", _TRAIN_STREAM, step, rank, world, batch_size, seq_len, seed)

    def validation_batch(self, index: int, rank: int, world: int, batch_size: int, seq_len: int, *,
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`batch` on the validation split; ``index`` numbers the evaluation
        batches (a stream independent of the training one)."""
        return self._draw(self.val, "validation", _VAL_STREAM, index, rank, world, batch_size, seq_len, seed)
