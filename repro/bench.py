"""`repro bench`: what a verdict costs on this machine, each figure against the floor (a bare
interpreter importing torch and Triton, and initializing CUDA on a GPU). A benchmark, not a test:
it prints what it measured; compare the JSON between commits or machines.

    repro bench [--device cpu|cuda|auto] [--repeat N] [--shard K/N] [--matrix-json FILE]
                [--json FILE]
    repro bench --per-bug [--bug BUG ...] [--device ...] [--json FILE]

Figures (median of N runs): usage error, `repro list`, `repro check` of one scenario cold (a
private server) and warm (`repro serve` running; the median of the N after the first, and the first
on its own: on a GPU the server's first spares are still making their contexts), the overhead of
one child that does nothing (warm), and `repro matrix --each-part` on the device (warm; with
--shard K/N, its part K of N only, as one of CI's runners runs it: the JSON says which part, and
`repro diff` compares a matrix's figures only between files of the same part; with --matrix-json, a
finished matrix's time and runs over its repeats instead: CI's matrix step is not run twice). On a
GPU also the matrix's floor: its number of runs times the time per child that only makes a CUDA
context, measured four at once (a GPU takes only so many new contexts a second, however many
processes ask: about 5.5 on the H100 machine we measured; a run in its own process cannot cost
less).

--usual: each scenario's usual seconds on the device (a whole child, fixed and buggy, as `repro
check` runs them: all of a bug's at once, CPU-count children at a time; the larger variant's
median of N), printed; with --write, shipped in each bug's package (harness.record.USUAL_FILE):
a timeout under HANG_FACTOR times them cannot tell a hang.

--per-bug: what each bug costs, a row per bug: `repro check BUG` warm (the edit-check loop;
median of N), its scenarios' own seconds (fixed and buggy, summed, as the children measured
them), its marker suite (`pytest -m BUG -n auto`, as the README's test command runs it) and its
mutants (`repro mutants BUG`), each the wall time of one command, against the floor.
--checks: only the edit-check loop, a row per bug: `repro check BUG` warm, fixed and
`--variant buggy` (median of N each), against the floor.

A timed command that does not end as its verdict should (a fixed check that fails, a buggy one
that passes, a usage error that is not one) is named on stderr; its figure is still shown, and
the bench exits 125 with one line: such a figure is not a verdict's time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import device as devices
from harness.fixes import ALL_FIXES, UsageError
from harness.isolate import Isolator, Job
from harness.record import USUAL_FILE
from harness.servers import ENV_SERVER
from harness.userdir import ENV_SERVER_DIR
from repro import registry
from repro.common import (
    BENCH_SCHEMA,
    device_choice,
    parse_shard,
    prepare,
    print_table,
    shard_option,
    unavailable,
    writable,
)
from repro.report import load
from repro.results import write as write_document

CHECK = ("check", "lora_dummy_run", "--scenario", "dummy_run_before_mapping")


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="what a verdict costs here, against a bare torch import")
    b.add_argument("--device", help="cpu, cuda or auto (default: $REPRO_DEVICE, else auto)")
    b.add_argument("--repeat", type=int, default=3, metavar="N")
    b.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    b.add_argument("--per-bug", action="store_true", help="a cost row per bug (see above)")
    b.add_argument("--bug", action="append", default=[], help="with --per-bug: only this bug")
    b.add_argument(
        "--checks", action="store_true", help="per bug: only the warm check, fixed and buggy"
    )
    b.add_argument("--usual", action="store_true", help="each scenario's usual seconds (above)")
    b.add_argument("--write", action="store_true", help="with --usual: into the records")
    shard_option(b)
    b.add_argument(
        "--matrix-json",
        metavar="FILE",
        help="the matrix figure from a finished `repro matrix --each-part --json FILE` of this "
        "device (its seconds and runs over its repeats) instead of a matrix run of its own: "
        ".ci/gpu passes its matrix step's",
    )
    b.add_argument(
        "--table",
        nargs="+",
        metavar="FILE",
        help="print a Markdown table of bench JSON files (a column each), run nothing: the "
        "README's and docs/measurements' tables are made so, never typed",
    )
    b.set_defaults(run=cmd_bench)


_WRONG_EXITS: list[str] = []  # timed commands that did not end as wanted (this process's)


def _timed(argv: list[str], env: dict[str, str], want: int | None = None) -> float:
    """Seconds of one run of argv; `want`: the exit code that makes the time a verdict's (a
    fixed check that fails, or a buggy one that passes, is timed but named)."""
    start = time.monotonic()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.monotonic() - start
    if want is not None and done.returncode != want:
        what = " ".join(a for a in argv if not a.startswith("/"))
        print(f"bench: {what}: exit {done.returncode}, not {want}", file=sys.stderr)
        _WRONG_EXITS.append(what)
    return seconds


def _median(argv: list[str], env: dict[str, str], repeat: int, want: int | None = None) -> float:
    return statistics.median(_timed(argv, env, want) for _ in range(repeat))


def _exit() -> int:
    """0, or 125 with one line when a timed command ended otherwise than wanted."""
    if _WRONG_EXITS:
        print(
            f"bench: {len(_WRONG_EXITS)} timed runs did not end as wanted (above): their "
            "figures are not a verdict's time"
        )
        return 125
    return 0


def _floor(device: str) -> list[str]:
    init = "; torch.cuda.init(); torch.zeros(1, device='cuda')" if device == "cuda" else ""
    return [sys.executable, "-c", "import torch, triton" + init]


def _per_child(device: str, repeat: int, target: str, workers: int) -> float:
    """Seconds per child running `target`, `workers` at once, the server already warm."""
    job = Job("bench", target, target, ALL_FIXES, device, 60.0)
    with Isolator("fork") as isolator:
        isolator.run(job)  # the server's start is not a child's cost
        start = time.monotonic()
        isolator.run_all([job] * (4 * repeat), workers=workers)
        return (time.monotonic() - start) / (4 * repeat)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1, got {args.repeat}")
    if args.json:
        writable(args.json, "--json")
    shard = parse_shard(args.shard)
    not_default = args.per_bug or args.bug or args.checks or args.usual or args.table
    if shard and not_default:
        raise UsageError("--shard goes with the default figures only (it parts their matrix)")
    if args.matrix_json and not_default:
        raise UsageError("--matrix-json goes with the default figures only")
    device = devices.resolve(device_choice(args.device))
    why = unavailable(device)
    if why:
        print(f"{device}: cannot bench: {why}")
        return 125
    if args.table:
        print(table(args.table), end="")
        return 0
    matrix_done = _matrix_timing(args.matrix_json, device, args.shard) if args.matrix_json else None
    repro = [sys.executable, "-m", "repro"]
    if args.write and not args.usual:
        raise UsageError("--write goes with --usual")
    if args.usual:
        bugs = [registry.get(b) for b in args.bug] or list(registry.BUGS)
        return _usual(device, bugs, args.repeat, args.write)
    if args.per_bug or args.bug or args.checks:
        bugs = [registry.get(b).id for b in args.bug] or [b.id for b in registry.BUGS]
        return _per_bug(device, bugs, args.repeat, args.json, args.checks)
    with tempfile.TemporaryDirectory(prefix="repro-bench-") as tmp:
        cold = {**os.environ, ENV_SERVER: "off"}
        warm = {**os.environ, ENV_SERVER: "auto", ENV_SERVER_DIR: tmp}
        figures = {
            "floor_import": _median(_floor(device), cold, args.repeat),
            "usage_error": _median([*repro, "check", "no_such_bug"], cold, args.repeat, 2),
            "list": _median([*repro, "list"], cold, args.repeat, 0),
            "check_cold": _median([*repro, *CHECK, "--device", device], cold, args.repeat, 0),
        }
        quiet = {"env": warm, "stdout": subprocess.DEVNULL}
        subprocess.run([*repro, "serve", "--device", device], check=True, **quiet)
        try:
            check = [*repro, *CHECK, "--device", device]
            # the first check after the server's start: on a GPU its spares are still making
            # their CUDA contexts (the server's start, not the loop's); timed on its own
            figures["check_first_warm"] = _timed(check, warm, 0)
            figures["check_warm"] = _median(check, warm, args.repeat, 0)
            os.environ[ENV_SERVER_DIR], os.environ[ENV_SERVER] = tmp, "auto"
            figures["child_overhead"] = _per_child(device, args.repeat, "harness.child:noop", 1)
            runs = Path(tmp) / "matrix.json"
            if matrix_done:
                figures["matrix_each_part"], count = matrix_done
            else:
                matrix = [*repro, "matrix", "--each-part", "--device", device, "--json", str(runs)]
                matrix += ["--shard", args.shard] if shard else []
                figures["matrix_each_part"] = _timed(matrix, warm, 0)
                count = len(json.loads(runs.read_text())["results"]) if runs.exists() else 0
            if device == "cuda":
                context = _per_child(device, args.repeat, "harness.child:cuda_context", 4)
                figures["matrix_floor"] = count * context
        finally:
            subprocess.run([*repro, "serve", "--device", device, "--stop"], **quiet)
    return _report(device, figures, args.json, args.shard, "step" if matrix_done else None)


def _matrix_timing(path: str, device: str, shard: str | None) -> tuple[float, float]:
    """(seconds, runs) of one pass of the finished `repro matrix` whose JSON is at `path`: its
    wall time and its runs, each over its repeats. A file that is no such matrix of this figure
    (not a valid results document, no timing, interrupted, another device, part, dtype, bugs or
    --jobs, not --each-part) is a usage error; one whose runs did not all end as expected is
    named like a timed command that did not."""
    doc = load(path)
    timing, rows = doc.get("matrix"), doc["results"]
    if not isinstance(timing, dict):
        raise UsageError(f"--matrix-json {path}: no timing (an older repro's, or not a matrix's)")
    seconds, repeat = timing["seconds"], timing["repeat"]
    devices_run = sorted({row["device"] for row in rows})
    dtypes = sorted({row.get("dtype", "float32") for row in rows})
    checks = (
        (timing["interrupted"] or not doc.get("complete", True), "interrupted"),
        (not timing["each_part"], "not --each-part"),
        (devices_run != [device], f"ran on {devices_run}, not {device}"),
        (_part(timing["shard"]) != _part(shard), f"its part is {timing['shard']}, not {shard}"),
        (dtypes != ["float32"], f"in {dtypes}, not the default float32"),
        (bool(timing["bugs"]), f"of {timing['bugs']} only, not every bug"),
        (timing["jobs"] is not None, f"with --jobs {timing['jobs']}, not the default"),
        (repeat < 1 or not 0 <= seconds < math.inf, f"repeat {repeat}, seconds {seconds}"),
    )
    wrong = [why for bad, why in checks if bad]
    if wrong:
        raise UsageError(f"--matrix-json {path}: " + "; ".join(wrong))
    if not timing["as_expected"]:
        print(f"bench: --matrix-json {path}: not every run as expected", file=sys.stderr)
        _WRONG_EXITS.append(f"matrix {path}")
    return seconds / repeat, len(rows) / repeat


def _part(shard: str | None) -> tuple[int, int]:
    """A --shard's (K, N); the whole is part 1 of 1."""
    try:
        return parse_shard(shard) or (1, 1)
    except UsageError:
        return (0, 0)  # no part: matches none


