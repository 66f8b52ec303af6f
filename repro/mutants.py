"""`repro mutants`: fix-site mutation testing of the reproducers.

Each bug keeps a catalogue of mutants (repro/<bug>/mutants.py): small plausible regressions
of the fixed code at or next to a fix site, one textual edit each. A mutant is applied to a
copy of the tree and `repro check BUG` runs on the copy (the copy's code in the parent and in
every child); a regression the reproducers guard against must read as present. Verdicts:
killed (exit 1), survived (exit 0), cannot test (exit 125: the regression hid behind an
error), stale (the edit no longer applies), n/a (its code does not run on that device: the CPU
runs the Triton twins of csrc/). Declared equivalent mutants run too and must pass.
Random operator mutation (mutmut, cosmic-ray) would mutate everything and rerun the suite per
mutant; these bugs live in a few fix sites whose relatives are known, so the catalogue targets
them and says why each edit matters.

Exit: 0 every scored mutant killed and every equivalent one passed, 1 otherwise, 125 nothing
ran, 130 interrupted, 2 usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import device as devices
from harness.fixes import UsageError, parse_fix
from harness.outcome import EXIT_CANNOT_TEST, EXIT_INTERRUPTED
from harness.record import Mutant
from harness.servers import ENV_SERVER, ROOT
from harness.userdir import ENV_SERVER_DIR
from repro import registry
from repro.common import parse_shard, print_table, shard_option, take_shard, unavailable, writable
from repro.results import replace

TREE = ("harness", "kernels", "repro", "csrc")  # what a check of a copy needs
CHECK_TIMEOUT_S = 1800.0
VERDICTS = {0: "survived", 1: "killed", 125: "cannot test"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("mutants", help="fix-site mutation testing: is every mutant caught?")
    m.add_argument("bug", nargs="*", help="only these bugs (default: every bug)")
    m.add_argument("--device", help="cpu, cuda, auto or all (default: $REPRO_DEVICE, else auto)")
    m.add_argument("--mutant", action="append", default=[], help="only this mutant (repeatable)")
    m.add_argument("--jobs", type=int, help="checks at once (default: the CPU count)")
    m.add_argument("--json", metavar="FILE", help="write the results as JSON")
    m.add_argument("--list", action="store_true", help="print the catalogue, run nothing")
    shard_option(m)
    m.add_argument(
        "--catalogue",
        metavar="FILE",
        action="append",
        default=[],
        help="regressions of your own (a JSON list, see docs/tools.md) instead of the "
        "project's mutants; repeatable; a directory: its *.json files (tests/regressions)",
    )
    m.add_argument(
        "--changed-since",
        metavar="REF",
        help="only the mutants of bugs whose package or regression file changed since the git "
        "revision REF, and those whose edit is in a file that changed (.ci/run's selection)",
    )
    m.add_argument(
        "--fuzz",
        type=float,
        metavar="SECONDS",
        help="also fuzz each mutant's tree this long (repro fuzz, seed 0): a second score",
    )
    m.set_defaults(run=cmd_mutants)


def catalogue(bug_id: str) -> tuple[Mutant, ...]:
    return importlib.import_module(f"repro.bugs.{bug_id}.mutants").MUTANTS


EXTERNAL_KEYS = {"bug", "name", "file", "old", "new", "why"}  # required; also devices, part
# and equivalent (why the edit changes nothing observable: then it must survive, unscored)


def catalogue_files(paths: list[str]) -> list[str]:
    """Each --catalogue FILE, a directory standing for its *.json files (sorted)."""
    found = []
    for path in paths:
        if Path(path).is_dir():
            files = sorted(str(p) for p in Path(path).glob("*.json"))
            if not files:
                raise UsageError(f"--catalogue {path}: no *.json file in this directory")
            found += files
        else:
            found.append(path)
    return found


def external(path: str, names: set[str] | None = None) -> list[tuple[str, Mutant]]:
    """Regressions kept outside the project (a JSON list of {bug, name, file, old, new, why},
    optionally devices, part and equivalent): each checked like a mutant of the catalogue, kind
    `external`. Any malformed entry is a usage error naming it; so is a name used twice (in
    `names` too: the names of the files read before)."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--catalogue {path}: {e}") from None
    if not isinstance(entries, list):
        raise UsageError(f"--catalogue {path}: not a JSON list")
    chosen, names = [], set() if names is None else names
    for i, entry in enumerate(entries):
        where = f"--catalogue {path}: entry {i}"
        if not isinstance(entry, dict) or EXTERNAL_KEYS - set(entry):
            missing = sorted(EXTERNAL_KEYS - set(entry)) if isinstance(entry, dict) else "all"
            raise UsageError(f"{where}: missing {missing}")
        if not all(isinstance(entry[k], str) for k in EXTERNAL_KEYS | {"equivalent"} & set(entry)):
            raise UsageError(f"{where}: {sorted(EXTERNAL_KEYS)} and equivalent must be strings")
        bug = registry.get(entry["bug"])
        if entry["name"] in names:
            raise UsageError(f"{where}: the name {entry['name']!r} is used twice")
        names.add(entry["name"])
        devices_ = tuple(entry.get("devices", ("cpu", "cuda")))
        if not devices_ or set(devices_) - {"cpu", "cuda"}:
            raise UsageError(f"{where}: devices must be a non-empty list of cpu, cuda")
        part = parse_fix(entry["part"]) if "part" in entry else None
        if part is not None and part not in bug.fix_parts:
            raise UsageError(f"{where}: {part.value} is not a part of {bug.id}")
        mutant = Mutant(
            entry["name"],
            part,
            "external",
            entry["file"],
            entry["old"],
            entry["new"],
            entry["why"],
            devices_,
            equivalent=entry.get("equivalent", ""),
        )
        chosen.append((bug.id, mutant))
    return chosen


