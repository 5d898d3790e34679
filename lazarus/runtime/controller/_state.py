"""The controller's durable state: what a restarted controller needs to resume its job.

One JSON file, ``state.json``, in the state directory, replaced atomically on every
change that matters (a plan issued or applied, a worker done, the job finished) and at
most once a second for routing history: written to a temporary file in the same
directory, fsynced, renamed over the old one, and the directory fsynced. A reader sees
the old state or the new one, never a torn file. JSON only: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["STATE_FILE", "STATE_VERSION", "read_state", "write_state"]

STATE_FILE = "state.json"
STATE_VERSION = 1

# field -> (allowed types, may be None)
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "version": ((int,), False),
    "epoch": ((int,), False),
    "port": ((int,), False),
    "store_port": ((int,), False),
    "generation": ((int,), False),
    "plan": ((dict,), True),
    "members": ((list,), False),
    "stalled": ((bool,), False),
    "applied_gen": ((int,), False),
    "holdings": ((dict,), False),
    "model": ((dict,), True),
    "routing": ((dict,), False),
    "last_step": ((int,), True),
    "last_rebalance_step": ((int,), False),
    "done": ((list,), False),
    "left": ((list,), False),
    "finished": ((bool,), False),
}


def encode_state(state: dict[str, Any]) -> bytes:
    """The state file's bytes for ``state``."""
    return json.dumps(dict(state, version=STATE_VERSION), separators=(",", ":")).encode("utf-8")


def write_state(directory: str | os.PathLike[str], state: dict[str, Any] | bytes) -> Path:
    """Atomically replace ``directory/state.json`` with ``state`` (temp + fsync + rename);
    ``state`` may be :func:`encode_state`'s bytes already."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    data = state if isinstance(state, bytes) else encode_state(state)
    fd, tmp = tempfile.mkstemp(prefix=".state-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, d / STATE_FILE)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return d / STATE_FILE


def read_state(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The state saved in ``directory`` (None when there is none).

    Raises:
        ValueError: the file is not a controller state this version can resume from
            (the message names the file and the field).
    """
    path = Path(directory) / STATE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"state_dir: cannot read {path}: {exc.strerror}") from None
    try:
        state = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"state_dir: {path} is not JSON ({exc}); move it away to start a new job") from None
    if not isinstance(state, dict):
        raise ValueError(f"state_dir: {path} must hold a JSON object, got {type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"state_dir: {path} has version {state.get('version')!r}; this controller reads "
                         f"version {STATE_VERSION}")
    for name, (types, nullable) in _FIELDS.items():
        value = state.get(name)
        if value is None and nullable and name in state:
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            allowed = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
            raise ValueError(f"state_dir: {path}: field {name!r} must be {allowed}, got {value!r:.80}")
    if not all(isinstance(m, str) for m in state["members"]):
        raise ValueError(f"state_dir: {path}: field 'members' must be a list of node ids")
    return state
