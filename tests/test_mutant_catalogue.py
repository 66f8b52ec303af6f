"""The fix-site mutant catalogue, checked without running it: every edit applies to the tree
exactly once (a refactor that makes one stale fails here, not in the nightly run), names a
registered part of its bug, and every fix part has at least five scored mutants."""

from __future__ import annotations

import collections

import pytest

from harness.isolate import ROOT
from harness.record import MUTANT_KINDS
from repro import registry
from repro.mutants import catalogue

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
