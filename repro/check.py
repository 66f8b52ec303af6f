"""`repro run` and `repro check`: one bug's scenarios, once (run) or with every failure
confirmed by a second run (check, the verdict `git bisect run` reads; exit codes in
CHECK_EPILOG). Every argument is checked before anything heavy starts."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass

from harness import device as devices
from harness.fixes import ALL_FIXES, UsageError, Variant, describe, parse_fix, select_variant
from harness.isolate import (
    SANITIZER_TOOLS,
    Interrupted,
    Isolator,
    Job,
    Result,
)
from harness.outcome import (
    EXIT_CANNOT_TEST,
    Outcome,
    exit_code,
)
from harness.record import BugRecord
from repro import registry
from repro.common import (
    capped,
    device_choice,
    dtype_option,
    evidence_lines,
    prepare,
    time_limit,
    timeout_option,
    warn_tight,
)

CHECK_EPILOG = """\
exit codes (git bisect run):
  0    every selected scenario ran and passed: the bug is absent
  1    a scenario ran and failed (wrong_result, device_assert, illegal_address, crash,
       timeout, sanitizer_error, collective_mismatch: ranks that disagree on their
       collectives, exception: a Python exception raised by the code under test), and
       a second run showed the same class: the bug is present
  125  cannot test: the project does not import (or exits while it imports), a build
       failed, the harness or a scenario broke (error), no device, bad environment,
       interrupted, the failure did not reproduce (flaky), or a timeout at a limit too tight
       to tell (--timeout under 5x the scenario's usual time, which its record ships); with
       --symptom, also a failure of another class than the scenario's documented one
  2    usage error, found before anything heavy starts
  never 128 or more"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="run a bug's scenarios once, print outcomes and evidence",
        description="Run once; exit codes as check's, without the confirming run.",
    )
    _variant_options(run)
    run.add_argument("--json", action="store_true", help="print results as JSON")
    run.set_defaults(run=cmd_run)
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
    check.add_argument(
        "--suspect",
        metavar="PART",
        help="run first the scenarios that show this fix part's absence (with --fail-fast: "
        "a regression of PART ends the check sooner); repro mutants passes each mutant's part",
    )
    check.add_argument("--json", metavar="FILE", help="write the verdict and results as JSON")
    check.set_defaults(run=cmd_check)


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
    jobs = [
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
            ranks=s.ranks,
        )
        for s in bug.scenarios
        if not args.scenario or s.name in args.scenario
    ]
    warn_tight([(bug, job) for job in jobs], cap)
    suspect = getattr(args, "suspect", None)
    if suspect:
        _own_parts(bug, [suspect])
        without = ALL_FIXES - {parse_fix(suspect)}
        shows = {s.name for s in bug.scenarios if s.expected(without, device) != Outcome.PASS}
        jobs.sort(key=lambda job: job.scenario not in shows)  # stable: the record's order else
    return Plan(bug, fixes, device, tuple(jobs))


def _why_not(plan: Plan, isolator: Isolator, sanitizer: bool) -> str | None:
    if sanitizer and plan.device != "cuda":
        return "no CUDA device is available for --sanitizer"
    if sanitizer and not shutil.which("compute-sanitizer"):
        return "compute-sanitizer is not on PATH"
    return prepare(isolator, plan.device)


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
    hangs = [_hang(p.bug, r) for r in results]
    for r in [] if args.json else results:
        expected = p.bug.scenario(r.job.scenario).expected(p.fixes, p.device)
        mark = "as expected" if r.outcome == expected else f"UNEXPECTED, expected {expected.value}"
        if not _hang(p.bug, r):
            mark = f"{_too_tight(p.bug, r)}: cannot test"
        print(f"{p.label} {r.job.scenario}: {r.outcome.value} ({mark}, {r.seconds:.1f}s)")
        if r.evidence:
            print(evidence_lines(r.evidence, "    "))
    if why_not:
        print(f"{p.label}: skipped: {why_not}", file=sys.stderr if args.json else sys.stdout)
        return EXIT_CANNOT_TEST
    return exit_code((r.outcome for r in results), hangs)


def _hang(bug: BugRecord, r: Result) -> bool:
    """False for a timeout at a limit too tight to tell a hang (BugRecord.hang_shown)."""
    scenario = bug.scenario(r.job.scenario)
    return r.outcome != Outcome.TIMEOUT or bug.hang_shown(scenario, r.job.device, r.job.timeout_s)


def _too_tight(bug: BugRecord, r: Result) -> str:
    why = bug.tight(bug.scenario(r.job.scenario), r.job.device, r.job.timeout_s)
    return f"stopped at a limit of {r.job.timeout_s:g}s, too tight to tell a hang ({why})"


