"""Oracles for scenarios: exact comparisons, canary-guarded buffers, the decoder's reference.

Test code only: the miniature runner (the code under test) never imports this module. Every
helper is deterministic: outputs are prefilled with sentinels, and divergences are reported
with counts and first positions. (Poisoned allocations: harness.runner.poison.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from harness.outcome import WrongResult

if TYPE_CHECKING:  # a scenario that never builds the decoder must not import it (nor attention)
    from harness.runner.model import TinyLoRADecoder


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


def decoder_reference(
    model: TinyLoRADecoder, token_ids: list[int], slots: list[int]
) -> torch.Tensor:
    """The decoder's logits computed densely in float64 on the CPU, without attention; slot -1 =
    base model. Independent of the runner's kernels and LoRA plumbing."""
    c = model.config
    d = lambda t: t.detach().double().cpu()
    h = d(model.embed)[token_ids]
    for t, s in enumerate(slots):
        if s != -1:
            h[t] += d(model.embed_a)[s * c.vocab_size + token_ids[t]] @ d(model.embed_b[0, s]).T
    width = c.hidden_size // model.LAYER_SLICES
    for w, a, b in zip(model.layers, model.lora_a, model.lora_b, strict=True):
        y = h @ d(w).T
        for t, s in enumerate(slots):
            for k in range(model.LAYER_SLICES if s != -1 else 0):
                delta = c.lora_scale * (h[t] @ d(a[k, s]).T) @ d(b[k, s]).T
                y[t, k * width : (k + 1) * width] += delta
        h = y.relu()
    return h @ d(model.head).T