def _per_bug(device: str, bugs: list[str], repeat: int, path: str | None, checks: bool) -> int:
    repro, rows = [sys.executable, "-m", "repro"], {}
    with tempfile.TemporaryDirectory(prefix="repro-bench-") as tmp:
        warm = {**os.environ, ENV_SERVER: "auto", ENV_SERVER_DIR: tmp}
        floor = _median(_floor(device), warm, repeat)
        quiet = {"env": warm, "stdout": subprocess.DEVNULL}
        subprocess.run([*repro, "serve", "--device", device], check=True, **quiet)
        try:
            # the first check after the server's start is the server's start (check_first_warm):
            # run, not timed, so that it is no bug's
            _timed([*repro, "check", bugs[0], "--device", device], warm, 0)
            for bug in bugs:
                check = [*repro, "check", bug, "--device", device]
                rows[bug] = {"check_warm": _median(check, warm, repeat, 0)}
                if checks:
                    buggy = _median([*check, "--variant", "buggy"], warm, repeat, 1)
                    rows[bug]["check_warm_buggy"] = buggy
                else:
                    rows[bug].update(_costs(bug, device, warm, Path(tmp)))
                print(f"{bug}: " + ", ".join(f"{k} {v:.2f}s" for k, v in rows[bug].items()))
                if path:  # each row kept as it comes: a bench cut short keeps those before
                    _write_rows(path, device, floor, rows, complete=False)
        finally:
            subprocess.run([*repro, "serve", "--device", device, "--stop"], **quiet)
    if checks:
        table = [("bug", "fixed", "x floor", "buggy", "x floor")]
        for bug, f in rows.items():
            fixed, buggy = f["check_warm"], f["check_warm_buggy"]
            table.append(
                (
                    bug,
                    f"{fixed:.2f}",
                    f"{fixed / floor:.2f}",
                    f"{buggy:.2f}",
                    f"{buggy / floor:.2f}",
                )
            )
        return _per_bug_out(device, floor, table, rows, path, "--checks")
    table = [("bug", "check warm", "x floor", "scenarios", "marker suite", "mutants")]
    for bug, f in rows.items():
        figures = (f["check_warm"], f["scenarios"], f["marker_suite"], f["mutants"])
        cells = [f"{v:.1f}" for v in figures]
        table.append((bug, cells[0], f"{f['check_warm'] / floor:.2f}", *cells[1:]))
    totals = [f"{sum(f[k] for f in rows.values()):.1f}" for k in ("scenarios", "marker_suite")]
    mutants_total = f"{sum(f['mutants'] for f in rows.values()):.1f}"
    table.append(("total", "", "", *totals, mutants_total))
    return _per_bug_out(device, floor, table, rows, path, "--per-bug")