@dataclass(frozen=True, slots=True)
class Finding:
    """One scenario's first run, its confirming run (if it failed), and whether it counts."""

    first: Result
    again: Result | None
    documented: frozenset[Outcome] | None  # --symptom: the classes that count
    signed: bool = True  # --symptom: the evidence matches the scenario's failure signature
    tight: str = ""  # a timeout at a limit too tight to tell a hang: why (then it never counts)
    settled_by: str = ""  # left unconfirmed: this scenario's confirmed failure settled the verdict

    @property
    def flaky(self) -> bool:
        return self.again is not None and self.again.outcome != self.first.outcome

    @property
    def counted(self) -> bool:
        o = self.first.outcome
        documented = self.documented is None or (o in self.documented and self.signed)
        return not self.flaky and documented and not self.tight and not self.settled_by

    def describe(self) -> str:
        o = self.first.outcome.value
        if not self.first.outcome.is_failure:
            return o
        if self.tight:
            return f"{o}, {self.tight}: cannot test, not counted"
        if self.settled_by:
            return f"{o}, not confirmed: {self.settled_by}'s confirmed failure settled the verdict"
        if self.flaky:
            return f"{o}, then {self.again.outcome.value} on a second run: flaky, not counted"
        confirmed = ", confirmed by a second run" if self.again is not None else ""
        if not self.counted and self.first.outcome in self.documented:
            return f"{o}{confirmed}; its evidence lacks the failure's signature: a mismatch"
        if not self.counted:
            shown = ", ".join(sorted(d.value for d in self.documented))
            return f"{o}{confirmed}; not its documented symptom ({shown}): not counted"
        return f"{o}{confirmed}"


def cmd_check(args: argparse.Namespace) -> int:
    p = plan(args)
    if args.json:
        from repro.common import writable

        writable(args.json, "--json")

    def find(first: Result, again: Result | None, settled_by: str = "") -> Finding:
        scenario = p.bug.scenario(first.job.scenario)
        return Finding(
            first,
            again,
            scenario.documented(p.device) if args.symptom else None,
            scenario.signed(first.evidence, p.device),
            "" if _hang(p.bug, first) else _too_tight(p.bug, first),
            settled_by if first.outcome.is_failure else "",
        )

    confirm = None
    with Isolator() as isolator:
        isolator.warm(p.device)
        why_not = _why_not(p, isolator, args.sanitizer)
        if why_not:
            print(f"{p.label}: cannot test: {why_not}")
            return EXIT_CANNOT_TEST
        try:
            if args.fail_fast:  # in the record's order, one at a time
                first = isolator.run_all(p.jobs, 1, stop_on_failure=True)
                failed = [r.job for r in first if r.outcome.is_failure]
                again = {} if args.no_confirm else _by_job(isolator.run_all(failed))
            elif args.no_confirm:
                first, again = isolator.run_all(p.jobs), {}
            else:  # a failure's confirming run starts as soon as it failed (one at a time)
                starts, twins = _schedule(p, keep_order=bool(args.suspect))
                confirm = _Confirm(lambda r, a: find(r, a).counted, twins)
                ran = isolator.run_all(
                    starts, _workers(p, starts), then=confirm, until=confirm.stop, drop=confirm.drop
                )
                by_job: dict[Job, Result] = {}
                for job, r in zip(starts, ran, strict=False):  # a twin's copy is its job's
                    by_job.setdefault(job, confirm.firsts.get(job, r))
                first = [by_job[job] for job in p.jobs]  # reported in the record's order
                again = confirm.again
        except Interrupted:
            print(f"{p.label}: cannot test: interrupted")
            return EXIT_CANNOT_TEST
    settled = confirm.settled_by if not args.fail_fast and confirm else ""
    findings = [find(r, again.get(r.job), settled if r.job not in again else "") for r in first]
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


def _schedule(p: Plan, keep_order: bool = False) -> tuple[list[Job], list[Job]]:
    """(every run to start, in that order; the twins among them). Where the record expects a
    scenario to fail under the variant checked (`--variant buggy`, `--without`), the one
    usually soonest to end starts first with its twin (its second run) beside it, on the CPU
    as on a GPU: the two settle exit 1 together, and no other run queues ahead of its
    confirmation. The other scenarios start longest first (by the usual seconds the record
    ships), so that the last to start are short and the CPUs finish together. What runs, and
    the verdict, are the same in any order; only the wall differs. `keep_order`: the plan's
    order (--suspect chose it), twins on idle CPUs only."""
    if keep_order:
        twins = _twins(p.jobs, p.device)
        return [*p.jobs, *twins], twins
    usual = {job: p.bug.usual_s(job.scenario, p.device) for job in p.jobs}
    seconds = lambda job: float("inf") if usual[job] is None else usual[job]
    fails = [
        job
        for job in p.jobs
        if p.bug.scenario(job.scenario).expected(p.fixes, p.device).is_failure
        and (job.ranks == 1 or p.device != "cpu")  # two CPUs hold one run of ranks
    ]
    # the soonest to end; unknown or alike: the fewest ranks (the fewest processes to share a GPU)
    lead = min(fails, key=lambda job: (seconds(job), job.ranks)) if fails else None
    rest = sorted((job for job in p.jobs if job != lead), key=seconds, reverse=True)
    if lead is None:
        twins = _twins(tuple(rest), p.device)
        return [*rest, *twins], twins
    # twins of the rest on CPUs still idle: the lead's two runs counted as two jobs
    idle = [job for job in _twins((lead, lead, *rest), p.device) if job != lead]
    # the lead's twin (its second run, the same job) at the normal priority: its confirmation
    # is expected
    return [lead, lead, *rest, *idle], [lead, *idle]


