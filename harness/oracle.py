"""Oracle helpers for scenarios: poisoned allocations, exact comparisons, canary-guarded buffers.

Every helper is deterministic: uninitialized memory is poisoned on purpose (PyTorch fills new
integer tensors with their maximum and floats with NaN), outputs are prefilled with sentinels,
and divergences are reported with counts and first positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from harness.outcome import WrongResult


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Inside: torch.empty (Python and C++) returns poison, not allocator leftovers."""
    # NOTE: set_deterministic_debug_mode, not use_deterministic_algorithms: the latter imports
    # torch._inductor (seconds per child) and the fill only needs the flag.
    previous_mode = torch.get_deterministic_debug_mode()
    previous_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.set_deterministic_debug_mode("warn")
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = previous_fill
        torch.set_deterministic_debug_mode(previous_mode)


def mismatch(what: str, actual: torch.Tensor, expected: torch.Tensor, show: int = 4) -> str | None:
    """None when equal (exactly, NaN == NaN); else how they differ."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    differ = actual != expected
    if actual.is_floating_point():
        differ &= ~(actual.isnan() & expected.isnan())
    if not differ.any():
        return None
    where = differ.nonzero()[:show].tolist()
    pairs = ", ".join(
        f"{tuple(i)}: {actual[tuple(i)].item()} vs {expected[tuple(i)].item()}" for i in where
    )
    return f"{what}: {int(differ.sum())}/{differ.numel()} differ (actual vs expected) {pairs}"


def expect_all(problems: list[str | None]) -> None:
    """Raise WrongResult with every non-None problem line."""
    found = [p for p in problems if p]
    if found:
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