def _costs(bug: str, device: str, warm: dict[str, str], tmp: Path) -> dict[str, float]:
    repro = [sys.executable, "-m", "repro"]
    runs = tmp / f"{bug}.json"
    _timed([*repro, "matrix", "--bug", bug, "--device", device, "--json", str(runs)], warm)
    results = json.loads(runs.read_text())["results"] if runs.exists() else []
    suite = [sys.executable, "-m", "pytest", "-q", "-n", "auto", "-m", bug]
    return {
        "scenarios": sum(r["scenario_seconds"] or 0.0 for r in results),
        "marker_suite": _timed([*suite, "--device", device, "-p", "no:cacheprovider"], warm),
        "mutants": _timed([*repro, "mutants", bug, "--device", device], warm),
    }


def _per_bug_out(device, floor, table, rows, path, how) -> int:
    print(
        f"\nrepro bench {how} on {device} ({platform.node()}, {os.cpu_count()} CPUs), "
        f"floor (import torch, triton) {floor:.2f}s; seconds"
    )
    print_table(table)
    if path:
        _write_rows(path, device, floor, rows, complete=True)
    return _exit()


def _write_rows(path: str, device: str, floor: float, rows: dict, complete: bool) -> None:
    """The per-bug JSON (complete: false while rows are still to come), replaced whole."""
    doc = {"schema": BENCH_SCHEMA, "device": device, "cpus": os.cpu_count()}
    write_document(path, doc | {"floor_import": floor, "bugs": rows, "complete": complete})