def _workers(p: Plan, starts: list[Job]) -> int | None:
    """Processes at once (None: as many as the machine has CPUs). On a GPU, where the run that
    starts first with its twin (_schedule's lead) is a run of ranks: those two runs' ranks, so
    the other scenarios start only as they end, and not at all once the two settle exit 1.
    Every rank shares the one GPU: rank_rng_divergence's buggy check ran its four-rank
    scenario beside the two-rank lead's two runs, eight processes (docs/measurements/speed.md)."""
    lead = starts[0] if len(starts) > 1 and starts[0] == starts[1] else None
    if p.device == "cpu" or lead is None or lead.ranks < 2:
        return None
    return 2 * lead.ranks


TWIN_NICE = 10  # a twin's niceness (os.nice): it yields to the first runs and to other work


def _twins(jobs: tuple[Job, ...], device: str) -> list[Job]:
    """Second runs to start beside the first ones, on CPUs the check would leave idle: a
    scenario's run and its twin are its two runs, whichever ends first being the first (a
    failure's twin is its confirmation; a pass stops its twin). Idle means beyond other work
    too: on a 2-CPU machine under other work a twin slowed a one-scenario fixed check by about
    40% (docs/measurements/speed.md). A twin runs at a lower priority. Not on a GPU,
    where every run queues its context's work behind the others', nor for ranks."""
    if device != "cpu":
        return []
    idle = (os.cpu_count() or 1) - _busy() - sum(max(1, job.ranks) for job in jobs)
    twins = [job for job in jobs if job.ranks == 1][: max(0, idle)]
    return [dataclasses.replace(job, nice=TWIN_NICE) for job in twins]


def _busy() -> int:
    """CPUs other work holds now: the processes running at this instant besides this one (the
    kernel's count; a load average would count this check's own last runs)."""
    try:
        with open("/proc/loadavg") as f:
            return max(0, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        return round(os.getloadavg()[0])


class _Confirm:
    """A scenario's second run confirms its failure: its twin (_twins), or else a confirming
    run (the same job again, its own child) started as soon as it failed, one failure at a
    time; once one confirmation counts, the verdict is settled (exit 1) and the other failures
    stay unconfirmed. A confirmation that does not count (flaky, or under --symptom an
    undocumented class) hands over to the next failure. Once settled, the scenarios still
    running are stopped and those waiting never start (`skipped`, the reason given): a GPU
    queues its contexts' work, two CPUs run two children at once, so each run saved is time off
    the check. `repro matrix` runs every scenario to its end."""

    def __init__(self, counts: Callable[[Result, Result], bool], twins=()) -> None:
        self.counts, self.twins = counts, set(twins)
        self.firsts: dict[Job, Result] = {}  # each scenario's run that ended first
        self.again: dict[Job, Result] = {}  # a failure's second run, ended
        self.waiting: collections.deque[Job] = collections.deque()
        self.in_flight: Job | None = None
        self.settled_by: str = ""  # the scenario whose confirmation settled the verdict
        self.passed: dict[Job, str] = {}  # twins no longer needed, for run_all's `drop`

    def __call__(self, result: Result) -> Job | None:
        job = result.job
        first = self.firsts.setdefault(job, result)
        if first is result:  # a scenario's first run to end
            if not result.outcome.is_failure:
                if job in self.twins:
                    self.passed[job] = f"{job.scenario} passed (its twin is not needed)"
                return None
            if job not in self.twins and not self.settled_by:
                self.waiting.append(job)  # its twin, in flight, is its confirmation
            return self._next() if self.in_flight is None else None
        if not first.outcome.is_failure or result.outcome == Outcome.SKIPPED:
            return None  # a twin stopped: its copy passed, or the verdict was settled
        if job in self.twins and Outcome.TIMEOUT == result.outcome != first.outcome:
            # a twin starved at its lower priority tells nothing: a plain confirmation decides
            self.twins.discard(job)
            if not self.settled_by:
                self.waiting.append(job)
            return self._next() if self.in_flight is None else None
        self.again[job] = result
        if job == self.in_flight:
            self.in_flight = None
        if self.counts(first, result):
            self.settled_by = job.scenario
            self.waiting.clear()
            return None
        return self._next() if self.in_flight is None else None

    def drop(self) -> dict[Job, str]:
        """The twins whose copy passed (run_all stops them)."""
        passed, self.passed = self.passed, {}
        return passed

    def _next(self) -> Job | None:
        self.in_flight = self.waiting.popleft() if self.waiting else None
        # at the normal priority, whichever copy (a twin's) the failure came from
        return self.in_flight and dataclasses.replace(self.in_flight, nice=0)

    def stop(self) -> str:
        """Why the rest need not run: exit 1 is settled, whatever they would show (a confirmed
        failure outranks every other result), and on a GPU or two CPUs they queue ahead of
        nothing the verdict needs."""
        if not self.settled_by:
            return ""
        return f"the verdict was settled by {self.settled_by} (failed twice)"


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
