"""Bug records and scenarios as data (Defects4J-style): what each bug is and what it must show.

A scenario's expectations are ordered rules: the first rule one of whose fix parts is missing
from the variant decides the outcome; when no rule fires the scenario must pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.outcome import ByDevice, Outcome


@dataclass(frozen=True, slots=True)
class Context:
    """What a scenario function receives in its child process."""

    fixes: Variant
    device: str  # "cpu" (Triton interpreter) or "cuda"
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Expect:
    """When any of `missing` is off, the scenario shows `outcome` (per device)."""

    missing: frozenset[Fix]
    outcome: ByDevice
    why: str = ""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    fn: Callable[[Context], str]  # returns a one-line summary; raises WrongResult on divergence
    expects: tuple[Expect, ...]
    timeout_s: float = 120.0

    @property
    def target(self) -> str:
        """Importable name of the scenario function, for the child."""
        return f"{self.fn.__module__}:{self.fn.__qualname__}"

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip()

    def expected(self, fixes: Variant, device: str) -> Outcome:
        for rule in self.expects:
            if rule.missing - fixes:
                return rule.outcome.on(device)
        return Outcome.PASS


@dataclass(frozen=True, slots=True)
class BugRecord:
    id: str  # also the pytest marker; never reused
    title: str
    upstream: str  # PR link
    symptom: str
    root_cause: str
    trigger: str
    fix_parts: tuple[Fix, ...]
    buggy_outcome: ByDevice  # the headline failure upstream users saw
    scenarios: tuple[Scenario, ...]
    history: str = ""

    @property
    def buggy_variant(self) -> Variant:
        return ALL_FIXES - frozenset(self.fix_parts)

    def scenario(self, name: str) -> Scenario:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise KeyError(name)
