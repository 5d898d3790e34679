"""``moc`` command line: inspect, verify and export checkpoints.

    moc inspect URL [--step N] [--units] [--png FILE] [--memory DIR] [--json]
    moc verify  URL [--step N]
    moc export  URL [--step N] [--format torch|safetensors|dcp] -o OUT
                [--max-shard-size 5GB] [--hf-config config.json] [--allow-fallback]

URL is a path, file://, s3://BUCKET/PREFIX (credentials and endpoint from the AWS_*
environment variables or --endpoint-url) or memory://. Errors (bad input included) print
one line and exit 2; ``verify`` exits 1 when any object is bad; ``export`` exits 1, removing
what it wrote, when a unit's version is unreadable and an older one would be exported in
its place, unless ``--allow-fallback``. Progress bars (tqdm) go
to stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NoReturn, Sequence

from storage_backends import open_store

from ._export import pick_manifest
from ._export.formats import FORMATS
from ._inspect import (find_folders, format_memory, format_summary, format_units, header_lines, human, memory_report,
                       summarize)
from ._store import CheckpointStore

__all__ = ["main", "summarize"]


@contextmanager
def _bar(label: str, enabled: bool | None = None) -> Iterator[Callable[[int, int], None] | None]:
    """A tqdm progress bar over bytes on stderr, shown only when stderr is a terminal;
    yields the ``progress(done, total)`` callback the library calls (None when hidden)."""
    if not (sys.stderr.isatty() if enabled is None else enabled):
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(desc=label, total=0, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               dynamic_ncols=True)

    def update(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
            bar.refresh()
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        bar.close()


def _open(args: argparse.Namespace) -> CheckpointStore:
    opts: dict[str, Any] = {}
    url = args.url
    if "://" not in url or url.startswith("file://"):
        opts["create"] = False
    if args.endpoint_url:
        opts["endpoint_url"] = args.endpoint_url
    return CheckpointStore(open_store(url, **opts))


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.memory is not None and args.step is not None:
        raise ValueError("--step cannot be combined with --memory: restore() always starts from the newest step")
    if args.memory is not None:
        find_folders(args.memory)  # a bad --memory path fails before the store is read
    cs = _open(args)
    # --memory previews a restore, which starts from the newest readable manifest.
    manifest = cs.latest_manifest() if args.memory is not None else pick_manifest(cs, args.step)
    info = summarize(cs, manifest) if manifest is not None else None
    memory = memory_report(args.memory, manifest) if args.memory is not None else None
    png = None
    if args.png is not None:
        if manifest is None:
            raise FileNotFoundError(f"--png: no committed checkpoint in {cs.store.url} to plot")
        from ._inspect.plot import write_heatmap  # matplotlib only when asked for

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
    else:
        assert info is not None     # without --memory, pick_manifest found one (it raises otherwise)
        lines = format_units(info) if args.units else format_summary(info)
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
    with _bar("verify") as progress:
        problems = cs.verify(args.step, progress=progress)
    if problems:
        for p in problems:
            print(f"BAD {p}")
        print(f"moc verify: {len(problems)} bad object(s) in {cs.store.url}", file=sys.stderr)
        return 1
    steps = [args.step] if args.step is not None else cs.steps()
    print(f"OK {cs.store.url}: steps {', '.join(map(str, steps))} verified")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ._export.formats import export

    cs = _open(args)
    existed = os.path.exists(args.output)
    with _bar(f"export {args.format}") as progress:
        res = export(cs, args.format, args.output, step=args.step, max_shard_size=args.max_shard_size,
                     hf_config=args.hf_config, progress=progress)
    level = "warning" if args.allow_fallback else "error"
    for unit, bad, used in res.fallbacks:
        print(f"moc export: {level}: unit {unit}: the version of step {bad} is unreadable; "
              f"{'exported' if args.allow_fallback else 'only'} its version of step {used}"
              f"{'' if args.allow_fallback else ' is left'}", file=sys.stderr)
    if res.fallbacks and not args.allow_fallback:
        _remove_output(args.output, res.files, existed)
        units = sorted({u for u, _, _ in res.fallbacks})
        print(f"moc export: error: step {res.step} is not exportable as saved: {len(units)} unit(s) unreadable "
              f"there ({', '.join(units[:3])}{', ...' if len(units) > 3 else ''}); the export would mix in older "
              f"versions, so it was removed. `moc verify {args.url}` names the bad objects; pass --allow-fallback "
              f"to export the older versions anyway (what restore() loads), or --step an older step.",
              file=sys.stderr)
        return 1
    if res.skipped:
        print(f"moc export: warning: {len(res.skipped)} non-tensor entries not written by {res.format} "
              f"(e.g. {res.skipped[0]})", file=sys.stderr)
    where = res.path if res.format == "torch" else f"{res.path} ({', '.join(res.files[:3])}" + \
        (f", ... {len(res.files)} files)" if len(res.files) > 3 else ")")
    print(f"exported step {res.step} ({res.tensors} tensors, {human(res.nbytes)}) as {res.format} to {where}")
    return 0


def _remove_output(output: str, files: list[str], existed: bool) -> None:
    """Remove what an export wrote: the whole output when it did not exist before, else
    the files it wrote there (a folder may hold the user's own files)."""
    if not existed:
        if os.path.isdir(output):
            shutil.rmtree(output, ignore_errors=True)
        elif os.path.exists(output):
            os.remove(output)
        return
    if os.path.isfile(output):
        os.remove(output)
        return
    for name in files:
        path = name if os.path.isabs(name) else os.path.join(output, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr, exit 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _size(text: str) -> int:
    from ._export.formats import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="moc", description="Inspect, verify and export moc checkpoints.")
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
    p = sub.add_parser("export", help="write the checkpoint as torch.save, safetensors or DCP (streamed)",
                       description="Write the newest (or --step) checkpoint in another format, tensor by tensor: "
                       "torch (one file, torch.load(weights_only=True)), safetensors (model weights under the "
                       "model's own names: transformers from_pretrained loads the folder once it holds "
                       "config.json) or dcp (torch.distributed.checkpoint.load, model and optimizer).")
    common(p)
    p.add_argument("--format", default="torch", choices=FORMATS, help="output format (default: torch)")
    p.add_argument("-o", "--output", required=True,
                   help="output: a file for --format torch, a folder for safetensors and dcp")
    p.add_argument("--max-shard-size", type=_size, default="5GB",
                   help="safetensors: start a new shard past this size (default 5GB; e.g. 500MB, 2GiB)")
    p.add_argument("--hf-config", default=None, metavar="FILE",
                   help="safetensors: a transformers config.json (or a folder holding one) to copy in")
    p.add_argument("--allow-fallback", action="store_true",
                   help="when a unit's saved version is unreadable, export its newest readable older version "
                        "(as restore() does) and exit 0 with a warning; default: exit 1 and remove the output")
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
