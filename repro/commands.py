"""The `repro` subcommands: list, info, run, check, matrix (in repro.matrix).

Every argument and environment variable is checked before anything heavy starts (no torch in
this process, ever: the fork server and the children import it). Exit codes of check (and run,
without the confirming run) are git bisect run's; see CHECK_EPILOG.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness import device as devices
from harness.child import PREPARE
from harness.fixes import ALL_FIXES, UsageError, Variant, describe, parse_fix, select_variant
from harness.isolate import (
    ENV_ISOLATION,
    MODES,
    SANITIZER_TOOLS,
    Interrupted,
    Isolator,
    Job,
    Result,
)
from harness.outcome import (
    EXIT_CANNOT_TEST,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Outcome,
    exit_code,
)
from harness.record import DTYPES, BugRecord
from harness.servers import ENV_SERVER
from harness.userdir import ENV_SERVER_DIR
from repro import registry

CHECK_EPILOG = """\
exit codes (git bisect run):
  0    every selected scenario ran and passed: the bug is absent
  1    a scenario ran and failed (wrong_result, device_assert, illegal_address, crash,
       timeout, sanitizer_error, exception: a Python exception raised by the code under
       test), and a second run showed the same class: the bug is present
  125  cannot test: the project does not import, a build failed, the harness or a scenario
       broke (error), no device, bad environment, interrupted, or the failure did not
       reproduce (flaky); with --symptom, also a failure of another class than the
       scenario's documented one
  2    usage error, found before anything heavy starts
  never 128 or more"""
ENV_TIMEOUT = "REPRO_TIMEOUT"  # caps every scenario's time limit, as --timeout does
BUILD_TIMEOUT_S = 900.0  # the first csrc build takes about a minute; a loaded machine, more
EVIDENCE_LINES = 6


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep our wording
        raise UsageError(message)


def _variant_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("bug", help="bug id (repro list)")
    p.add_argument("--variant", choices=("fixed", "buggy"), help="default: fixed (all fixes on)")
    p.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="PART",
        help="switch one of the bug's fix parts off (repeatable)",
    )
    p.add_argument("--fixes", metavar="none", help="'none': every fix part of every bug off")
    p.add_argument("--device", help="cpu, cuda or auto (default: $REPRO_DEVICE, else auto)")
    p.add_argument("--scenario", action="append", default=[], help="only this scenario")
    timeout_option(p)
    dtype_option(p)
    p.add_argument(
        "--sanitizer",
        nargs="?",
        const="memcheck",
        choices=SANITIZER_TOOLS,
        metavar="TOOL",
        help=f"run children under compute-sanitizer's TOOL ({', '.join(SANITIZER_TOOLS)}; "
        "default memcheck)",
    )


def dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the runner's dtype: weights, activations, KV cache (scenarios that build no "
        "runner run as written); default float32",
    )


def timeout_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help=f"shorten every scenario's time limit to at most SECONDS (also ${ENV_TIMEOUT})",
    )


def _seconds(value: float | str, name: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"{name} must be a finite number of seconds above 0, got {value!r}")
    return seconds


def time_limit(args: argparse.Namespace) -> float | None:
    """The cap on every scenario's time limit: --timeout, else $REPRO_TIMEOUT, else none."""
    if getattr(args, "timeout", None) is not None:
        return _seconds(args.timeout, "--timeout")
    value = os.environ.get(ENV_TIMEOUT)
    return None if value is None else _seconds(value, f"${ENV_TIMEOUT}")