def _usual(device: str, bugs: list, repeat: int, write: bool) -> int:
    """Each scenario's usual seconds (see the module's docstring)."""
    jobs = [
        Job(bug.id, s.name, bug.target(s), fixes, device, s.timeout_s, seed, ranks=s.ranks)
        for bug in bugs
        for fixes in (ALL_FIXES, bug.buggy_variant)
        for s in bug.scenarios
        for seed in range(repeat)
    ]
    with Isolator("fork") as isolator:
        why = prepare(isolator, device)
        if why:
            print(f"{device}: cannot bench: {why}")
            return 125
        isolator.run(Job("bench", "noop", "harness.child:noop", ALL_FIXES, device, 60.0))
        results = isolator.run_all(jobs)
    seconds: dict[tuple[str, str], dict[frozenset, list[float]]] = {}
    for r in results:
        seconds.setdefault((r.job.bug, r.job.scenario), {}).setdefault(r.job.fixes, []).append(
            r.seconds
        )
    usual = {
        key: round(max(statistics.median(runs) for runs in by_variant.values()), 2)
        for key, by_variant in seconds.items()
    }
    rows = [("bug", "scenario", f"usual s ({device})")]
    rows += [(bug, scenario, f"{s:.2f}") for (bug, scenario), s in usual.items()]
    print_table(rows)
    if write:
        how = f"repro bench --usual --repeat {repeat}"
        where = f"{time.strftime('%Y-%m-%d')}, {_machine(device)}, {how}"
        for bug in bugs:
            path = Path(sys.modules[bug.package].__file__).with_name(USUAL_FILE)
            doc = json.loads(path.read_text()) if path.exists() else {}
            doc[device] = {s.name: usual[bug.id, s.name] for s in bug.scenarios}
            doc.setdefault("measured", {})[device] = where
            path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        print(f"written: {len(bugs)} records' {USUAL_FILE}")
    return 0


