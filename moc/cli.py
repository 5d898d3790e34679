"""``moc`` command line: inspect, verify and export checkpoints.

    moc inspect URL [--step N] [--units] [--png FILE] [--memory DIR] [--json]
    moc verify  URL [--step N]
    moc export  URL [--step N] [--format torch|safetensors|dcp] -o OUT [--max-shard-size 5GB] [--hf-config F]

URL is a path, file://, s3://BUCKET/PREFIX (credentials and endpoint from the AWS_*
environment variables or --endpoint-url) or memory://. Errors print one line and exit 2;
``verify`` exits 1 when any object is bad.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

from storage_backends import open_store

from ._ckpt_store import CheckpointStore
from ._format import Manifest
from ._inspect import format_summary, format_units, header_lines, human, summarize
from ._inspect_memory import find_folders, format_memory, memory_report

__all__ = ["main", "summarize"]


class _Progress:
    """A one-line progress bar on stderr for long reads (only when stderr is a terminal)."""

    def __init__(self, label: str, enabled: bool | None = None) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {human(done)}/{human(total)}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _open(args: argparse.Namespace) -> CheckpointStore:
    opts: dict[str, Any] = {}
    url = args.url
    if "://" not in url or url.startswith("file://"):
        opts["create"] = False
    if args.endpoint_url:
        opts["endpoint_url"] = args.endpoint_url
    return CheckpointStore(open_store(url, **opts))


def _pick(cs: CheckpointStore, step: int | None) -> Manifest:
    if step is not None:
        return cs.read_manifest(step)
    manifest = cs.latest_manifest()
    if manifest is None:
        raise FileNotFoundError(f"no committed checkpoint in {cs.store.url}")
    return manifest


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.memory is not None and args.step is not None:
        raise ValueError("--step cannot be combined with --memory: restore() always starts from the newest step")
    if args.memory is not None:
        find_folders(args.memory)  # a bad --memory path fails before the store is read
    cs = _open(args)
    # --memory previews a restore, which starts from the newest readable manifest.
    manifest = cs.latest_manifest() if args.memory is not None else _pick(cs, args.step)
    info = summarize(cs, manifest) if manifest is not None else None
    memory = memory_report(args.memory, manifest) if args.memory is not None else None
    png = None
    if args.png is not None:
        if manifest is None:
            raise FileNotFoundError(f"--png: no committed checkpoint in {cs.store.url} to plot")
        from ._inspect_plot import write_heatmap  # matplotlib only when asked for

        png = write_heatmap(manifest, args.png, url=cs.store.url)
    if args.json:
        out = dict(info or {"url": cs.store.url, "steps": cs.steps()})
        if memory is not None:
            out["memory"] = memory
        if png is not None:
            out["png"] = {"path": args.png, **png}
        print(json.dumps(out, indent=2))
        return 0
    if memory is not None:
        lines = ([] if info is None else header_lines(info)) + format_memory(memory)
    elif args.units:
        lines = format_units(info)
    else:
        lines = format_summary(info)
    print("\n".join(lines))
    if png is not None:
        print(f"heatmap  {args.png} ({png['width']} x {png['height']} px)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    cs = _open(args)
    if args.step is not None:
        cs.read_manifest(args.step)  # a missing step is bad input, not a bad object
    elif not cs.steps():
        raise FileNotFoundError(f"no committed checkpoint in {cs.store.url}")
    problems = cs.verify(args.step, progress=_Progress("verify"))
    if problems:
        for p in problems:
            print(f"BAD {p}")
        print(f"moc verify: {len(problems)} bad object(s) in {cs.store.url}", file=sys.stderr)
        return 1
    steps = [args.step] if args.step is not None else cs.steps()
    print(f"OK {cs.store.url}: steps {', '.join(map(str, steps))} verified")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ._export import export_dcp, export_safetensors, export_torch, parse_size

    max_shard = parse_size(args.max_shard_size)
    if args.hf_config is not None and not os.path.isfile(args.hf_config):
        raise FileNotFoundError(f"--hf-config {args.hf_config} does not exist")
    if args.hf_config is not None and args.format != "safetensors":
        raise ValueError("--hf-config goes with --format safetensors")
    cs = _open(args)
    bar = _Progress("export")
    if args.format == "torch":
        info = export_torch(cs, args.output, args.step, progress=bar)
    elif args.format == "safetensors":
        info = export_safetensors(cs, args.output, args.step, max_shard_size=max_shard, hf_config=args.hf_config,
                                  progress=bar)
    else:
        info = export_dcp(cs, args.output, args.step, progress=bar)
    print(f"exported step {info['step']} ({info['tensors']} tensors, {args.format}) to {args.output}")
    return 0


def _tensors(tree: Any):
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moc", description="Inspect, verify and export moc checkpoints.")
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("url", help="checkpoint store: path, file://, s3://BUCKET/PREFIX or memory://")
        p.add_argument("--step", type=int, default=None, help="step to use (default: newest)")
        p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: $AWS_ENDPOINT_URL)")

    p = sub.add_parser("inspect", help="per-layer summary of expert ages, sizes and PLT; --units, --png, --memory")
    common(p)
    p.add_argument("--json", action="store_true", help="print everything as JSON (the summary under 'summary')")
    p.add_argument("--units", action="store_true", help="one line per unit instead of the per-layer summary")
    p.add_argument("--png", metavar="FILE", default=None,
                   help="write a heatmap of expert ages (layers x experts) with PLT per layer")
    p.add_argument("--memory", metavar="DIR", default=None,
                   help="snapshot directory (e.g. /dev/shm/moc-<key>, one rank's folder, an agent's "
                        "--snapshot-dir): its buffers and what restore() would take from memory or storage")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="re-read every object and check its checksum")
    common(p)
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("export", help="write the model (and optimizer) in torch, safetensors or DCP format")
    common(p)
    p.add_argument("-o", "--output", required=True, help="output file (torch) or folder (safetensors, dcp)")
    p.add_argument("--format", default="torch", choices=["torch", "safetensors", "dcp"],
                   help="torch: one torch.load(weights_only=True) file; safetensors: from_pretrained-loadable "
                        "folder; dcp: torch.distributed.checkpoint folder")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (e.g. 500MB, 5GB)")
    p.add_argument("--hf-config", default=None, help="config.json copied next to the safetensors files")
    p.set_defaults(func=cmd_export)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # output piped into head & co.
        return 0
    except KeyboardInterrupt:
        print("moc: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, no traceback, for any failure
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"moc {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
