"""Records say how true they are (DESIGN.md section 15): every registered record carries a
fidelity grade with its evidence and what was not verified, `repro query --fields id,fidelity`
grades them all, and `repro info` shows the grade."""

from __future__ import annotations

import csv
import io
import subprocess

import pytest

from harness.record import FIDELITY_GRADES, Fidelity
from repro import registry
from tests import procs


def repro(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(procs.repro_command(*argv), capture_output=True, text=True, check=False)


@pytest.mark.parametrize("bug", registry.BUGS, ids=lambda b: b.id)
def test_every_record_is_graded_with_its_evidence(bug) -> None:
    f = bug.fidelity
    assert f is not None, f"{bug.id}: no fidelity (faithful, simplified, inspired, inferred)"
    assert f.grade in FIDELITY_GRADES and f.evidence and f.not_verified
    assert f.grade == "faithful" or f.what, f"{bug.id}: a {f.grade} record says what is {f.grade}"


def test_query_grades_every_bug() -> None:
    done = repro("query", "--fields", "id,fidelity")
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert {r["id"] for r in rows} == {b.id for b in registry.BUGS}
    assert all(r["fidelity"] in FIDELITY_GRADES for r in rows), rows


def test_info_shows_the_grade() -> None:
    done = repro("info", "spec_prewarm_captured_state")
    assert done.returncode == 0, done.stderr
    assert "fidelity:   inferred" in done.stdout


@pytest.mark.parametrize(
    ("grade", "what"), [("faithful-ish", ""), ("simplified", ""), ("inferred", "")]
)
def test_a_grade_must_be_known_and_a_lesser_one_says_what(grade, what) -> None:
    with pytest.raises(ValueError):
        Fidelity(grade, "read", "nothing", what)
