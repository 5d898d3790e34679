"""A worker reaches its S3 checkpoint storage once, before it joins, and never inside a
reconfiguration (issue 28's soak: a node joining while S3 hung opened storage inside the
join's reconfiguration, past the other ranks' collective timeout, and every new plan
failed the same way). Real moto behind a proxy that hangs."""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from lazarus.runtime.worker._reconfigure import Reconfigurer
from moc import CheckpointManager, MoCConfig
from tests.helpers.moc_helpers import make
from storage_backends.testing import StorageProxy


def _worker(cfg: MoCConfig, rendezvous_s: float = 2.0) -> SimpleNamespace:
    """What probe_storage reads of a Reconfigurer: its config and its worker's name."""
    return SimpleNamespace(config=SimpleNamespace(moc=cfg, rendezvous_timeout=timedelta(seconds=rendezvous_s)),
                           ctx=SimpleNamespace(where="n9"))


@pytest.mark.timeout(120)
def test_probe_is_bounded_and_managers_then_open_hung_storage_without_a_request(s3, tmp_path, caplog):
    proxy = StorageProxy(s3.port).start()
    try:
        cfg = MoCConfig(storage="s3://ckpt/run", storage_options=dict(s3.options, endpoint_url=proxy.url),
                        snapshot_dir=str(tmp_path / "shm"), interval=1, k_snapshot=2, k_persist=1)
        proxy.hang()
        t0 = time.monotonic()
        Reconfigurer.probe_storage(_worker(cfg, rendezvous_s=2.0))
        assert time.monotonic() - t0 < 6.0, "the probe waited out the hung endpoint"
        assert proxy.requests >= 1   # it did try
        assert "unreachable at start" in caplog.text and "no answer within 2 s" in caplog.text
        assert cfg.storage_options["check"] is False
        model, opt, _ = make(0)
        before = proxy.requests
        t0 = time.monotonic()
        m = CheckpointManager(cfg, model=model, optimizer=opt)   # what a reconfiguration builds
        assert proxy.requests == before, "opening the manager sent a request to storage"
        assert time.monotonic() - t0 < 10.0
        proxy.heal()
        m.close()
    finally:
        proxy.close()


@pytest.mark.timeout(120)
def test_probe_passes_a_healthy_store_and_raises_on_a_missing_bucket(s3, tmp_path):
    ok = MoCConfig(storage="s3://ckpt/run", storage_options=dict(s3.options), snapshot_dir=str(tmp_path / "a"))
    Reconfigurer.probe_storage(_worker(ok))
    assert ok.storage_options["check"] is False
    bad = MoCConfig(storage="s3://no-such-bucket/run", storage_options=dict(s3.options),
                    snapshot_dir=str(tmp_path / "b"))
    with pytest.raises(Exception) as err:   # a configuration error, not "unreachable": the worker stops
        Reconfigurer.probe_storage(_worker(bad))
    assert not isinstance(err.value, (ConnectionError, TimeoutError))
    assert "no-such-bucket" in str(err.value)
    assert "check" not in bad.storage_options
    local = MoCConfig(storage=str(tmp_path / "store"), snapshot_dir=str(tmp_path / "c"))
    Reconfigurer.probe_storage(_worker(local))   # only S3 is probed
    assert "check" not in local.storage_options
