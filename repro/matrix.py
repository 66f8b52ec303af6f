"""`repro matrix`: every bug x {fixed, buggy} (x each single-part removal) x device, and its
results: progress lines, a summary table, JSON and JUnit files.

Exit: 0 every run showed its expected outcome, 1 otherwise, 125 nothing could run or every run
was as expected but a --json or --junit file could not be written (the matrix still finishes and
writes the others; stderr names the lost one and why), 130 interrupted (the summary and the files
still cover what finished), 2 usage error.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from harness.fixes import UsageError, Variant, describe, select_variant
from harness.isolate import Interrupted, Isolator, Job, Result
from harness.outcome import EXIT_CANNOT_TEST, EXIT_INTERRUPTED, Outcome
from harness.record import BugRecord
from repro import registry
from repro import results as documents
from repro.common import (
    capped,
    devices_wanted,
    dtype_option,
    job_cost,
    parse_shard,
    prepare_devices,
    print_table,
    shard_option,
    take_shard,
    time_limit,
    timeout_option,
    warn_tight,
    writable,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("matrix", help="every bug x {fixed, buggy} x available devices")
    m.add_argument("--bug", action="append", default=[], help="only this bug (repeatable)")
    m.add_argument(
        "--device", help="cpu, cuda, auto or all (default: $REPRO_DEVICE, else all available)"
    )
    m.add_argument("--each-part", action="store_true", help="also each single-part removal")
    m.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every cell N times, with seeds 0..N-1 (determinism check)",
    )
    m.add_argument("--jobs", type=int, help="children at once (default: CPU count)")
    timeout_option(m)
    dtype_option(m)
    shard_option(m)
    m.add_argument("--json", metavar="FILE", help="write results as JSON")
    m.add_argument("--junit", metavar="FILE", help="write results as JUnit XML")
    m.set_defaults(run=cmd_matrix)


@dataclass(frozen=True, slots=True)
class Cell:
    """One matrix run with its expectation."""

    result: Result
    variant: str
    expected: Outcome
    signed: bool = True  # a failure's evidence matches the scenario's signature

    @property
    def ok(self) -> bool:
        return self.result.outcome == self.expected and self.signed


def _key(planned: tuple[BugRecord, Job]) -> tuple:
    """A run's stable name: what --shard splits by."""
    job = planned[1]
    return (
        job.device,
        job.dtype,
        job.bug,
        job.scenario,
        sorted(f.value for f in job.fixes),
        job.seed,
    )


def variants(bug: BugRecord, each_part: bool) -> list[Variant]:
    """The matrix's variants of `bug`: fixed, buggy and (each_part) each part's removal."""
    variants = [select_variant(bug.fix_parts, "fixed"), bug.buggy_variant]
    if each_part and len(bug.fix_parts) > 1:
        variants += [select_variant(bug.fix_parts, "fixed", [p.value]) for p in bug.fix_parts]
    return variants


def _check(args: argparse.Namespace) -> tuple[list[BugRecord], list[str]]:
    bugs = [registry.get(b) for b in args.bug] if args.bug else list(registry.BUGS)
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1, got {args.repeat}")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
    parse_shard(args.shard)
    for option, path in (("--json", args.json), ("--junit", args.junit)):
        if path:
            writable(path, option)
    return bugs, devices_wanted(args.device)


def cmd_matrix(args: argparse.Namespace) -> int:
    bugs, wanted = _check(args)
    start, code = time.monotonic(), None
    with Isolator() as isolator:
        plan: list[tuple[BugRecord, Job]] = []
        for device in prepare_devices(isolator, wanted):
            for bug in bugs:
                for fixes in variants(bug, args.each_part):
                    cap = time_limit(args)
                    jobs = _jobs(bug, fixes, device, args.repeat, cap, args.dtype)
                    plan += [(bug, job) for job in jobs]
        plan = take_shard(plan, parse_shard(args.shard), lambda p: job_cost(*p), _key)
        warn_tight(plan, time_limit(args))
        if not plan:
            print("matrix: nothing could run", file=sys.stderr)
            return EXIT_CANNOT_TEST
        records = {job: bug for bug, job in plan}
        files = _Files(args, {job.device for job in records})
        # the longest runs start first (their usual seconds): none is left to run alone at the end
        order = sorted(range(len(plan)), key=lambda i: -job_cost(*plan[i]))
        jobs = [plan[i][1] for i in order]
        try:
            ran = isolator.run_all(jobs, args.jobs, _progress(records, files))
        except Interrupted as e:
            ran, code = e.results, EXIT_INTERRUPTED
        results = [r for _, r in sorted(zip(order, ran, strict=True), key=lambda p: p[0])]
    cells = [_cell(records[r.job], r) for r in results]
    seconds = time.monotonic() - start
    print_summary(cells, seconds)
    # how long it took, for `repro bench --matrix-json` (CI times its matrix step once, not twice)
    timing = {
        "seconds": round(seconds, 3),
        "repeat": args.repeat,
        "each_part": args.each_part,
        "shard": args.shard,
        "bugs": args.bug,  # [] : every bug
        "jobs": args.jobs,  # None: the default
        "interrupted": code is not None,
        "as_expected": code is None and all(c.ok for c in cells),
    }
    written = files.finish(cells, timing)
    if code is not None:
        print("matrix: interrupted; unfinished runs are skipped (interrupted)", file=sys.stderr)
        return code
    if not all(c.ok for c in cells):
        return 1
    return 0 if written else EXIT_CANNOT_TEST


