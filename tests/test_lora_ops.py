"""LoRA shrink/expand kernels against the float64 references (in float32 and upstream's float16
and bfloat16: tests/dtypes.py), and the host early exit."""

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
from tests.dtypes import LORA_DTYPES, cases

SHAPES = [
    ([0, -1, 1, 1, 0, -1, 1], 64, 16, 48, 1),
    ([1] * 37, 40, 16, 17, 2),
    ([-1, 0] * 20 + [2], 33, 32, 24, 3),
    # upstream's ranks below the 16-wide block (test_punica_ops: 1, 4, 8, ..., 256)
    ([2, -1, 0, 0, 1] * 3, 40, 1, 24, 2),
    ([0, 1, -1] * 7, 33, 4, 17, 1),
    ([1, 2, 2, -1, 0, 1, 0], 64, 8, 48, 3),
    ([0, -1, 2] * 4, 48, 64, 20, 1),
]
# The expand's y: float32 exact (small integers: every product and sum is exact, so is a
# float32 store); float16 and bfloat16 rounded once on the store, checked with upstream's
# tolerances (tests/lora/utils.py assert_close: rtol = atol = 6e-2 for both)
EXPAND_TOLERANCE = {torch.float32: 0.0, torch.float16: 6e-2, torch.bfloat16: 6e-2}


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
    ("slots", "hidden", "rank", "width", "num_slices", "dtype"),
    cases(SHAPES, LORA_DTYPES, cpu=[1, 3]),
)
def test_shrink_then_expand_match_reference(device, slots, hidden, rank, width, num_slices, dtype):
    max_loras, scale, n = 3, 0.5, len(slots)
    gen = torch.Generator().manual_seed(3)
    ints = lambda *shape: torch.randint(-2, 3, shape, generator=gen).to(dtype)
    x = ints(n, hidden)
    lora_a = ints(num_slices, max_loras, rank, hidden)
    lora_b = ints(num_slices, max_loras, width, rank)
    y = ints(n, num_slices * width)
    meta = make_meta(slots, max_loras, device)
    # float32 (upstream's shrink output), exact from any input dtype: integers and halves
    buffer = torch.full((num_slices, n, rank), -7.0, device=device)
    lora_shrink(x.to(device), lora_a.to(device), buffer, meta, scale)
    shrunk = lora_shrink_reference(x, lora_a, slots, scale)
    lora_rows = torch.tensor([s != -1 for s in slots])
    assert torch.equal(buffer.cpu().double()[:, lora_rows], shrunk[:, lora_rows])
    assert (buffer.cpu()[:, ~lora_rows] == -7.0).all(), "shrink wrote rows of base tokens"
    y_dev = y.clone().to(device)  # the reference needs y as it was
    lora_expand(buffer, lora_b.to(device), y_dev, meta)
    expected = lora_expand_reference(y, buffer.cpu(), lora_b, slots)
    tol = EXPAND_TOLERANCE[dtype]
    torch.testing.assert_close(y_dev.cpu().double(), expected, rtol=tol, atol=tol)


def test_launchers_refuse_dtypes_their_kernels_do_not_serve(device) -> None:
    meta = make_meta([0, 1, -1], 2, device)
    x = torch.ones(3, 32, dtype=torch.bfloat16, device=device)
    buffer = torch.zeros(1, 3, 16, device=device)
    lora_a = torch.ones(1, 2, 16, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"lora_a: torch\.float16"):
        lora_shrink(x, lora_a, buffer, meta, 1.0)
    with pytest.raises(ValueError, match=r"buffer: torch\.int32"):
        lora_shrink(x, lora_a.bfloat16(), buffer.int(), meta, 1.0)


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
