"""The ``lazarus`` console script.

Subcommands register themselves in ``SUBCOMMANDS`` (name -> registrar); a registrar adds
its parser to the subparsers object and sets ``handler`` to a function taking the parsed
namespace and returning an exit status. Adding a subcommand is one function and one
dict entry.

Bad input never shows a traceback: the user sees one line ``lazarus <cmd>: error: ...``
on stderr and the exit status is 2.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad command line or input file; reported as one line, exit status 2."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors become ``UsageError`` instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


# ----------------------------------------------------------------------------- plan


def _parse_loads_arg(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of numbers like 5,3,1,1, got {text!r}"
        ) from None


def _read_loads_file(path: str) -> list[list[float]] | dict[str, list[float]]:
    """JSON (list of lists, or {layer: list}) or CSV (one row per layer)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"--loads-file: cannot read {path}: {exc.strerror}") from None
    if p.suffix.lower() == ".json" or text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--loads-file: invalid JSON in {path}: {exc.msg} (line {exc.lineno})") from None
        if isinstance(data, dict):
            return {str(k): _numbers(v, f"layer {k}") for k, v in data.items()}
        if isinstance(data, list) and data and all(isinstance(v, (int, float)) for v in data):
            return [_numbers(data, "layer 0")]  # a single layer given as a flat list
        if isinstance(data, list):
            return [_numbers(v, f"layer {i}") for i, v in enumerate(data)]
        raise ValueError("--loads-file: JSON must be a list of lists or an object layer -> list")
    rows = [r for r in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in r)]
    out = []
    for i, row in enumerate(rows):
        try:
            out.append([float(cell) for cell in row if cell.strip() != ""])
        except ValueError:
            raise ValueError(f"--loads-file: row {i + 1} of {path} is not a list of numbers") from None
    return out


def _numbers(v: Any, where: str) -> list[float]:
    if not isinstance(v, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v
    ):
        raise ValueError(f"--loads-file: {where} must be a list of numbers, got {v!r}")
    return [float(x) for x in v]


def _register_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="replica allocation, MRO placement and recovery odds per MoE layer",
        description=(
            "Allocate expert replicas from per-layer loads, place them (MRO), and compare "
            "the recovery probability of MRO, the paper's MRO, spread and compact placements "
            "for 1..N-1 failed nodes."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--loads", action="append", type=_parse_loads_arg, metavar="T0,T1,...",
                     help="tokens per expert of one layer; repeat once per layer")
    src.add_argument("--loads-file", metavar="PATH",
                     help="JSON (list of lists or {layer: list}) or CSV (one row per layer)")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes N")
    p.add_argument("--slots", type=int, required=True, help="expert replica slots per node c")
    p.add_argument("--min-replicas", type=int, default=2, help="fault-tolerance threshold f (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs sharing a node's slots (default 1)")
    p.add_argument("--max-failed", type=int, default=None,
                   help="report failure counts 1..K only (default N-1)")
    p.add_argument("--samples", type=int, default=20_000,
                   help="Monte Carlo samples when no exact method is cheap (default 20000)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from lazarus.planning import (
        place_compact,
        place_mro_paper,
        place_spread,
        plan_layers,
        recovery_estimate,
    )

    if args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    if args.slots < 1:
        raise ValueError(f"--slots must be >= 1, got {args.slots}")
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    loads = args.loads if args.loads is not None else _read_loads_file(args.loads_file)
    top = args.nodes - 1 if args.max_failed is None else args.max_failed
    if not 0 <= top <= args.nodes:
        raise ValueError(f"--max-failed must be in [0, {args.nodes}], got {top}")
    plans = plan_layers(loads, args.nodes, args.slots, args.min_replicas, args.gpus_per_node)
    layers = []
    for lp in plans:
        r = lp.replicas
        strategies = {
            "mro": lp.placement,
            "mro-paper": place_mro_paper(r, args.nodes, args.slots),
            "spread": place_spread(r, args.nodes, args.slots),
            "compact": place_compact(r, args.nodes, args.slots),
        }
        rec = []
        for f in range(1, top + 1):
            row: dict[str, Any] = {"failed": f}
            for name, plan in strategies.items():
                est = recovery_estimate(plan, f, samples=args.samples)
                row[name] = est.probability
                if not est.exact:
                    row[f"{name}_stderr"] = est.stderr
            rec.append(row)
        layers.append({
            "layer": lp.layer,
            "loads": lp.loads,
            "min_replicas": lp.min_replicas,
            "replicas": r,
            "placement": lp.placement.to_dict(),
            "recovery": rec,
        })
    out = {"nodes": args.nodes, "slots_per_node": args.slots, "gpus_per_node": args.gpus_per_node,
           "min_replicas": args.min_replicas, "layers": layers}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(_format_plan(out))
    return 0


