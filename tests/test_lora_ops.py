"""LoRA shrink/expand kernels against the float64 references, and the host early exit."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_ops import (
    KernelMeta,
    lora_expand,
    lora_expand_reference,
    lora_programs,
    lora_shrink,
    lora_shrink_reference,
)


def make_meta(slots: list[int], max_loras: int, device: str) -> KernelMeta:
    """Kernel metadata for per-token LoRA slots, built the plain way (no runner)."""
    mapping = torch.tensor(slots, dtype=torch.int32)
    order = torch.sort(mapping, stable=True).indices.int()
    ids, counts = torch.unique(mapping, sorted=True, return_counts=True)
    active = torch.full((max_loras + 1,), -1, dtype=torch.int32)
    per_lora = torch.zeros(max_loras + 1, dtype=torch.int32)
    start = torch.zeros(max_loras + 2, dtype=torch.int32)
    active[: ids.numel()], per_lora[: ids.numel()] = ids, counts
    start[1 : ids.numel() + 1] = counts.cumsum(0)
    return KernelMeta(
        mapping.to(device),
        order.to(device),
        active.to(device),
        per_lora.to(device),
        start.to(device),
        torch.tensor([bool((mapping == -1).all())]),
        torch.tensor([ids.numel()], dtype=torch.int32),
    )


@pytest.mark.parametrize(
    ("slots", "hidden", "rank", "width", "num_slices"),
    [
        ([0, -1, 1, 1, 0, -1, 1], 64, 16, 48, 1),
        ([1] * 37, 40, 16, 17, 2),
        ([-1, 0] * 20 + [2], 33, 32, 24, 3),
        # upstream's ranks below the 16-wide block (test_punica_ops: 1, 4, 8, ..., 256)
        ([2, -1, 0, 0, 1] * 3, 40, 1, 24, 2),
        ([0, 1, -1] * 7, 33, 4, 17, 1),
        ([1, 2, 2, -1, 0, 1, 0], 64, 8, 48, 3),
        ([0, -1, 2] * 4, 48, 64, 20, 1),
    ],
)
def test_shrink_then_expand_match_reference(device, slots, hidden, rank, width, num_slices):
    max_loras, scale, n = 3, 0.5, len(slots)
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (n, hidden), generator=gen).float()
    lora_a = torch.randint(-2, 3, (num_slices, max_loras, rank, hidden), generator=gen).float()
    lora_b = torch.randint(-2, 3, (num_slices, max_loras, width, rank), generator=gen).float()
    y = torch.randint(-2, 3, (n, num_slices * width), generator=gen).float()
    meta = make_meta(slots, max_loras, device)
    buffer = torch.full((num_slices, n, rank), -7.0, device=device)
    lora_shrink(x.to(device), lora_a.to(device), buffer, meta, scale)
    shrunk = lora_shrink_reference(x, lora_a, slots, scale)
    lora_rows = torch.tensor([s != -1 for s in slots])
    assert torch.equal(buffer.cpu().double()[:, lora_rows], shrunk[:, lora_rows])
    assert (buffer.cpu()[:, ~lora_rows] == -7.0).all(), "shrink wrote rows of base tokens"
    y_dev = y.clone().to(device)  # the reference needs y as it was
    lora_expand(buffer, lora_b.to(device), y_dev, meta)
    expected = lora_expand_reference(y, buffer.cpu(), lora_b, slots)
    assert torch.equal(y_dev.cpu().double(), expected)


@pytest.mark.lora_graph_capture
def test_no_lora_flag_returns_before_launching(device) -> None:
    meta = make_meta([-1, -1, -1], 2, device)
    launched = []
    x, buffer = torch.ones(3, 32, device=device), torch.zeros(1, 3, 16, device=device)
    lora_shrink(
        x,
        torch.ones(1, 2, 16, 32, device=device),
        buffer,
        meta,
        1.0,
        launch=lambda fn, *a, **k: launched.append(fn),
    )
    assert launched == [] and bool(meta.no_lora_flag_cpu[0])


@pytest.mark.lora_graph_capture
@pytest.mark.parametrize(
    ("specialize", "active", "programs"),
    [(False, 1, 3), (False, 3, 3), (True, 1, 1), (True, 3, 3), (True, 0, 0)],
)
def test_launch_modes(device, specialize, active, programs) -> None:
    """Default: max_loras + 1 LoRA programs whatever the batch; specialised: as many as
    num_active_loras_cpu says (none: no launch)."""
    meta = make_meta([0, 1, -1], 2, device)
    meta.num_active_loras_cpu[0] = active
    grids = []
    x, buffer = torch.ones(3, 32, device=device), torch.zeros(1, 3, 16, device=device)
    lora_a = torch.ones(1, 2, 16, 32, device=device)
    lora_shrink(x, lora_a, buffer, meta, 1.0, lambda fn, *a, **k: grids.append(fn), specialize)
    assert lora_programs(meta, 2, specialize) == programs
    assert len(grids) == (programs > 0)