def _machine(device: str) -> str:
    if device == "cuda":
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "a GPU"
    return f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"


FIGURES = {
    "floor_import": "floor: `import torch, triton` (+ CUDA init)",
    "usage_error": "usage error",
    "list": "`repro list`",
    "check_cold": "`repro check` cold",
    "check_first_warm": "`repro check` warm, the first after `repro serve`",
    "check_warm": "`repro check` warm",
    "child_overhead": "one child's overhead",
    "matrix_each_part": "`repro matrix --each-part`",
    "matrix_floor": "its floor: its runs x one CUDA context",
}


def table(paths: list[str]) -> str:
    """A Markdown table of `repro bench --json` files: a row per figure, a column per file
    (seconds, and the ratio to that file's floor)."""
    docs = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--table {path}: {e}") from None
        if not isinstance(doc, dict) or doc.get("schema") != BENCH_SCHEMA:
            raise UsageError(f"--table {path}: not a {BENCH_SCHEMA} document")
        docs.append(doc)
    heads = [
        f"{d.get('machine', d['device'])}, {d['cpus']} CPUs"
        + (f", matrix part {d['shard']}" if d.get("shard") else "")
        + (", matrix from its step" if d.get("matrix_from") == "step" else "")
        + f" ({Path(p).name})"
        for d, p in zip(docs, paths, strict=True)
    ]
    lines = ["| figure | " + " | ".join(heads) + " |", "|---" * (len(docs) + 1) + "|"]
    for name, label in FIGURES.items():
        cells = []
        for doc in docs:
            figures = doc["figures"]
            value = figures.get(name)
            floor = figures.get("matrix_floor" if name == "matrix_each_part" else "floor_import")
            shown = "-" if value is None else f"{value:.3f}"
            if value is not None and floor and name not in ("floor_import", "matrix_floor"):
                shown += f" ({value / floor:.2f}x)"
            cells.append(shown)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _report(
    device: str,
    figures: dict[str, float],
    path: str | None,
    shard: str | None,
    matrix_from: str | None = None,
) -> int:
    floor = figures["floor_import"]
    rows = [("figure", "seconds", "x floor")]
    rows += [(name, f"{s:.3f}", f"{s / floor:.2f}") for name, s in figures.items()]
    part = f", the matrix's part {shard}" if shard else ""
    print(f"repro bench on {device} ({platform.node()}, {os.cpu_count()} CPUs{part})")
    print_table(rows)
    if path:
        result = {
            "schema": BENCH_SCHEMA,
            "device": device,
            "cpus": os.cpu_count(),
            "figures": figures,
            **({"shard": shard} if shard else {}),
            # "step": the matrix figure is a finished matrix's (--matrix-json), not its own run
            **({"matrix_from": matrix_from} if matrix_from else {}),
        }
        Path(path).write_text(json.dumps(result, indent=2))
    return _exit()
