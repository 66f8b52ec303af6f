"""`repro export BUG PROPERTY` and `repro query`: the catalogue as data for tool builders.

export prints plain lines: `fix.lines` (`path:line` of each line the fix adds or changes, in the
fixed tree of `repro checkout`; lines of the code under test only, UNDER_TEST: a scenario or a
record that reads a switch is the catalogue, not the fix), `fix.buggy_lines` (the buggy tree's
lines the fix replaces or removes, and the line before each insertion), `fix.files`,
`scenarios.trigger` (the scenarios the bug fails, with their documented classes and failure
signatures), `tests.relevant` (the marker suite's test ids, as pytest collects them),
`kernels.launched` (the Triton kernels the trigger scenarios launch on the CPU, traced in a child).
query prints a CSV, one row per bug ever registered (retired ones as deprecated: ids are never
reused).
"""

from __future__ import annotations

import argparse
import ast
import csv
import difflib
import os
import re
import subprocess
import sys

from harness.fixes import ALL_FIXES, UsageError
from harness.outcome import EXIT_CANNOT_TEST, Outcome
from harness.record import BugRecord
from harness.servers import ROOT
from repro import registry
from repro.fold import FoldError, fold_bug

PROPERTIES = (
    "fix.lines",
    "fix.buggy_lines",
    "fix.files",
    "scenarios.trigger",
    "tests.relevant",
    "kernels.launched",
)
FIELDS = (
    "id",
    "upstream",
    "issues",
    "title",
    "cpu",
    "cuda",
    "fix_parts",
    "relatives",
    "added",
    "status",
    "fidelity",
    "fuzz",
    "ranks",
)
UNDER_TEST = ("kernels/", "csrc/", "harness/runner/")  # the code under test: where fixes live
TRACE_TIMEOUT_S = 600.0
PYTEST = (sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider")


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="one property of a bug, as plain lines")
    e.add_argument("bug")
    e.add_argument("property", help=", ".join(PROPERTIES))
    e.set_defaults(run=cmd_export)
    q = sub.add_parser("query", help="the catalogue as CSV, one row per bug")
    q.add_argument("--fields", help=f"comma-separated, of: {','.join(FIELDS)} (default: all)")
    q.set_defaults(run=cmd_query)


def cmd_export(args: argparse.Namespace) -> int:
    bug = registry.get(args.bug)
    if args.property not in PROPERTIES:
        raise UsageError(f"unknown property {args.property!r}; properties: {', '.join(PROPERTIES)}")
    try:
        lines = EXPORTS[args.property](bug)
    except (FoldError, OSError, subprocess.SubprocessError) as e:
        print(f"export: {bug.id} {args.property}: {e}", file=sys.stderr)
        return EXIT_CANNOT_TEST
    for line in lines:
        print(line)
    return 0


def fix_diff(bug: BugRecord) -> dict[str, tuple[str, str]]:
    """{path: (buggy text, fixed text)} of every file of the code under test the fix touches."""
    fixed = fold_bug(ROOT, bug, {p: True for p in bug.fix_parts})
    buggy = fold_bug(ROOT, bug, {p: False for p in bug.fix_parts})
    paths = sorted(set(fixed) | set(buggy))
    texts = {p: (buggy.get(p), fixed.get(p)) for p in paths}
    return {
        p: (b or (ROOT / p).read_text(), f or (ROOT / p).read_text())
        for p, (b, f) in texts.items()
        if p.startswith(UNDER_TEST)
        and (b or (ROOT / p).read_text()) != (f or (ROOT / p).read_text())
    }


def fix_lines(bug: BugRecord) -> list[str]:
    out = []
    for path, (buggy, fixed) in fix_diff(bug).items():
        a, b = buggy.splitlines(), fixed.splitlines()
        for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if tag in ("replace", "insert"):
                out += [f"{path}:{n}" for n in range(j1 + 1, j2 + 1) if b[n - 1].strip()]
    return out


def fix_buggy_lines(bug: BugRecord) -> list[str]:
    """`path:line` in the buggy tree of every line the fix replaces or removes, and of the line
    before each insertion (where a localizer must point for a fix that only adds code)."""
    out = []
    for path, (buggy, fixed) in fix_diff(bug).items():
        a, b = buggy.splitlines(), fixed.splitlines()
        for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if tag in ("replace", "delete"):
                out += [f"{path}:{n}" for n in range(i1 + 1, i2 + 1) if a[n - 1].strip()]
            elif tag == "insert":
                out.append(f"{path}:{max(i1, 1)}")
    return list(dict.fromkeys(out))


def fix_files(bug: BugRecord) -> list[str]:
    return list(fix_diff(bug))


def triggers(bug: BugRecord) -> list[str]:
    """`scenario cpu=CLASS cuda=CLASS`, and the signature where the record states one."""
    out = []
    for s in bug.scenarios:
        cpu, cuda = (s.expected(bug.buggy_variant, d) for d in ("cpu", "cuda"))
        if Outcome.PASS in (cpu, cuda) and cpu == cuda:
            continue
        signature = getattr(s, "signature", "")
        out.append(
            f"{s.name} cpu={cpu.value} cuda={cuda.value}"
            + (f" signature={signature}" if signature else "")
        )
    return out