@dataclass(frozen=True, slots=True)
class Cell:
    bug: str
    mutant: Mutant
    device: str
    verdict: str
    seconds: float = 0.0
    evidence: str = ""
    fuzz: str = ""  # with --fuzz: killed / survived / cannot test by a fuzz budget ("": not run)

    @property
    def scored(self) -> bool:
        return not self.mutant.equivalent and self.verdict not in ("n/a",)

    @property
    def ok(self) -> bool:
        if self.verdict == "n/a":
            return True
        return self.verdict == ("survived" if self.mutant.equivalent else "killed")


def _cost(chosen: tuple[str, Mutant]) -> float:
    """What checking a mutant of its bug costs: the bug's scenarios' usual cpu seconds."""
    bug = registry.get(chosen[0])
    return sum(bug.usual_s(s.name, "cpu") or 1.0 for s in bug.scenarios)


def _plan(args: argparse.Namespace) -> tuple[list[tuple[str, Mutant]], list[str]]:
    bugs = [registry.get(b).id for b in args.bug] or [b.id for b in registry.BUGS]
    if args.catalogue:
        names: set[str] = set()
        listed = [e for path in catalogue_files(args.catalogue) for e in external(path, names)]
        chosen = [(b, m) for b, m in listed if b in bugs]
    else:
        chosen = [(b, m) for b in bugs for m in catalogue(b)]
    names = {m.name for _, m in chosen}
    for name in args.mutant:
        if name not in names:
            raise UsageError(f"no mutant {name!r}; mutants: {', '.join(sorted(names))}")
    if args.mutant:
        chosen = [(b, m) for b, m in chosen if m.name in args.mutant]
    if args.changed_since:
        changed = _changed_since(args.changed_since)
        touched = lambda b, m: (
            m.file in changed
            or any(
                f.startswith(f"repro/bugs/{b}/") or f == f"tests/regressions/{b}.json"
                for f in changed
            )
        )
        chosen = [(b, m) for b, m in chosen if touched(b, m)]
    chosen = take_shard(chosen, parse_shard(args.shard), _cost, lambda c: (c[0], c[1].name))
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
    if args.fuzz is not None and not 0 < args.fuzz < float("inf"):
        raise UsageError(f"--fuzz takes seconds > 0, got {args.fuzz}")
    if args.json:
        writable(args.json, "--json")
    requested = args.device or os.environ.get(devices.ENV_DEVICE) or "auto"
    if requested == "all":
        return chosen, ["cpu", "cuda"]
    try:
        return chosen, [devices.resolve(devices.check_choice(requested))]
    except ValueError as e:
        raise UsageError(str(e)) from None


def _changed_since(ref: str) -> set[str]:
    """Files that differ between the revision `ref` and this checkout's work tree (untracked
    ones included), relative to its root."""
    root = Path(__file__).resolve().parent.parent
    runs = (["diff", "--name-only", ref, "--"], ["ls-files", "--others", "--exclude-standard"])
    found = set()
    for argv in runs:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *argv], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UsageError(f"--changed-since {ref}: git: {e}") from None
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or ["git failed"])[-1]
            raise UsageError(f"--changed-since {ref}: {why}")
        found |= set(done.stdout.split())
    return found


