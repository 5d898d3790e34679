"""Store throughput vs raw file I/O and plain boto3, and what zstd compression buys.

    python benchmarks/store/main.py [--mib 256] [--s3-mib 64] [--reps 3]

Writes benchmarks/store/results.md and benchmarks/store/throughput.png and prints the
table. Every baseline is measured in the same run on the same bytes:

* local disk: ``os.write`` (+ ``os.fsync``) of a new file vs ``LocalStore.write`` (temp
  file, fsync, rename) and vs the full checkpoint path (``CheckpointStore.save``: encode,
  checksum, write, commit); reads: ``readinto`` a preallocated buffer vs ``Store.read``
  vs ``CheckpointStore.load`` (checksum verified, tensors rebuilt). Reads come from the
  page cache for all of them.
* S3 (moto server on 127.0.0.1): ``boto3`` ``put_object`` / ``upload_fileobj`` (multipart)
  / ``get_object`` vs ``S3Store`` doing the same.
* compression: zstd level 3 without and with byte-plane shuffle on bf16 and fp32 weights.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from moc import CheckpointStore  # noqa: E402
from moc._store.codec import compress, decompress, encode_tree  # noqa: E402
from storage_backends import open_store  # noqa: E402

MiB = 2**20


def timed(fn, reps: int, setup=None) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs (``setup()`` runs untimed before each)."""
    times = []
    for _ in range(reps + 1):  # the first run warms up and is dropped
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def make_units(total_mib: int, dtype: torch.dtype) -> dict:
    """Expert-sized tensors (4 MiB each) like a trained model's weights."""
    g = torch.Generator().manual_seed(0)
    per = 4 * MiB // torch.empty((), dtype=dtype).element_size()
    n = max(1, total_mib // 4)
    return {f"expert/l0/{i}": ({"model": {f"l0.experts.{i}.w": (torch.randn(per, generator=g) * 0.02).to(dtype)}},
                               {"kind": "expert", "layer": "l0", "expert": i}) for i in range(n)}


def raw_bytes(units: dict) -> list[memoryview]:
    out = []
    for tree, _ in units.values():
        for t in tree["model"].values():
            out.append(memoryview(t.view(torch.uint8).numpy()).cast("B"))
    return out


def bench_local(root: Path, mib: int, reps: int) -> list[tuple[str, float, float]]:
    units = make_units(mib, torch.float32)
    bufs = raw_bytes(units)
    nbytes = sum(len(b) for b in bufs)
    rows = []

    def raw_write(fsync: bool):
        fd = os.open(root / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        for b in bufs:
            view = b
            while len(view):
                view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
        os.close(fd)

    target = memoryview(bytearray(nbytes))

    def raw_read():
        # The best raw case: a buffer allocated (and faulted in) once, filled with readinto.
        out = target
        with open(root / "raw.bin", "rb", buffering=0) as f:
            done = 0
            while done < nbytes:
                done += f.readinto(out[done:])

    def clear(path: Path):
        # Every write goes to a file that does not exist yet, as a new checkpoint does.
        return lambda: shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    for fsync in (True, False):
        label = "fsync" if fsync else "no fsync"
        t_raw = timed(lambda: raw_write(fsync), reps, setup=clear(root / "raw.bin"))
        store = open_store(root / "store", fsync=fsync)
        t_store = timed(lambda: store.write("obj.bin", bufs), reps,
                        setup=lambda: store.delete("obj.bin", missing_ok=True))
        cs = CheckpointStore(open_store(root / "ckpt", fsync=fsync))
        t_ckpt = timed(lambda: cs.save(0, units), reps, setup=clear(root / "ckpt"))
        rows.append((f"local write ({label}): os.write", nbytes / t_raw / MiB, 1.0))
        rows.append((f"local write ({label}): Store.write", nbytes / t_store / MiB, t_raw / t_store))
        rows.append((f"local write ({label}): CheckpointStore.save", nbytes / t_ckpt / MiB, t_raw / t_ckpt))
    store.write("obj.bin", bufs)
    cs = CheckpointStore(open_store(root / "ckpt"))
    cs.save(0, units)
    def raw_read_new():
        with open(root / "raw.bin", "rb", buffering=0) as f:
            return f.read()

    t_new = timed(raw_read_new, reps)
    t_store = timed(lambda: store.read("obj.bin"), reps)
    t_raw = timed(raw_read, reps)
    t_into = timed(lambda: store.read_into("obj.bin", target), reps)
    t_load = timed(lambda: cs.load(), reps)
    rows.append(("local read into new bytes: f.read", nbytes / t_new / MiB, 1.0))
    rows.append(("local read into new bytes: Store.read", nbytes / t_store / MiB, t_new / t_store))
    rows.append(("local read, reused buffer: readinto", nbytes / t_raw / MiB, 1.0))
    rows.append(("local read, reused buffer: Store.read_into", nbytes / t_into / MiB, t_raw / t_into))
    rows.append(("local read: CheckpointStore.load (verified, vs readinto)", nbytes / t_load / MiB, t_raw / t_load))
    return rows


def bench_s3(mib: int, reps: int) -> list[tuple[str, float, float]]:
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                              region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        import io

        from boto3.s3.transfer import TransferConfig

        units = make_units(mib, torch.float32)
        bufs = raw_bytes(units)
        blob = b"".join(bufs)
        n = len(blob)
        part = 16 * MiB
        opts = dict(endpoint_url=endpoint, key="x", secret="x", region="us-east-1")
        single = open_store("s3://bench/single", part_size=max(part, n), **opts)
        multi = open_store("s3://bench/multi", part_size=part, upload_concurrency=8, **opts)
        transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=8)
        t_put = timed(lambda: client.put_object(Bucket="bench", Key="boto.bin", Body=blob), reps)
        t_single = timed(lambda: single.write("store.bin", bufs), reps)
        t_boto_mp = timed(lambda: client.upload_fileobj(io.BytesIO(blob), "bench", "boto-mp.bin", Config=transfer),
                          reps)
        t_multi = timed(lambda: multi.write("store.bin", bufs), reps)
        t_get = timed(lambda: client.get_object(Bucket="bench", Key="boto.bin")["Body"].read(), reps)
        t_read = timed(lambda: single.read("store.bin"), reps)
        return [("s3 (moto) write: boto3 put_object", n / t_put / MiB, 1.0),
                ("s3 (moto) write: S3Store.write (one PUT)", n / t_single / MiB, t_put / t_single),
                ("s3 (moto) write: boto3 upload_fileobj (16 MiB parts, 8 threads)", n / t_boto_mp / MiB, 1.0),
                ("s3 (moto) write: S3Store.write (16 MiB parts, 8 in flight)", n / t_multi / MiB, t_boto_mp / t_multi),
                ("s3 (moto) read: boto3 get_object", n / t_get / MiB, 1.0),
                ("s3 (moto) read: S3Store.read (s3fs)", n / t_read / MiB, t_get / t_read)]
    finally:
        server.stop()


def bench_compression(mib: int) -> list[tuple[str, float, float, float]]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        units = make_units(mib, dtype)
        enc = encode_tree({k: v[0] for k, v in units.items()})
        for label, itemsize in (("zstd", 1), ("zstd + shuffle", enc.itemsize)):
            t0 = time.perf_counter()
            stored = compress(enc.buffers, "zstd", itemsize=itemsize)
            t_c = time.perf_counter() - t0
            t0 = time.perf_counter()
            decompress(stored, "zstd", raw_nbytes=enc.nbytes, itemsize=itemsize)
            t_d = time.perf_counter() - t0
            name = str(dtype).replace("torch.", "")
            rows.append((f"{name}: {label}", enc.nbytes / len(stored), enc.nbytes / t_c / MiB, enc.nbytes / t_d / MiB))
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import fsspec
    import s3fs

    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
            f"fsspec {fsspec.__version__}, s3fs {s3fs.__version__}")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    labels = [r[0] for r in rows]
    ax.barh(range(len(rows)), [r[1] for r in rows],
            color=["#999999" if r[2] == 1.0 else "#1f77b4" for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MiB/s (grey: baseline)")
    ax.set_title("Store throughput vs raw baselines (same bytes, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes per local measurement")
    ap.add_argument("--s3-mib", type=int, default=64, help="bytes per S3 measurement")
    ap.add_argument("--compress-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="moc-bench-", dir=args.dir))
    try:
        rows = bench_local(root, args.mib, args.reps) + bench_s3(args.s3_mib, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    comp = bench_compression(args.compress_mib)
    lines = [f"Machine: {machine()}", "",
             f"Local: {args.mib} MiB of fp32 in 4 MiB tensors, median of {args.reps}; S3: {args.s3_mib} MiB.", "",
             "| operation | MiB/s | vs baseline |", "|---|---:|---:|"]
    lines += [f"| {name} | {mbps:,.0f} | {ratio:.2f}x |" for name, mbps, ratio in rows]
    lines += ["", f"Compression on {args.compress_mib} MiB of N(0, 0.02) weights (zstd level 3):", "",
              "| data | ratio (raw/stored) | compress MiB/s | decompress MiB/s |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {ratio:.3f} | {c:,.0f} | {d:,.0f} |" for name, ratio, c, d in comp]
    lines += ["", "Rerun: `make bench-store` (or `python benchmarks/store/main.py`)."]
    text = "\n".join(lines)
    (HERE / "results.md").write_text(text + "\n")
    plot(rows, HERE / "throughput.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
