"""The fix-site mutant catalogue, checked without running it: every edit applies to the tree
exactly once (a refactor that makes one stale fails here, not in the nightly run), names a
registered part of its bug, and every fix part has at least five scored mutants."""

from __future__ import annotations

import collections
import json
import subprocess

import pytest

from harness.isolate import ROOT
from harness.record import MUTANT_KINDS
from repro import registry
from repro.mutants import catalogue
from tests import procs

CASES = [(bug.id, m) for bug in registry.BUGS for m in catalogue(bug.id)]


@pytest.mark.parametrize(("bug", "mutant"), CASES, ids=[f"{b}-{m.name}" for b, m in CASES])
def test_mutant_applies_exactly_once(bug, mutant) -> None:
    text = (ROOT / mutant.file).read_text()
    assert text.count(mutant.old) == 1, f"{bug}/{mutant.name}: stale edit of {mutant.file}"
    assert mutant.part in registry.get(bug).fix_parts and mutant.kind in MUTANT_KINDS


@pytest.mark.parametrize("bug", [b.id for b in registry.BUGS])
def test_every_fix_part_has_five_scored_mutants(bug) -> None:
    scored = collections.Counter(m.part for m in catalogue(bug) if not m.equivalent)
    thin = {p.value: scored[p] for p in registry.get(bug).fix_parts if scored[p] < 5}
    assert not thin, f"{bug}: fewer than five scored mutants: {thin}"


def _catalogue(tmp_path, entries) -> str:
    path = tmp_path / "mine.json"
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries))
    return str(path)


REAL = {
    "bug": "block_table_wake",
    "name": "wake_reinit_skipped",
    "file": "harness/runner/model_runner.py",
    "old": "        if Fix.BLOCK_TABLE_REINIT_ON_WAKE in self.fixes:",
    "new": "        if Fix.BLOCK_TABLE_REINIT_ON_WAKE not in self.fixes:",
    "why": "the layout tensors are rebuilt only when the fix is off",
}
INERT = {**REAL, "name": "comment_only", "old": "Called by the worker", "new": "Called by it"}


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ("[", "--catalogue"),
        ({"bug": "x"}, "not a JSON list"),
        ([{"bug": "block_table_wake"}], "entry 0: missing ['file', 'name', 'new', 'old', 'why']"),
        ([{**REAL, "bug": "nope"}], "unknown bug id 'nope'"),
        ([REAL, REAL], "the name 'wake_reinit_skipped' is used twice"),
        ([{**REAL, "devices": ["tpu"]}], "devices must be a non-empty list of cpu, cuda"),
        ([{**REAL, "part": "capture_prewarm"}], "capture_prewarm is not a part of"),
        ([{**REAL, "old": 3}], "must be strings"),
    ],
)
def test_a_bad_catalogue_of_your_own_is_a_usage_error(tmp_path, entries, message) -> None:
    done = subprocess.run(
        procs.repro_command("mutants", "--catalogue", _catalogue(tmp_path, entries), "--list"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_catalogue_of_your_own_is_scored_like_the_projects(tmp_path) -> None:
    """A regression of your own is killed, an inert edit survives (a hole: exit 1), each named."""
    out = tmp_path / "cells.json"
    done = subprocess.run(
        procs.repro_command(
            "mutants",
            "--catalogue",
            _catalogue(tmp_path, [REAL, INERT]),
            "--device",
            "cpu",
            "--json",
            str(out),
        ),
        capture_output=True,
        text=True,
        check=False,
    )
    verdicts = {c["mutant"]: (c["verdict"], c["kind"]) for c in json.loads(out.read_text())}
    assert verdicts == {
        "wake_reinit_skipped": ("killed", "external"),
        "comment_only": ("survived", "external"),
    }, done.stdout
    assert done.returncode == 1 and "HOLE block_table_wake comment_only" in done.stdout


REGRESSIONS = sorted((ROOT / "tests" / "regressions").glob("*.json"))


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: p.stem)
def test_an_independent_regression_set_loads_and_applies(path) -> None:
    """tests/regressions/BUG.json (issue 41): one-edit regressions written from the record and
    the fixed code alone; each loads as a --catalogue entry of its bug and still applies (its
    `old` text occurs once in its file)."""
    from repro.mutants import external

    chosen = external(str(path))
    assert len(chosen) >= 4 and {bug for bug, _ in chosen} == {path.stem}
    for _, mutant in chosen:
        text = (ROOT / mutant.file).read_text()
        assert text.count(mutant.old) == 1, f"{mutant.name}: stale ({mutant.file})"


def test_every_bug_has_its_independent_regression_set() -> None:
    """Each of the bugs keeps one (issue 41; docs/adding-a-bug.md's definition of done)."""
    missing = sorted({b.id for b in registry.BUGS} - {p.stem for p in REGRESSIONS})
    assert not missing, f"no tests/regressions/BUG.json for {missing}"


def test_the_regressions_directory_is_read_whole_and_selected_by_change(monkeypatch) -> None:
    import argparse

    from repro import mutants

    def plan(**kw):
        args = dict(bug=[], mutant=[], shard=None, jobs=None, fuzz=None, json=None)
        args.update(device="cpu", catalogue=["tests/regressions"], changed_since=None)
        args.update(kw)
        return [(b, m.name) for b, m in mutants._plan(argparse.Namespace(**args))[0]]

    monkeypatch.chdir(ROOT)
    whole = plan()
    assert len(whole) == sum(len(json.loads(p.read_text())) for p in REGRESSIONS)
    edited = {m.file for _, m in mutants.external(str(REGRESSIONS[0]))}
    some = sorted(edited)[0]
    monkeypatch.setattr(mutants, "_changed_since", lambda ref: {some})
    chosen = plan(changed_since="HEAD")
    wanted = [(b, n) for b, n in whole if any(m.file == some for m in _by_name(b, n))]
    assert chosen == wanted and chosen
    bug = REGRESSIONS[1].stem
    monkeypatch.setattr(mutants, "_changed_since", lambda ref: {f"repro/bugs/{bug}/scenarios.py"})
    assert {b for b, _ in plan(changed_since="HEAD")} == {bug}
    monkeypatch.setattr(mutants, "_changed_since", lambda ref: {"README.md"})
    assert plan(changed_since="HEAD") == []


def _by_name(bug: str, name: str) -> list:
    from repro.mutants import external

    return [
        m
        for b, m in external(str(ROOT / "tests" / "regressions" / f"{bug}.json"))
        if m.name == name
    ]


def test_changed_since_a_revision_git_does_not_know_is_a_usage_error() -> None:
    done = subprocess.run(
        procs.repro_command(
            "mutants",
            "--catalogue",
            "tests/regressions",
            "--changed-since",
            "no-such-revision",
            "--device",
            "cpu",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 2 and "--changed-since no-such-revision" in done.stderr