def _format_plan(out: dict[str, Any]) -> str:
    lines = [f"cluster: {out['nodes']} nodes x {out['slots_per_node']} slots"
             f" ({out['gpus_per_node']} GPU(s) per node), min replicas {out['min_replicas']}"]
    for layer in out["layers"]:
        pl = layer["placement"]
        lines.append("")
        lines.append(f"layer {layer['layer']}: {pl['num_experts']} experts, "
                     f"f used = {layer['min_replicas']}")
        lines.append("  expert  load        replicas")
        for e, (t, r) in enumerate(zip(layer["loads"], layer["replicas"])):
            lines.append(f"  {e:>6}  {t:<10.4g}  {r}")
        lines.append("  node  experts (MRO placement)")
        for i, row in enumerate(pl["nodes"]):
            if pl["gpus_per_node"] > 1:
                cells = " | ".join(" ".join(str(x) for x in g) for g in pl["gpus"][i])
            else:
                cells = " ".join(str(x) for x in row)
            lines.append(f"  {i:>4}  {cells}")
        lines.append("  failed  mro      mro-paper  spread   compact")
        for row in layer["recovery"]:
            cols: list[str] = []
            for name in ("mro", "mro-paper", "spread", "compact"):
                v = f"{row[name]:.4f}"
                if f"{name}_stderr" in row:
                    v += "~"
                cols.append(v)
            lines.append(f"  {row['failed']:>6}  {cols[0]:<8} {cols[1]:<10} {cols[2]:<8} {cols[3]}")
        if any(k.endswith("_stderr") for row in layer["recovery"] for k in row):
            lines.append("  (~ = Monte Carlo estimate; --json gives the standard errors)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

Registrar = Callable[[argparse._SubParsersAction], None]

#: name -> registrar; each registrar adds one subparser with ``handler`` set.
def _register_simulate(sub: argparse._SubParsersAction) -> None:
    from lazarus.sim._cli import register

    register(sub)


def _register_controller(sub: argparse._SubParsersAction) -> None:
    from lazarus.runtime._cli import register_controller

    register_controller(sub)


def _register_agent(sub: argparse._SubParsersAction) -> None:
    from lazarus.runtime._cli import register_agent

    register_agent(sub)


SUBCOMMANDS: dict[str, Registrar] = {
    "plan": _register_plan,
    "controller": _register_controller,
    "agent": _register_agent,
    "simulate": _register_simulate,
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``only``) just one subcommand's: registering one
    imports its module (``simulate``'s brings numpy and the planner), and an agent
    starting on a joining node should not pay for the others before it starts its worker."""
    parser = _Parser(prog="lazarus", description="Lazarus: elastic, fault-tolerant MoE training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, register in SUBCOMMANDS.items():
        if only is None or name == only:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lazarus`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(only=argv[0] if argv and argv[0] in SUBCOMMANDS else None)
    prog = "lazarus"
    try:
        args = parser.parse_args(argv)
        prog = f"lazarus {args.command}"
        return int(args.handler(args))
    except UsageError as exc:
        print(f"{exc.prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
