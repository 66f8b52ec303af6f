"""Oracles for scenarios: comparisons, canary-guarded buffers, one step's three-way check.

Test code only: the miniature runner (the code under test) never imports this module. Every
helper is deterministic: outputs are prefilled with sentinels, and divergences are reported
with counts and first positions. Integer outputs compare exactly; float ones through attention
to float32 rounding (`close`). (Poisoned allocations: harness.runner.poison; the decoder's
dense reference: harness.reference.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from harness.outcome import ENV_ORACLE, WrongResult

if TYPE_CHECKING:  # a scenario that never builds the runner must not import it (nor attention)
    from harness.runner.model_runner import ModelOutput

# of the largest expected magnitude, by the dtype the runner computed in: float32 rounding
# through attention; bfloat16's (8 significant bits, each store rounded once, float32
# accumulation) through the decoder's two layers: the fixed variants' worst measured 1.2e-2 on
# the CPU (the interpreter truncates to bfloat16) and 8.6e-3 on an H100 (2026-11-24)
RTOL = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 4e-2}


def mismatch(
    what: str, actual: torch.Tensor, expected: torch.Tensor, show: int = 4, atol: float = 0.0
) -> str | None:
    """None when equal (exactly, or within `atol`; NaN == NaN); else how they differ."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    differ = actual != expected if atol == 0 else (actual - expected).abs() > atol
    if actual.is_floating_point():
        differ |= actual.isnan() != expected.isnan()
        differ &= ~(actual.isnan() & expected.isnan())
    if not differ.any():
        return None
    where = differ.nonzero()[:show].tolist()
    pairs = ", ".join(
        f"{tuple(i)}: {actual[tuple(i)].item()} vs {expected[tuple(i)].item()}" for i in where
    )
    return f"{what}: {int(differ.sum())}/{differ.numel()} differ (actual vs expected) {pairs}"


def close(what: str, actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """`mismatch` within RTOL[actual's dtype] of the largest expected magnitude (float64
    comparison)."""
    rtol = RTOL[actual.dtype]
    expected = expected.detach().double().cpu()
    atol = rtol * max(float(expected.abs().max()), 1.0) if expected.numel() else 0.0
    return mismatch(what, actual.detach().double().cpu(), expected, atol=atol)


def step_problems(
    label: str,
    eager: ModelOutput,
    reference: tuple[torch.Tensor, torch.Tensor],
    replay: ModelOutput | None = None,
) -> list[str | None]:
    """One step three ways: eager vs the dense float64 reference (hidden states of every
    token, logits of every request), and a graph replay vs eager."""
    hidden, logits = reference
    problems = [
        close(f"{label}: eager hidden states vs reference", eager.hidden_states, hidden),
        close(f"{label}: eager logits vs reference", eager.logits, logits),
    ]
    if replay is not None:
        problems += [
            close(
                f"{label}: replay hidden states vs eager", replay.hidden_states, eager.hidden_states
            ),
            close(f"{label}: replay logits vs eager", replay.logits, eager.logits),
        ]
    return problems


def replay_problems(
    label: str,
    replay: ModelOutput,
    reference: tuple[torch.Tensor, torch.Tensor],
    eager: Callable[[], ModelOutput],
) -> list[str | None]:
    """A graph replay vs the dense float64 reference; only where they differ, the eager step
    too (`eager()`, run then), and the three compared as `step_problems` compares them, so a
    failure names which of replay and eager diverged. A replay that agrees with the reference
    needs no eager step: on the CPU that step was a fifth to a third of a capture scenario's
    interpreted time. What goes: an eager step that diverges while the replay agrees (the
    eager path's own scenarios check it against the reference)."""
    hidden, logits = reference
    if close(label, replay.hidden_states, hidden) or close(label, replay.logits, logits):
        return step_problems(label, eager(), reference, replay)
    return []


def expect_all(problems: list[str | None]) -> None:
    """Raise WrongResult with every non-None problem line (with the oracle off: print them, and
    let the scenario go on, so that only other detectors decide its outcome)."""
    found = [p for p in problems if p]
    if found and os.environ.get(ENV_ORACLE) == "off":
        print("oracle off, not raised:\n" + "\n".join(found), file=sys.stderr)
    elif found:
        raise WrongResult("\n".join(found))


@dataclass(frozen=True, slots=True)
class Guarded:
    """A buffer of `rows` rows inside a larger allocation whose extra rows hold a canary."""

    base: torch.Tensor  # [rows + canary_rows, *row_shape]
    rows: int
    canary: int | float

    @classmethod
    def make(
        cls,
        rows: int,
        row_shape: tuple[int, ...],
        canary_rows: int,
        fill: int | float,
        canary: int | float,
        dtype: torch.dtype,
        device: str,
    ) -> Guarded:
        base = torch.full((rows + canary_rows, *row_shape), canary, dtype=dtype, device=device)
        base[:rows] = fill
        return cls(base, rows, canary)

    @property
    def view(self) -> torch.Tensor:
        return self.base[: self.rows]

    def trampled(self, what: str) -> str | None:
        tail = self.base[self.rows :].cpu()
        hit = (tail != self.canary).reshape(tail.shape[0], -1).any(dim=1).nonzero().flatten()
        if hit.numel() == 0:
            return None
        rows = [self.rows + r for r in hit.tolist()]
        return f"{what}: canary overwritten in rows {rows} (past its {self.rows} real rows)"