def cmd_mutants(args: argparse.Namespace) -> int:
    chosen, wanted = _plan(args)
    if args.changed_since and not chosen:
        print(f"mutants: no bug's files changed since {args.changed_since}: nothing to run")
        return 0
    if args.list:
        rows = [("bug", "mutant", "part", "kind", "devices", "why")]
        for bug, m in chosen:
            why = m.why + (f" [equivalent: {m.equivalent}]" if m.equivalent else "")
            rows.append((bug, m.name, _part(m), m.kind, ",".join(m.devices), why))
        print_table(rows)
        return 0
    runnable = []
    for device in wanted:
        why = unavailable(device)
        if why:
            print(f"{device}: skipped: {why}", file=sys.stderr)
        else:
            runnable.append(device)
    if not runnable:
        print("mutants: nothing could run", file=sys.stderr)
        return EXIT_CANNOT_TEST
    jobs = args.jobs or os.cpu_count() or 1  # each check runs its scenarios one at a time
    cells, interrupted = _run(chosen, runnable, jobs, args.json, args.fuzz or 0.0)
    _report(cells, runnable)
    if args.json:
        _write_json(args.json, cells)
    if interrupted:
        return EXIT_INTERRUPTED
    return 0 if all(c.ok for c in cells) else 1


def _write_json(path: str, cells: list[Cell]) -> None:
    replace(path, json.dumps([_cell_json(c) for c in cells], indent=2) + "\n")