def relevant_tests(bug: BugRecord) -> list[str]:
    """The marker suite's ids, collected by pytest (the tree's own conftest)."""
    proc = subprocess.run(
        [*PYTEST, "-m", bug.id, "--device", "cpu", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TRACE_TIMEOUT_S,
        check=False,
    )
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    if proc.returncode not in (0, 5) or not ids:
        raise subprocess.SubprocessError(f"pytest --collect-only exited {proc.returncode}")
    return ids


def launched(bug: BugRecord) -> list[str]:
    """The @triton.jit functions the trigger scenarios run (fixed variant, CPU interpreter)."""
    names = [line.split()[0] for line in triggers(bug)]
    ranked = [s for s in bug.scenarios if s.name in names and s.ranks > 1]
    if ranked:  # the trace runs each scenario once, in one process
        raise UsageError(
            f"kernels.launched traces a scenario in one process; {bug.id}'s {ranked[0].name} "
            f"runs as {ranked[0].ranks} ranks (repro run {bug.id} shows what its ranks run)"
        )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "repro.export", bug.id, *names],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TRACE_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise subprocess.SubprocessError(
            f"the trace exited {proc.returncode}: {proc.stderr[-300:]}"
        )
    return proc.stdout.split()


EXPORTS = {
    "fix.lines": fix_lines,
    "fix.buggy_lines": fix_buggy_lines,
    "fix.files": fix_files,
    "scenarios.trigger": triggers,
    "tests.relevant": relevant_tests,
    "kernels.launched": launched,
}


def jit_functions() -> dict[tuple[str, str], str]:
    """{(file, function): `kernels/file.py:function`} of every @triton.jit in kernels/."""
    found = {}
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                found[(str(path), node.name)] = f"kernels/{path.name}:{node.name}"
    return found


def _trace(bug_id: str, scenarios: list[str]) -> None:
    """In the traced child: run each scenario (fixed) under a profile hook, print the kernels."""
    import importlib

    from harness.record import Context

    bug = registry.get(bug_id)
    module = importlib.import_module(f"{bug.package}.scenarios")
    jits, seen = jit_functions(), set()

    def hook(frame, event, arg) -> None:
        if event == "call":
            key = (frame.f_code.co_filename, frame.f_code.co_name)
            if key in jits:
                seen.add(jits[key])

    for name in scenarios:
        sys.setprofile(hook)
        try:
            getattr(module, name)(Context(ALL_FIXES, "cpu"))
        finally:
            sys.setprofile(None)
    print("\n".join(sorted(seen)))


# -- query ------------------------------------------------------------------------------------


def _number(url: str) -> str:
    return "#" + url.rstrip("/").rsplit("/", 1)[-1]


def _issues(bug: BugRecord) -> str:
    text = " ".join((bug.title, bug.symptom, bug.history))
    found = re.findall(r"issues? ((?:#\d+(?:,? (?:and )?)?)+)", text)
    numbers = dict.fromkeys(n for group in found for n in re.findall(r"#\d+", group))
    return " ".join(numbers)


def _relatives(bug: BugRecord) -> str:
    text = " ".join((bug.history, bug.root_cause, bug.trigger, bug.symptom))
    ids = [b.id for b in registry.BUGS if b.id != bug.id and re.search(rf"\b{b.id}\b", text)]
    return " ".join(ids)


def _added(bug: BugRecord) -> str:
    """The date the record's package entered git (empty outside a git checkout)."""
    path = f"repro/bugs/{bug.id}/__init__.py"
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%as", "--", path],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return ""
    return out[-1] if out else ""


def row(bug: BugRecord) -> dict[str, str]:
    return {
        "id": bug.id,
        "upstream": _number(bug.upstream),
        "issues": _issues(bug),
        "title": bug.title,
        "cpu": bug.buggy_outcome.cpu.value,
        "cuda": bug.buggy_outcome.cuda.value,
        "fix_parts": " ".join(p.value for p in bug.fix_parts),
        "relatives": _relatives(bug),
        "added": _added(bug),
        "status": "active",
        "fidelity": bug.fidelity.grade if bug.fidelity else "",
        "fuzz": "target" if not bug.fuzz else bug.fuzz.split(":")[0],
        "ranks": str(max(s.ranks for s in bug.scenarios)),  # the world size its scenarios need
    }


def cmd_query(args: argparse.Namespace) -> int:
    fields = args.fields.split(",") if args.fields else list(FIELDS)
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        raise UsageError(f"unknown field(s) {', '.join(unknown)}; fields: {','.join(FIELDS)}")
    out = csv.DictWriter(sys.stdout, fields, extrasaction="ignore", lineterminator="\n")
    out.writeheader()
    for bug in registry.BUGS:
        out.writerow(row(bug))
    for bug_id, note in registry.RETIRED:
        out.writerow({"id": bug_id, "title": note, "status": "deprecated"})
    return 0


if __name__ == "__main__":
    _trace(sys.argv[1], sys.argv[2:])
    sys.exit(0)