def capped(timeout_s: float, cap: float | None) -> float:
    return timeout_s if cap is None else min(timeout_s, cap)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="repro", description="Reproducers for GPU inference-engine bugs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("list", help="table of registered bugs")
    sub.add_parser("info", help="the full record of one bug").add_argument("bug")
    run = sub.add_parser(
        "run",
        help="run a bug's scenarios once, print outcomes and evidence",
        description="Run once; exit codes as check's, without the confirming run.",
    )
    _variant_options(run)
    run.add_argument("--json", action="store_true", help="print results as JSON")
    check = sub.add_parser(
        "check",
        help="bisect-friendly verdict: exit 0 absent, 1 present, 125 cannot test",
        description="Is the bug present in this tree? Failures are confirmed by a second run.",
        epilog=CHECK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _variant_options(check)
    check.add_argument(
        "--symptom",
        action="store_true",
        help="count only the failure classes the record documents; other failures exit 125",
    )
    check.add_argument(
        "--no-confirm", action="store_true", help="exit 1 on a first failure, without a rerun"
    )
    check.add_argument(
        "--fail-fast",
        action="store_true",
        help="one scenario at a time, none after a failure (reported skipped)",
    )
    check.add_argument("--json", metavar="FILE", help="write the verdict and results as JSON")
    from repro import bench, detectors, fuzz, matrix, mutants, report, serve

    matrix.add_parser(sub)
    fuzz.add_parser(sub)
    detectors.add_parser(sub)
    mutants.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    report.add_parsers(sub)
    return parser


def dispatch(argv: Sequence[str]) -> int:
    """Parse, check and run one command; its exit code (usage errors: 2)."""
    command = None
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        check_environment()
        time_limit(args)
        return COMMANDS[command](args)
    except UsageError as e:
        print(f"repro: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("repro: interrupted", file=sys.stderr)
        return (
            EXIT_INTERRUPTED if command in ("matrix", "mutants", "detectors") else EXIT_CANNOT_TEST
        )


def check_environment() -> None:
    """Every environment variable the tool reads, valid or a usage error."""
    if os.environ.get(ENV_ISOLATION, "fork") not in MODES:
        raise UsageError(
            f"${ENV_ISOLATION} must be one of {', '.join(MODES)}, got {os.environ[ENV_ISOLATION]!r}"
        )
    try:
        devices.check_choice(None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if os.environ.get(ENV_SERVER, "auto") not in ("auto", "off"):
        raise UsageError(f"${ENV_SERVER} must be auto or off, got {os.environ[ENV_SERVER]!r}")
    for name in ("REPRO_CACHE_DIR", ENV_SERVER_DIR):
        value = os.environ.get(name)
        if value is not None and (not value or (Path(value).exists() and not Path(value).is_dir())):
            raise UsageError(f"${name} must name a directory, got {value!r}")


def device_choice(requested: str | None) -> str:
    try:
        return devices.check_choice(requested)
    except ValueError as e:
        raise UsageError(str(e)) from None


def unavailable(device: str) -> str | None:
    """Why `device` cannot run here, or None (cheap: no torch, no CUDA initialization)."""
    if device == "cuda" and devices.torch_cuda_version() is None:
        return "no CUDA device is available: the installed torch is a CPU build"
    if device == "cuda" and not devices.visible_gpus():
        return "no CUDA device is available: no GPU visible (driver files, CUDA_VISIBLE_DEVICES)"
    return None


def prepare(isolator: Isolator, device: str) -> str | None:
    """Build the csrc extensions once, in a child, before scenario children race to build
    them under their own time limits; why the device cannot run, or None."""
    why = unavailable(device)
    if why or device != "cuda" or _builds_fresh():
        return why
    job = Job("csrc", "build", PREPARE, ALL_FIXES, "cuda", BUILD_TIMEOUT_S)
    result = isolator.run(job)
    if result.seconds > 5:
        print(f"csrc build: {result.outcome.value} in {result.seconds:.1f}s", file=sys.stderr)
    if result.outcome != Outcome.PASS:
        return f"preparing cuda failed ({result.outcome.value}): {result.evidence}"
    return None


def _builds_fresh() -> bool:
    """Every csrc build is fresh for the installed torch: no build child needed (a child still
    loads them; a stale or missing one is built by the child above). The versions are torch's
    own (torch/version.py): the cache is named after torch.__version__, which can differ from
    the package metadata's version (a local part such as +cu130)."""
    from kernels import csrc  # NOTE: torch-free at import; cache_dir needs the versions given

    version = devices.torch_version()
    return version is not None and csrc.all_fresh(version, devices.torch_cuda_version())


# ---------------------------------------------------------------------------------------------
# list / info
# ---------------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    rows = [("id", "upstream", "fix parts", "buggy (cpu)", "buggy (cuda)")]
    for bug in registry.BUGS:
        rows.append(
            (
                bug.id,
                "#" + bug.upstream.rsplit("/", 1)[-1],
                ", ".join(f.value for f in bug.fix_parts),
                bug.buggy_outcome.cpu.value,
                bug.buggy_outcome.cuda.value,
            )
        )
    print_table(rows)
    histories = [bug for bug in registry.BUGS if bug.history]
    if histories:
        print("\nhistory:")
    for bug in histories:
        print(f"  {bug.id}: {bug.history}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    bug = registry.get(args.bug)
    print(f"{bug.id}: {bug.title}\nupstream:   {bug.upstream}\nsymptom:    {bug.symptom}")
    print(f"root cause: {bug.root_cause}\ntrigger:    {bug.trigger}")
    print(f"buggy:      cpu {bug.buggy_outcome.cpu.value}, cuda {bug.buggy_outcome.cuda.value}")
    print("fix parts:  (see each with git grep -n 'fix: PART'; upstream: where it sits there)")
    anchors = dict(bug.anchors)
    for part in bug.fix_parts:
        print(f"  {part.value}" + (f"\n    upstream: {anchors[part]}" if part in anchors else ""))
    if bug.history:
        print(f"history:    {bug.history}")
    docs = bug.docs()
    for s in bug.scenarios:
        print(f"\nscenario {s.name}  (repro run {bug.id} --scenario {s.name})")
        print("  " + docs[s.name].replace("\n", "\n  "))
        for line in s.axes.lines():
            print(f"  axis {line}")
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


@dataclass(frozen=True, slots=True)
class Plan:
    """A checked run/check request."""

    bug: BugRecord
    fixes: Variant
    device: str
    jobs: tuple[Job, ...]

    @property
    def label(self) -> str:
        return f"{self.bug.id} [{describe(self.fixes, self.bug.fix_parts)}, {self.device}]"


def _own_parts(bug: BugRecord, names: list[str]) -> None:
    for name in names:
        part = parse_fix(name)
        if part not in bug.fix_parts:
            owner = next(b.id for b in registry.BUGS if part in b.fix_parts)
            own = ", ".join(p.value for p in bug.fix_parts)
            raise UsageError(
                f"--without {name}: a fix part of {owner}, not of {bug.id} (its parts: {own}); "
                "--fixes none switches every part of every bug off"
            )


def plan(args: argparse.Namespace) -> Plan:
    """Everything checked, nothing started."""
    bug = registry.get(args.bug)
    _own_parts(bug, args.without)
    fixes = select_variant(bug.fix_parts, args.variant, args.without, args.fixes)
    known = [s.name for s in bug.scenarios]
    for name in args.scenario:
        if name not in known:
            raise UsageError(f"{bug.id} has no scenario {name!r}; scenarios: {', '.join(known)}")
    choice = device_choice(args.device)
    if args.sanitizer and choice == "cpu":
        raise UsageError("--sanitizer checks GPU memory accesses: it needs --device cuda")
    device = devices.resolve(choice)
    cap = time_limit(args)
    jobs = tuple(
        Job(
            bug.id,
            s.name,
            bug.target(s),
            fixes,
            device,
            capped(s.timeout_s, cap),
            0,
            args.sanitizer,
            dtype=args.dtype,
        )
        for s in bug.scenarios
        if not args.scenario or s.name in args.scenario
    )
    return Plan(bug, fixes, device, jobs)


def _why_not(plan: Plan, isolator: Isolator, sanitizer: bool) -> str | None:
    if sanitizer and plan.device != "cuda":
        return "no CUDA device is available for --sanitizer"
    if sanitizer and not shutil.which("compute-sanitizer"):
        return "compute-sanitizer is not on PATH"
    return prepare(isolator, plan.device)


def evidence_lines(evidence: str, indent: str = "      ") -> str:
    """A few lines: the head says what diverged, the tail how a traceback ended."""
    lines = evidence.strip().splitlines()
    if len(lines) > EVIDENCE_LINES:
        head, tail = EVIDENCE_LINES // 2, EVIDENCE_LINES - EVIDENCE_LINES // 2 - 1
        skipped = len(lines) - head - tail
        lines = [*lines[:head], f"... ({skipped} lines)", *lines[-tail:]]
    return "\n".join(indent + line for line in lines)


def cmd_run(args: argparse.Namespace) -> int:
    p = plan(args)
    with Isolator() as isolator:
        isolator.warm(p.device)
        why_not = _why_not(p, isolator, args.sanitizer)
        try:
            results = [] if why_not else isolator.run_all(p.jobs)
        except Interrupted as e:
            results, why_not = e.results, "interrupted"
    if args.json:
        from repro import results as documents

        rows = [documents.result_json(r, p.bug) for r in results]
        extra = {"verdict": {"exit": EXIT_CANNOT_TEST, "text": why_not}} if why_not else {}
        print(json.dumps(documents.document(rows, **extra), indent=2))
    for r in [] if args.json else results:
        expected = p.bug.scenario(r.job.scenario).expected(p.fixes, p.device)
        mark = "as expected" if r.outcome == expected else f"UNEXPECTED, expected {expected.value}"
        print(f"{p.label} {r.job.scenario}: {r.outcome.value} ({mark}, {r.seconds:.1f}s)")
        if r.evidence:
            print(evidence_lines(r.evidence, "    "))
    if why_not:
        print(f"{p.label}: skipped: {why_not}", file=sys.stderr if args.json else sys.stdout)
        return EXIT_CANNOT_TEST
    return exit_code(r.outcome for r in results)


@dataclass(frozen=True, slots=True)
class Finding:
    """One scenario's first run, its confirming run (if it failed), and whether it counts."""

    first: Result
    again: Result | None
    documented: frozenset[Outcome] | None  # --symptom: the classes that count

    @property
    def flaky(self) -> bool:
        return self.again is not None and self.again.outcome != self.first.outcome

    @property
    def counted(self) -> bool:
        o = self.first.outcome
        return not self.flaky and (self.documented is None or o in self.documented)

    def describe(self) -> str:
        o = self.first.outcome.value
        if not self.first.outcome.is_failure:
            return o
        if self.flaky:
            return f"{o}, then {self.again.outcome.value} on a second run: flaky, not counted"
        confirmed = ", confirmed by a second run" if self.again is not None else ""
        if not self.counted:
            shown = ", ".join(sorted(d.value for d in self.documented))
            return f"{o}{confirmed}; not its documented symptom ({shown}): not counted"
        return f"{o}{confirmed}"


def cmd_check(args: argparse.Namespace) -> int:
    p = plan(args)
    if args.json:
        from repro.matrix import writable

        writable(args.json, "--json")
    with Isolator() as isolator:
        isolator.warm(p.device)
        why_not = _why_not(p, isolator, args.sanitizer)
        if why_not:
            print(f"{p.label}: cannot test: {why_not}")
            return EXIT_CANNOT_TEST
        try:
            workers = 1 if args.fail_fast else None  # in the record's order, one at a time
            first = isolator.run_all(p.jobs, workers, stop_on_failure=args.fail_fast)
            failed = [r.job for r in first if r.outcome.is_failure]
            again = {} if args.no_confirm else _by_job(isolator.run_all(failed))
        except Interrupted:
            print(f"{p.label}: cannot test: interrupted")
            return EXIT_CANNOT_TEST
    findings = [
        Finding(
            r,
            again.get(r.job),
            p.bug.scenario(r.job.scenario).documented(p.device) if args.symptom else None,
        )
        for r in first
    ]
    code = exit_code((f.first.outcome for f in findings), (f.counted for f in findings))
    print(f"{p.label}: {_verdict(code, findings)}")
    if args.json:
        from repro import results as documents

        rows = [
            {
                **documents.result_json(f.first, p.bug),
                "confirmation": f.again.outcome.value if f.again else None,
            }
            for f in findings
        ]
        verdict = {"exit": code, "text": f"{p.label}: {_verdict(code, findings)}"}
        documents.write(args.json, documents.document(rows, verdict=verdict))
    for f in findings:
        print(f"  {f.first.job.scenario}: {f.describe()}")
        if f.first.outcome != Outcome.PASS and f.first.evidence:
            print(evidence_lines(f.first.evidence))
    return code


def _by_job(results: list[Result]) -> dict[Job, Result]:
    return {r.job: r for r in results}


def _verdict(code: int, findings: list[Finding]) -> str:
    summary = ", ".join(f"{f.first.job.scenario}={f.first.outcome.value}" for f in findings)
    if code == 0:
        return f"absent ({summary})"
    if code == 1:
        return f"PRESENT ({summary})"
    flaky = [f.first.job.scenario for f in findings if f.flaky]
    if flaky:
        return f"cannot test: flaky ({', '.join(flaky)}; {summary})"
    return f"cannot test ({summary})"


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def _matrix(args: argparse.Namespace) -> int:
    from repro import matrix

    return matrix.cmd_matrix(args)


def _fuzz(args: argparse.Namespace) -> int:
    from repro import fuzz

    return fuzz.cmd_fuzz(args)


def _mutants(args: argparse.Namespace) -> int:
    from repro import mutants

    return mutants.cmd_mutants(args)


def _detectors(args: argparse.Namespace) -> int:
    from repro import detectors

    return detectors.cmd_detectors(args)


def _serve(args: argparse.Namespace) -> int:
    from repro import serve

    return serve.cmd_serve(args)


def _bench(args: argparse.Namespace) -> int:
    from repro import bench

    return bench.cmd_bench(args)


def _report(args: argparse.Namespace) -> int:
    from repro import report

    return report.cmd_report(args)


def _diff(args: argparse.Namespace) -> int:
    from repro import report

    return report.cmd_diff(args)


COMMANDS = {
    "list": cmd_list,
    "info": cmd_info,
    "run": cmd_run,
    "check": cmd_check,
    "matrix": _matrix,
    "mutants": _mutants,
    "fuzz": _fuzz,
    "detectors": _detectors,
    "serve": _serve,
    "bench": _bench,
    "report": _report,
    "diff": _diff,
}