class _Files:
    """--json and --junit, rewritten after every finished run (nothing lost if killed). A write
    that fails (its directory removed, a full disk) does not stop the matrix: `finish` writes
    each file whole once more and names on stderr the one that still cannot be written."""

    def __init__(self, args: argparse.Namespace, devices_used: set[str]) -> None:
        self.json = documents.LiveJson(args.json, devices_used) if args.json else None
        self.junit = documents.LiveJunit(args.junit) if args.junit else None
        self.lost: dict[str, str] = {}  # "--json FILE": why its last write failed

    def add(self, cell: Cell) -> None:
        if self.json:
            self._write(
                f"--json {self.json.path}", self.json.add, documents.result_json(cell.result)
            )
        if self.junit:
            self._write(f"--junit {self.junit.path}", self.junit.add, cell)

    def finish(self, cells: list[Cell], timing: dict) -> bool:
        """Write both whole, the JSON with the matrix's `timing`; whether both were written (on
        stderr, why not)."""
        if self.json:
            rows = [documents.result_json(c.result) for c in cells]
            finish = functools.partial(self.json.finish, matrix=timing)
            self._write(f"--json {self.json.path}", finish, rows)
        if self.junit:
            self._write(f"--junit {self.junit.path}", self.junit.finish, cells)
        for file, why in self.lost.items():
            print(f"matrix: {file}: not written: {why}", file=sys.stderr)
        return not self.lost

    def _write(self, file: str, write: Callable[..., None], arg: object) -> None:
        try:
            write(arg)
        except OSError as e:
            self.lost[file] = e.strerror or str(e)
        else:
            self.lost.pop(file, None)


def _jobs(bug: BugRecord, fixes: Variant, device: str, repeat: int, cap: float | None, dtype: str):
    return [
        Job(
            bug.id,
            s.name,
            bug.target(s),
            fixes,
            device,
            capped(s.timeout_s, cap),
            seed,
            dtype=dtype,
            ranks=s.ranks,
        )
        for s in bug.scenarios
        for seed in range(repeat)
    ]


def _cell(bug: BugRecord, r: Result) -> Cell:
    scenario = bug.scenario(r.job.scenario)
    expected = scenario.expected(r.job.fixes, r.job.device)
    judged = r.job.fixes == bug.buggy_variant and expected != Outcome.PASS
    signed = not judged or scenario.signed(r.evidence, r.job.device)
    return Cell(r, describe(r.job.fixes, bug.fix_parts), expected, signed)


def _progress(records: dict[Job, BugRecord], files: _Files):
    done, total = [0], len(records)

    def show(r: Result) -> None:
        done[0] += 1
        cell = _cell(records[r.job], r)
        files.add(cell)
        mark = "ok" if cell.ok else f"UNEXPECTED (expected {cell.expected.value})"
        if r.outcome == cell.expected and not cell.signed:
            mark = "MISMATCH (the right class without the failure's signature)"
        scenario_s = "" if r.scenario_seconds is None else f" (scenario {r.scenario_seconds:.2f}s)"
        print(
            f"[{done[0]:>3}/{total}] {r.job.bug} {cell.variant} {_where(r.job)} "
            f"{r.job.scenario}: {r.outcome.value} {mark} {r.seconds:.1f}s{scenario_s}",
            flush=True,
        )

    return show


def _where(job: Job) -> str:
    """The device, and the runner's dtype when it is not float32."""
    return job.device if job.dtype == "float32" else f"{job.device} {job.dtype}"


def print_summary(cells: list[Cell], seconds: float) -> None:
    """One row per (bug, variant, device, scenario); repeats are counted, not listed."""
    groups: dict[tuple[str, ...], list[Cell]] = {}
    for c in cells:
        j = c.result.job
        groups.setdefault((j.bug, c.variant, _where(j), j.scenario, c.expected.value), []).append(c)
    rows = [("bug", "variant", "device", "scenario", "expected", "outcomes", "")]
    for key, group in groups.items():
        counts = Counter(c.result.outcome.value for c in group)
        seen = ", ".join(f"{o} x{n}" if len(group) > 1 else o for o, n in counts.items())
        ok = sum(c.ok for c in group)
        rows.append((*key, seen, "ok" if ok == len(group) else f"UNEXPECTED {len(group) - ok}"))
    print()
    print_table(rows)
    ok = sum(c.ok for c in cells)
    print(f"\n{ok}/{len(cells)} runs as expected in {seconds:.1f}s")
    for c in [c for c in cells if not c.ok][:10]:
        j = c.result.job
        print(f"\nUNEXPECTED {j.bug} {c.variant} {_where(j)} {j.scenario} seed {j.seed}:")
        print("    " + c.result.evidence.replace("\n", "\n    "))