def _run(chosen, devices_: list[str], jobs: int, json_path: str | None, fuzz_s: float = 0.0):
    """Every (mutant, device), at most `jobs` checks at once, each on its own copy (then, with
    `fuzz_s`, a fuzz of the copy); the JSON file (if any) rewritten after each, so a killed run
    leaves every finished cell there."""
    todo = [(b, m, d) for d in devices_ for b, m in chosen]
    cells: dict[int, Cell] = {}
    checked: dict[int, Cell] = {}  # checked, being fuzzed
    running: dict[int, tuple[subprocess.Popen, Path, float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="repro-mutants-") as tmp,
        _warm_servers(devices_, Path(tmp) / "servers") as env,
    ):
        pristine = Path(tmp) / "tree"
        for name in TREE:
            shutil.copytree(
                ROOT / name, pristine / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        queue = list(enumerate(todo))
        try:
            while queue or running:
                while queue and len(running) < jobs:
                    i, (bug, mutant, device) = queue.pop(0)
                    started = _start(bug, mutant, device, pristine, Path(tmp) / f"m{i}", env)
                    if isinstance(started, Cell):
                        cells[i] = started
                    else:
                        running[i] = (*started, time.monotonic())
                for i, (proc, copy, t0) in list(running.items()):
                    code = proc.poll()
                    if code is None and time.monotonic() - t0 < CHECK_TIMEOUT_S:
                        continue
                    if code is None:
                        _kill(proc)
                    out = proc.stdout.read() if proc.stdout else ""
                    bug, mutant, device = todo[i]
                    verdict = VERDICTS.get(code, f"exit {code}")
                    if i in checked:  # the fuzz of a checked mutant ended
                        cells[i] = dataclasses.replace(checked.pop(i), fuzz=verdict)
                    else:
                        cells[i] = Cell(bug, mutant, device, verdict, time.monotonic() - t0, out)
                    if fuzz_s and i not in checked and not cells[i].fuzz:
                        checked[i] = cells.pop(i)
                        running[i] = (_fuzz(device, copy, env, fuzz_s), copy, t0)
                        continue
                    del running[i]
                    shutil.rmtree(copy, ignore_errors=True)
                    _progress(cells[i], len(cells), len(todo))
                    if json_path:
                        _write_json(json_path, [cells[k] for k in sorted(cells)])
                time.sleep(0.1)
        except KeyboardInterrupt:
            for proc, _, _ in running.values():
                _kill(proc)
            return [cells[i] for i in sorted(cells)], True
    return [cells[i] for i in sorted(cells)], False


@contextlib.contextmanager
def _warm_servers(devices_: list[str], directory: Path):
    """Warm servers of this run alone, one per device, for every check (each would otherwise
    import torch for a server of its own); the checks' environment. Their children import each
    mutant's copy, never this tree. A server that does not start leaves checks to their own;
    $REPRO_SERVER=off starts none."""
    if os.environ.get(ENV_SERVER) == "off":
        yield dict(os.environ)
        return
    env = {**os.environ, ENV_SERVER: "auto", ENV_SERVER_DIR: str(directory)}
    serve = [sys.executable, "-m", "repro", "serve", "--idle", str(CHECK_TIMEOUT_S)]
    quiet = {"cwd": ROOT, "env": env, "stdout": subprocess.DEVNULL, "check": False}
    try:
        for device in devices_:
            subprocess.run([*serve, "--device", device], **quiet)
        yield env
    finally:
        for device in devices_:
            subprocess.run([*serve, "--device", device, "--stop"], **quiet)


def _start(bug: str, mutant: Mutant, device: str, pristine: Path, copy: Path, env: dict):
    """The check's process and copy, or a Cell when there is nothing to run."""
    if device not in mutant.devices:
        return Cell(
            bug, mutant, device, "n/a", 0.0, f"its code runs on {', '.join(mutant.devices)}"
        )
    target = pristine / mutant.file
    if target.read_text().count(mutant.old) != 1:
        return Cell(bug, mutant, device, "stale", 0.0, f"the edit does not apply to {mutant.file}")
    shutil.copytree(pristine, copy)
    path = copy / mutant.file
    path.write_text(path.read_text().replace(mutant.old, mutant.new))
    env = dict(env)
    if mutant.file.startswith("csrc/"):
        env["REPRO_CACHE_DIR"] = str(copy / ".cache")  # the mutant's own build
    check = [sys.executable, "-m", "repro", "check", bug, "--device", device, "--fail-fast"]
    proc = subprocess.Popen(
        check + (["--suspect", mutant.part.value] if mutant.part else []),
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, copy


def _fuzz(device: str, copy: Path, env: dict, seconds: float) -> subprocess.Popen:
    """`repro fuzz` of the mutant's copy (the fixed variant: the mutant is the regression)."""
    command = [sys.executable, "-m", "repro", "fuzz", "--device", device, "--seed", "0"]
    command += ["--budget", str(seconds), "--shrink", "0"]
    return subprocess.Popen(
        command,
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM the check's group (it then stops its own children), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _progress(cell: Cell, done: int, total: int) -> None:
    mark = "ok" if cell.ok else "HOLE"
    print(
        f"[{done:>3}/{total}] {cell.bug} {cell.mutant.name} {cell.device}: {cell.verdict} "
        f"{mark} {cell.seconds:.1f}s",
        flush=True,
    )


def _report(cells: list[Cell], devices_: list[str]) -> None:
    by_mutant: dict[tuple[str, str], dict[str, Cell]] = {}
    for c in cells:
        by_mutant.setdefault((c.bug, c.mutant.name), {})[c.device] = c
    fuzzed = any(c.fuzz for c in cells)
    columns = [*devices_, *(f"{d} fuzz" for d in devices_ if fuzzed)]
    rows = [("bug", "mutant", "part", "kind", *columns)]
    for (bug, name), per in by_mutant.items():
        m = next(iter(per.values())).mutant
        verdicts = [per[d].verdict if d in per else "-" for d in devices_]
        if fuzzed:
            verdicts += [(per[d].fuzz or "-") if d in per else "-" for d in devices_]
        kind = m.kind + (" (equivalent)" if m.equivalent else "")
        rows.append((bug, name, _part(m), kind, *verdicts))
    print()
    print_table(rows)
    for d in devices_:
        scored = [c for c in cells if c.device == d and c.scored]
        killed = sum(c.verdict == "killed" for c in scored)
        if scored:
            print(f"\n{d}: mutation score {killed}/{len(scored)} = {killed / len(scored):.0%}")
        fuzzed_here = [c for c in scored if c.fuzz]
        if fuzzed_here:
            by_fuzz = sum(c.fuzz == "killed" for c in fuzzed_here)
            print(
                f"{d}: fuzz score (second, not required) {by_fuzz}/{len(fuzzed_here)} = "
                f"{by_fuzz / len(fuzzed_here):.0%}"
            )
    if len(devices_) > 1:
        differ = [
            key
            for key, per in by_mutant.items()
            if len({c.verdict for c in per.values() if c.verdict != "n/a"}) > 1
        ]
        print(f"\nverdicts that differ between devices: {differ or 'none'}")
    for c in [c for c in cells if not c.ok]:
        tail = "\n    ".join(c.evidence.strip().splitlines()[-8:])
        print(f"\nHOLE {c.bug} {c.mutant.name} [{c.device}]: {c.verdict}\n    {tail}")


def _part(m: Mutant) -> str:
    return m.part.value if m.part else "-"


def _cell_json(c: Cell) -> dict:
    return {
        "bug": c.bug,
        "mutant": c.mutant.name,
        "part": _part(c.mutant),
        "kind": c.mutant.kind,
        "device": c.device,
        "verdict": c.verdict,
        "equivalent": c.mutant.equivalent,
        "ok": c.ok,
        "seconds": round(c.seconds, 2),
        "evidence": c.evidence[-4000:],
        **({"fuzz": c.fuzz} if c.fuzz else {}),
    }
