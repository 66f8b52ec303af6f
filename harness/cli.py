"""The `repro` command: list, info, run, check, matrix.

Exit codes of run and check follow `git bisect run`: 0 bug absent, 1 bug present, 125 cannot
test (skipped, or an error unrelated to the bug), 2 usage error. Matrix exits 0 when every run
showed its expected outcome, 1 otherwise, 125 when nothing could run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from harness import device as devices
from harness.fixes import Fix, UsageError, Variant, describe, select_variant
from harness.isolate import Isolator, Job, Result
from harness.outcome import EXIT_CANNOT_TEST, EXIT_USAGE, Outcome, exit_code
from harness.record import BugRecord


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep our wording
        raise UsageError(message)


def _variant_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", choices=("fixed", "buggy"), help="default: fixed (all fixes on)")
    p.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="PART",
        help="switch one fix part off (repeatable)",
    )
    p.add_argument("--fixes", metavar="none", help="'none': every fix part of every bug off")
    p.add_argument("--device", help="cpu, cuda or auto (default: $REPRO_DEVICE, else auto)")
    p.add_argument("--scenario", action="append", default=[], help="only this scenario")
    p.add_argument("--sanitizer", action="store_true", help="run children under compute-sanitizer")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="repro", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("list", help="table of registered bugs")
    sub.add_parser("info", help="the full record of one bug").add_argument("bug")
    for name, helptext in (
        ("run", "run a bug's scenarios, print outcomes and evidence"),
        ("check", "bisect-friendly verdict: exit 0 absent, 1 present"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("bug")
        _variant_options(p)
        if name == "run":
            p.add_argument("--json", action="store_true", help="print results as JSON")
    m = sub.add_parser("matrix", help="every bug x {fixed, buggy} x available devices")
    m.add_argument("--bug", action="append", default=[], help="only this bug (repeatable)")
    m.add_argument("--device", default="all", help="cpu, cuda, auto or all (default: all)")
    m.add_argument("--each-part", action="store_true", help="also each single-part removal")
    m.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every cell N times, with seeds 0..N-1 (determinism check)",
    )
    m.add_argument("--jobs", type=int, help="children at once (default: CPU count)")
    m.add_argument("--json", metavar="FILE", help="write results as JSON")
    m.add_argument("--junit", metavar="FILE", help="write results as JUnit XML")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)
        code = COMMANDS[args.command](args)
    except UsageError as e:
        print(f"repro: error: {e}", file=sys.stderr)
        code = EXIT_USAGE
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# list / info
# ---------------------------------------------------------------------------------------------


def _registry():
    from repro import registry

    return registry


def cmd_list(args: argparse.Namespace) -> int:
    rows = [("id", "upstream", "fix parts", "buggy (cpu)", "buggy (cuda)")]
    for bug in _registry().BUGS:
        rows.append(
            (
                bug.id,
                "#" + bug.upstream.rsplit("/", 1)[-1],
                ", ".join(f.value for f in bug.fix_parts),
                bug.buggy_outcome.cpu.value,
                bug.buggy_outcome.cuda.value,
            )
        )
    _print_table(rows)
    histories = [bug for bug in _registry().BUGS if bug.history]
    if histories:
        print("\nhistory:")
    for bug in histories:
        print(f"  {bug.id}: {bug.history}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    bug = _registry().get(args.bug)
    print(f"{bug.id}: {bug.title}\nupstream:   {bug.upstream}\nsymptom:    {bug.symptom}")
    print(f"root cause: {bug.root_cause}\ntrigger:    {bug.trigger}")
    print(f"buggy:      cpu {bug.buggy_outcome.cpu.value}, cuda {bug.buggy_outcome.cuda.value}")
    print("fix parts:  (see each with git grep -n 'fix: PART')")
    for part in bug.fix_parts:
        print(f"  {part.value}")
    if bug.history:
        print(f"history:    {bug.history}")
    for s in bug.scenarios:
        print(f"\nscenario {s.name}  (repro run {bug.id} --scenario {s.name})")
        print("  " + s.doc.replace("\n", "\n  "))
        for rule in s.expects:
            parts = " or ".join(sorted(f.value for f in rule.missing))
            why = f"  ({rule.why})" if rule.why else ""
            print(
                f"  without {parts}: cpu {rule.outcome.cpu.value}, "
                f"cuda {rule.outcome.cuda.value}{why}"
            )
    return 0


# ---------------------------------------------------------------------------------------------
# run / check
# ---------------------------------------------------------------------------------------------


def _jobs(
    bug: BugRecord,
    fixes: Variant,
    device: str,
    names: Sequence[str],
    sanitizer: bool,
    seeds: Sequence[int] = (0,),
) -> list[Job]:
    known = [s.name for s in bug.scenarios]
    for name in names:
        if name not in known:
            raise UsageError(f"{bug.id} has no scenario {name!r}; scenarios: {', '.join(known)}")
    return [
        Job(bug.id, s.name, s.target, fixes, device, s.timeout_s, seed, sanitizer)
        for s in bug.scenarios
        if not names or s.name in names
        for seed in seeds
    ]


def _resolve_device(requested: str | None) -> str:
    try:
        return devices.resolve(requested)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _unavailable(device: str) -> str | None:
    """Why `device` cannot run here, or None."""
    if device == "cuda" and not devices.cuda_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    if device == "cuda":
        return _prepare_cuda()
    return None


def _prepare_cuda() -> str | None:
    """Build the csrc extensions once in the parent, before children race to build them."""
    from kernels import csrc

    for name in csrc.EXTENSIONS:
        start = time.monotonic()
        try:
            csrc.load(name)
        except Exception as e:
            return f"building csrc extension {name} failed: {e}"
        if time.monotonic() - start > 5:
            print(
                f"built csrc extension {name} in {time.monotonic() - start:.1f}s "
                f"(cache {csrc.cache_dir()})",
                file=sys.stderr,
            )
    return None


def _run_bug(args: argparse.Namespace) -> tuple[BugRecord, Variant, str, list[Result] | str]:
    device = _resolve_device(args.device)
    if args.sanitizer and device != "cuda":
        raise UsageError("--sanitizer checks GPU memory accesses: it needs --device cuda")
    with Isolator() as isolator:
        if not args.sanitizer and (device == "cpu" or devices.visible_gpus()):
            isolator.warm(device)  # its imports overlap ours
        bug = _registry().get(args.bug)
        fixes = select_variant(bug.fix_parts, args.variant, args.without, args.fixes)
        jobs = _jobs(bug, fixes, device, args.scenario, args.sanitizer)
        why_not = _unavailable(device)
        if args.sanitizer and not shutil.which("compute-sanitizer"):
            why_not = why_not or "compute-sanitizer is not on PATH"
        return bug, fixes, device, why_not if why_not else isolator.run_all(jobs)


def cmd_run(args: argparse.Namespace) -> int:
    bug, fixes, device, results = _run_bug(args)
    variant = describe(fixes, bug.fix_parts)
    if isinstance(results, str):
        print(
            json.dumps({"outcome": "skipped", "why": results})
            if args.json
            else f"{bug.id} [{variant}, {device}]: skipped: {results}"
        )
        return EXIT_CANNOT_TEST
    if args.json:
        print(json.dumps([_result_json(r, bug) for r in results], indent=2))
    for r in [] if args.json else results:
        expected = bug.scenario(r.job.scenario).expected(fixes, device)
        mark = "as expected" if r.outcome == expected else f"UNEXPECTED, expected {expected.value}"
        print(
            f"{bug.id} [{variant}, {device}] {r.job.scenario}: {r.outcome.value} "
            f"({mark}, {r.seconds:.1f}s{_scenario_time(r)})"
        )
        if r.evidence:
            print("    " + r.evidence.replace("\n", "\n    "))
    return exit_code(r.outcome for r in results)


def cmd_check(args: argparse.Namespace) -> int:
    bug, fixes, device, results = _run_bug(args)
    variant = describe(fixes, bug.fix_parts)
    if isinstance(results, str):
        print(f"{bug.id} [{variant}, {device}]: cannot test: {results}")
        return EXIT_CANNOT_TEST
    code = exit_code(r.outcome for r in results)
    verdict = {0: "absent", 1: "PRESENT", 125: "cannot test"}[code]
    summary = ", ".join(f"{r.job.scenario}={r.outcome.value}" for r in results)
    print(f"{bug.id} [{variant}, {device}]: {verdict} ({summary})")
    return code


# ---------------------------------------------------------------------------------------------
# matrix
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cell:
    """One matrix run with its expectation."""

    result: Result
    variant: str
    expected: Outcome

    @property
    def ok(self) -> bool:
        return self.result.outcome == self.expected


def _matrix_devices(requested: str) -> list[str]:
    if requested == "all":
        return ["cpu", "cuda"] if devices.cuda_available() else ["cpu"]
    return [_resolve_device(requested)]


def _variants(bug: BugRecord, each_part: bool) -> list[Variant]:
    variants = [select_variant(bug.fix_parts, "fixed"), bug.buggy_variant]
    if each_part and len(bug.fix_parts) > 1:
        variants += [select_variant(bug.fix_parts, "fixed", [p.value]) for p in bug.fix_parts]
    return variants


def cmd_matrix(args: argparse.Namespace) -> int:
    registry = _registry()
    bugs = [registry.get(b) for b in args.bug] if args.bug else list(registry.BUGS)
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1, got {args.repeat}")
    with Isolator() as isolator:
        plan = []
        for device in _matrix_devices(args.device):
            why_not = _unavailable(device)
            if why_not:
                print(f"{device}: skipped: {why_not}", file=sys.stderr)
                continue
            isolator.warm(device)
            for bug in bugs:
                for fixes in _variants(bug, args.each_part):
                    jobs = _jobs(bug, fixes, device, [], False, range(args.repeat))
                    plan += [(bug, j) for j in jobs]
        if not plan:
            print("matrix: nothing could run", file=sys.stderr)
            return EXIT_CANNOT_TEST
        start, records = time.monotonic(), {j: b for b, j in plan}
        progress = _progress(records, len(plan))
        results = isolator.run_all([j for _, j in plan], args.jobs, progress)
    cells = [_cell(records[r.job], r) for r in results]
    _print_summary(cells, time.monotonic() - start)
    if args.json:
        _write_json(args.json, cells)
    if args.junit:
        _write_junit(args.junit, cells)
    return 0 if all(c.ok for c in cells) else 1


def _cell(bug: BugRecord, r: Result) -> Cell:
    expected = bug.scenario(r.job.scenario).expected(r.job.fixes, r.job.device)
    return Cell(r, describe(r.job.fixes, bug.fix_parts), expected)


def _progress(records: dict[Job, BugRecord], total: int):
    done = [0]

    def show(r: Result) -> None:
        done[0] += 1
        cell = _cell(records[r.job], r)
        mark = "ok" if cell.ok else f"UNEXPECTED (expected {cell.expected.value})"
        print(
            f"[{done[0]:>3}/{total}] {r.job.bug} {cell.variant} {r.job.device} "
            f"{r.job.scenario}: {r.outcome.value} {mark} {r.seconds:.1f}s{_scenario_time(r)}",
            flush=True,
        )

    return show


def _scenario_time(r: Result) -> str:
    return "" if r.scenario_seconds is None else f" (scenario {r.scenario_seconds:.2f}s)"


def _print_summary(cells: list[Cell], seconds: float) -> None:
    """One row per (bug, variant, device, scenario); repeats are counted, not listed."""
    groups: dict[tuple[str, ...], list[Cell]] = {}
    for c in cells:
        j = c.result.job
        groups.setdefault((j.bug, c.variant, j.device, j.scenario, c.expected.value), []).append(c)
    rows = [("bug", "variant", "device", "scenario", "expected", "outcomes", "")]
    for key, group in groups.items():
        counts = Counter(c.result.outcome.value for c in group)
        seen = ", ".join(f"{o} x{n}" if len(group) > 1 else o for o, n in counts.items())
        ok = sum(c.ok for c in group)
        rows.append((*key, seen, "ok" if ok == len(group) else f"UNEXPECTED {len(group) - ok}"))
    print()
    _print_table(rows)
    ok = sum(c.ok for c in cells)
    print(f"\n{ok}/{len(cells)} runs as expected in {seconds:.1f}s")
    for c in [c for c in cells if not c.ok][:10]:
        j = c.result.job
        print(f"\nUNEXPECTED {j.bug} {c.variant} {j.device} {j.scenario} seed {j.seed}:")
        print("    " + c.result.evidence.replace("\n", "\n    "))


def _result_json(r: Result, bug: BugRecord) -> dict:
    return {
        "bug": r.job.bug,
        "scenario": r.job.scenario,
        "variant": describe(r.job.fixes, bug.fix_parts),
        "fixes_off": sorted(f.value for f in set(Fix) - r.job.fixes),
        "device": r.job.device,
        "outcome": r.outcome.value,
        "expected": bug.scenario(r.job.scenario).expected(r.job.fixes, r.job.device).value,
        "seed": r.job.seed,
        "seconds": round(r.seconds, 3),
        "scenario_seconds": None if r.scenario_seconds is None else round(r.scenario_seconds, 3),
        "evidence": r.evidence,
    }


def _write_json(path: str, cells: list[Cell]) -> None:
    registry = _registry()
    rows = [_result_json(c.result, registry.get(c.result.job.bug)) for c in cells]
    with open(path, "w") as f:
        json.dump(rows, f, indent=2)


def _write_junit(path: str, cells: list[Cell]) -> None:
    suite = ET.Element(
        "testsuite",
        name="repro-matrix",
        tests=str(len(cells)),
        failures=str(sum(not c.ok for c in cells)),
    )
    for c in cells:
        j = c.result.job
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"{j.bug}.{c.variant}.{j.device}",
            name=j.scenario,
            time=f"{c.result.seconds:.3f}",
        )
        if c.result.outcome == Outcome.SKIPPED and c.expected != Outcome.SKIPPED:
            ET.SubElement(case, "skipped", message=c.result.evidence)
        elif not c.ok:
            message = f"{c.result.outcome.value}, expected {c.expected.value}"
            ET.SubElement(case, "failure", message=message).text = c.result.evidence
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


COMMANDS = {
    "list": cmd_list,
    "info": cmd_info,
    "run": cmd_run,
    "check": cmd_check,
    "matrix": cmd_matrix,
}


def run_alone(bug_id: str) -> None:
    """`python -m repro.<bug> [matrix options]`: its fixed and buggy variants side by side."""
    main(["matrix", "--bug", bug_id, *sys.argv[1:]])


if __name__ == "__main__":
    main()
