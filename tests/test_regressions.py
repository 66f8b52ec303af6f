"""Per-bug regression tests: every scenario, on the run's device, shows exactly its expected
outcome for the fixed variant (pass), the buggy variant, each single-part removal, and the
variants its own expectation rules name (one rule's parts off; all of them off: the chains).

Each case carries its bug's marker: `pytest -m moe_align_grid` selects exactly that bug.
"""

from __future__ import annotations

import pytest

from harness.fixes import ALL_FIXES, describe
from harness.isolate import Isolator, Job
from harness.outcome import Outcome
from repro.registry import BUGS


def _variants(bug, scenario) -> list:
    variants = [ALL_FIXES, bug.buggy_variant]
    if len(bug.fix_parts) > 1:
        variants += [ALL_FIXES - {part} for part in bug.fix_parts]
    variants += [ALL_FIXES - rule.missing for rule in scenario.expects]
    variants.append(ALL_FIXES.difference(*(rule.missing for rule in scenario.expects)))
    return list(dict.fromkeys(variants))


def _cases():
    for bug in BUGS:
        mark = getattr(pytest.mark, bug.id)
        for scenario in bug.scenarios:
            for fixes in _variants(bug, scenario):
                name = describe(fixes, bug.fix_parts).replace(" ", "-")
                yield pytest.param(
                    bug, scenario, fixes, marks=mark, id=f"{bug.id}-{scenario.name}-{name}"
                )


def _bugs():
    return [pytest.param(bug, marks=getattr(pytest.mark, bug.id), id=bug.id) for bug in BUGS]


@pytest.fixture(scope="session")
def isolator(device: str):
    """Children forked from one server per worker; on a GPU the csrc build happens first."""
    if device == "cuda":
        from kernels import csrc

        for name in csrc.EXTENSIONS:
            csrc.load(name)
    with Isolator() as iso:
        yield iso


@pytest.mark.parametrize(("bug", "scenario", "fixes"), list(_cases()))
def test_scenario_shows_expected_outcome(device, isolator, bug, scenario, fixes) -> None:
    expected = scenario.expected(fixes, device)
    result = isolator.run(
        Job(bug.id, scenario.name, bug.target(scenario), fixes, device, scenario.timeout_s)
    )
    assert result.outcome == expected, (
        f"{bug.id}/{scenario.name} [{describe(fixes, bug.fix_parts)}, {device}]: "
        f"{result.outcome.value}, expected {expected.value}\n{result.evidence}"
    )


@pytest.mark.parametrize("bug", _bugs())
@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_every_fix_part_is_necessary(bug, dev) -> None:
    for part in bug.fix_parts:
        seen = {s.expected(ALL_FIXES - {part}, dev) for s in bug.scenarios}
        assert seen - {Outcome.PASS}, f"removing only {part.value} fails no scenario on {dev}"


@pytest.mark.parametrize("bug", _bugs())
@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_record_matches_its_scenarios(bug, dev) -> None:
    assert all(s.expected(ALL_FIXES, dev) == Outcome.PASS for s in bug.scenarios)
    buggy = {s.expected(bug.buggy_variant, dev) for s in bug.scenarios}
    assert bug.buggy_outcome.on(dev) in buggy, f"no scenario shows the headline outcome on {dev}"
    assert all(o.is_failure or o == Outcome.PASS for o in buggy)
