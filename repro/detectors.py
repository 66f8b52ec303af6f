"""`repro detectors`: which detector flags which bug, and any false alarm on a fixed variant.

Every scenario of every bug (--first-scenario: the documented one only), buggy and fixed, runs
under every detector the machine has:

  oracle            the scenario's own oracle: the plain run
  none              no oracle and no instrument: what the bug shows by itself (an assert, a crash)
  memcheck, initcheck, racecheck, synccheck
                    compute-sanitizer's tools; each also as TOOL+nocache, with PyTorch's caching
                    allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1: its slabs hide accesses past
                    a tensor's end)
  stream-sanitizer  PyTorch's CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1)
  torch-dsa         PyTorch's device-side assertions (PYTORCH_USE_CUDA_DSA=1; they exist only in
                    builds compiled with TORCH_USE_CUDA_DSA, which a CUDA error's message shows)
  triton-debug      TRITON_DEBUG=1: Triton's device asserts and overflow checks compiled in

Every detector but `oracle` runs with the oracle off ($REPRO_ORACLE=off: divergences are
printed, not raised), so its run fails only by the detector's own means or the bug's. A detector
flags a variant when its run ends in a failure class; on a fixed variant that is a false alarm.
Every run is a fresh child (the variables above are read at import or CUDA initialization).

Exit: 0 every detector ran and the oracle column is as the records expect, 1 an oracle cell is
not, 125 nothing could run, 130 interrupted, 2 usage error. What the other detectors see is the
measurement, not a verdict.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from harness.fixes import UsageError, Variant, select_variant
from harness.isolate import SANITIZER_TOOLS, Interrupted, Isolator, Job, Result
from harness.outcome import ENV_ORACLE, EXIT_CANNOT_TEST, EXIT_INTERRUPTED, Outcome
from harness.record import BugRecord
from repro import registry
from repro import results as documents
from repro.common import (
    capped,
    devices_wanted,
    prepare_devices,
    print_table,
    time_limit,
    timeout_option,
    writable,
)

NO_CACHING = ("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
DSA_MISSING = "Compile with `TORCH_USE_CUDA_DSA`"  # torch appends it where DSA is not built in


@dataclass(frozen=True, slots=True)
class Detector:
    name: str
    env: tuple[tuple[str, str], ...] = ()
    tool: str | None = None  # a compute-sanitizer tool
    devices: tuple[str, ...] = ("cuda",)
    oracle: bool = False

    def job(
        self, bug: BugRecord, scenario: str, fixes: Variant, device: str, cap: float | None = None
    ) -> Job:
        s = bug.scenario(scenario)
        env = self.env if self.oracle else ((ENV_ORACLE, "off"), *self.env)
        limit = capped(s.timeout_s, cap)
        return Job(
            bug.id, s.name, bug.target(s), fixes, device, limit, 0, self.tool, env, ranks=s.ranks
        )


DETECTORS: tuple[Detector, ...] = (
    Detector("oracle", devices=("cpu", "cuda"), oracle=True),
    Detector("none", devices=("cpu", "cuda")),
    *(
        Detector(f"{tool}{suffix}", env, tool)
        for tool in SANITIZER_TOOLS
        for suffix, env in (("", ()), ("+nocache", (NO_CACHING,)))
    ),
    Detector("stream-sanitizer", (("TORCH_CUDA_SANITIZER", "1"),)),
    Detector("torch-dsa", (("PYTORCH_USE_CUDA_DSA", "1"), ("CUDA_LAUNCH_BLOCKING", "1"))),
    Detector("triton-debug", (("TRITON_DEBUG", "1"),), devices=("cpu", "cuda")),
)
BY_NAME = {d.name: d for d in DETECTORS}


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "detectors",
        help="which detector (oracle, compute-sanitizer tools, ...) flags which bug",
        description=__doc__.split("\n\n")[0],
    )
    d.add_argument("--bug", action="append", default=[], help="only this bug (repeatable)")
    d.add_argument(
        "--detector",
        action="append",
        default=[],
        choices=list(BY_NAME),
        metavar="NAME",
        help=f"only this detector (repeatable): {', '.join(BY_NAME)}",
    )
    d.add_argument("--device", help="cpu, cuda, auto or all (default: $REPRO_DEVICE, else all)")
    d.add_argument(
        "--first-scenario", action="store_true", help="only each bug's first (documented) scenario"
    )
    d.add_argument("--jobs", type=int, help="children at once (default: CPU count)")
    timeout_option(d)
    d.add_argument("--json", metavar="FILE", help="write every run as JSON (repro-results/1)")
    d.add_argument("--markdown", metavar="FILE", help="write the table as Markdown (the README's)")
    d.set_defaults(run=cmd_detectors)


@dataclass(frozen=True, slots=True)
class Run:
    detector: Detector
    result: Result
    variant: str  # "fixed" or "buggy"

    @property
    def flagged(self) -> bool:
        return self.result.outcome.is_failure

    @property
    def cell(self) -> str:
        """Flagged: the failure class (a false alarm on the fixed variant); clean: '-'; a run
        that could not tell (error, skipped): that class in parentheses."""
        o = self.result.outcome
        if o in (Outcome.ERROR, Outcome.SKIPPED):
            return f"({o.value})"
        if not self.flagged:
            return "-"
        return f"FALSE ALARM {o.value}" if self.variant == "fixed" else o.value


def _available(detector: Detector, device: str) -> str | None:
    """Why `detector` cannot run on `device` here, or None."""
    if device not in detector.devices:
        return "they need a GPU"
    if detector.tool and not shutil.which("compute-sanitizer"):
        return "compute-sanitizer is not on PATH"
    return None


def _plan(args: argparse.Namespace, device: str) -> list[tuple[Detector, str, Job]]:
    bugs = [registry.get(b) for b in args.bug] if args.bug else list(registry.BUGS)
    chosen = [BY_NAME[n] for n in args.detector] if args.detector else list(DETECTORS)
    plan = []
    for bug in bugs:
        scenarios = bug.scenarios[:1] if args.first_scenario else bug.scenarios
        for s in scenarios:
            for variant in ("buggy", "fixed"):
                fixes = select_variant(bug.fix_parts, variant)
                for d in chosen:
                    if _available(d, device) is None:
                        job = d.job(bug, s.name, fixes, device, time_limit(args))
                        plan.append((d, variant, job))
    return plan


def cmd_detectors(args: argparse.Namespace) -> int:
    for b in args.bug:
        registry.get(b)
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
    for option, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path:
            writable(path, option)
    start, code = time.monotonic(), None
    with Isolator() as isolator:
        wanted = prepare_devices(isolator, devices_wanted(args.device))
        plan = [p for device in wanted for p in _plan(args, device)]
        if not plan:
            print("detectors: nothing could run", file=sys.stderr)
            return EXIT_CANNOT_TEST
        by_job = {job: (d, variant) for d, variant, job in plan}
        live = documents.LiveJson(args.json, set(wanted)) if args.json else None
        try:
            jobs = [job for _, _, job in plan]
            results = isolator.run_all(jobs, args.jobs, _progress(by_job, live))
        except Interrupted as e:
            results, code = e.results, EXIT_INTERRUPTED
    runs = [Run(by_job[r.job][0], r, by_job[r.job][1]) for r in results]
    print()
    print_table(table(runs, per_bug=not args.first_scenario))
    for device in wanted:
        missing: dict[str, list[str]] = {}
        for d in DETECTORS:
            why = _available(d, device)
            if why and (not args.detector or d.name in args.detector):
                missing.setdefault(why, []).append(d.name)
        for why, names in missing.items():
            print(f"not run on {device}: {', '.join(names)}: {why}")
    print(f"\n{len(runs)} runs in {time.monotonic() - start:.1f}s")
    if live:
        live.finish([_row(r.result, r.detector) for r in runs])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(runs))
    if code is not None:
        print("detectors: interrupted; unfinished runs are skipped (interrupted)", file=sys.stderr)
        return code
    return 0 if all(_oracle_ok(r) for r in runs) else 1


def _oracle_ok(run: Run) -> bool:
    if not run.detector.oracle:
        return True
    job = run.result.job
    expected = registry.get(job.bug).scenario(job.scenario).expected(job.fixes, job.device)
    return run.result.outcome == expected


def _row(result: Result, detector: Detector) -> dict:
    return {**documents.result_json(result), "detector": detector.name}


def _progress(by_job: dict[Job, tuple[Detector, str]], live: documents.LiveJson | None):
    done, total = [0], len(by_job)

    def show(r: Result) -> None:
        done[0] += 1
        detector, variant = by_job[r.job]
        if live:
            live.add(_row(r, detector))
        print(
            f"[{done[0]:>3}/{total}] {detector.name:<17} {r.job.bug} {variant} {r.job.device} "
            f"{r.job.scenario}: {r.outcome.value} {r.seconds:.1f}s",
            flush=True,
        )

    return show


def _grid(
    runs: list[Run], per_bug: bool
) -> tuple[list[str], dict[tuple[str, ...], dict[str, list[Run]]]]:
    """(detector names in order; row -> detector -> runs). A row is (bug, variant, device), or
    with `per_bug` False (bug, scenario, variant, device)."""
    names = [d.name for d in DETECTORS if any(r.detector is d for r in runs)]
    rows: dict[tuple[str, ...], dict[str, list[Run]]] = {}
    for r in runs:
        j = r.result.job
        key = (j.bug, r.variant, j.device) if per_bug else (j.bug, j.scenario, r.variant, j.device)
        rows.setdefault(key, {}).setdefault(r.detector.name, []).append(r)
    return names, rows


def summary(runs: list[Run]) -> str:
    """One bug's runs under one detector: the classes it flagged and in how many scenarios
    ('-': none flagged), and runs that could not tell."""
    if len(runs) == 1:
        return runs[0].cell
    flagged = [r for r in runs if r.flagged]
    untold = [r for r in runs if r.result.outcome in (Outcome.ERROR, Outcome.SKIPPED)]
    parts = []
    if flagged:
        classes = "/".join(dict.fromkeys(r.result.outcome.value for r in flagged))
        alarm = "FALSE ALARM " if flagged[0].variant == "fixed" else ""
        parts.append(f"{alarm}{classes} {len(flagged)}/{len(runs)}")
    if untold:
        classes = "/".join(dict.fromkeys(r.result.outcome.value for r in untold))
        parts.append(f"({classes} {len(untold)}/{len(runs)})")
    return " ".join(parts) or "-"


def table(runs: list[Run], per_bug: bool = False) -> list[tuple[str, ...]]:
    names, rows = _grid(runs, per_bug)
    head = ("bug", "variant", "device") if per_bug else ("bug", "scenario", "variant", "device")
    lines = [(*head, *names)]
    for key, cells in rows.items():
        lines.append((*key, *(summary(cells[n]) if n in cells else "n/a" for n in names)))
    return lines


def markdown(runs: list[Run]) -> str:
    """For the README: where and with what it was measured, the table per bug (a cell: the
    classes a detector flagged, in how many of the bug's scenarios), then per scenario."""
    out = [_measured_on({r.result.job.device for r in runs}), ""]
    for per_bug in (True, False):
        if not per_bug:
            out += ["", "<details><summary>Per scenario</summary>", ""]
        rows = table(runs, per_bug)
        out.append("| " + " | ".join(rows[0]) + " |")
        out.append("|" + "---|" * len(rows[0]))
        width = 3 if per_bug else 4
        for row in rows[1:]:
            out.append("| " + " | ".join([*row[:width], *(_md(v) for v in row[width:])]) + " |")
    out += ["", "</details>"]
    dsa = [r for r in runs if r.detector.name == "torch-dsa" and DSA_MISSING in r.result.evidence]
    if dsa:
        out.append(
            "\ntorch-dsa: this torch build was compiled without TORCH_USE_CUDA_DSA (its CUDA "
            "errors say so): the column shows the build without device-side assertions."
        )
    return "\n".join(out) + "\n"


def _md(cell: str) -> str:
    if cell.startswith("FALSE ALARM"):
        return f"**{cell}**"
    return cell if cell in ("-", "n/a") or cell.startswith("(") else f"`{cell}`"


def _measured_on(used: set[str]) -> str:
    p = documents.provenance(used)
    pk = p["packages"]
    parts = [
        f"Measured {datetime.date.today().isoformat()}",
        f"commit {(p['project']['commit'] or 'unknown')[:10]}"
        + (" with local changes" if p["project"]["dirty"] else ""),
        f"Python {p['python']}, torch {pk['torch']}, triton {pk['triton']}",
    ]
    for gpu in p["gpus"][:1]:
        parts.append(
            f"{gpu['name']} (sm {gpu['compute_capability']}, driver {gpu['driver']}, "
            f"torch CUDA {p['torch_cuda']})"
        )
    sanitizer = _sanitizer_version() if "cuda" in used else None
    if sanitizer:
        parts.append(sanitizer)
    if "cpu" in used:
        parts.append(f"CPU: {p['host']['cpu']} (Triton interpreter)")
    return "; ".join(parts) + "."


def _sanitizer_version() -> str | None:
    if not shutil.which("compute-sanitizer"):
        return None
    done = subprocess.run(["compute-sanitizer", "--version"], capture_output=True, text=True)
    versions = [line for line in done.stdout.splitlines() if "Version" in line]
    return f"compute-sanitizer {versions[0].split('Version', 1)[1].strip()}" if versions else None
