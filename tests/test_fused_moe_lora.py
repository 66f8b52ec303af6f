"""The fused MoE-LoRA shrink and expand consumers against the dense reference, fed by
reference align, in float32 and upstream's float16 and bfloat16 (tests/dtypes.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe_lora import (
    fused_moe_lora_expand,
    fused_moe_lora_expand_reference,
    fused_moe_lora_shrink,
    fused_moe_lora_shrink_reference,
)
from kernels.moe_lora_align import align_sizes, moe_lora_align_reference
from tests.dtypes import LORA_DTYPES, cases

# the kernels vLLM #40131 feeds and #32277 launches
pytestmark = [pytest.mark.moe_align_grid, pytest.mark.moe_lora_consumer_grid]
SHAPES = [
    (7, 2, 8, 16, 200, [], 16),
    (29, 3, 5, 32, 131, [1], 16),
    (3, 1, 4, 16, 64, [0], 16),
    # ranks below tl.dot's 16 (upstream serves 1..256; test_punica_ops runs 1, 4, 8, ...): the
    # rank's block is padded to 16 and masked, in the shrink's N and the expand's K
    (11, 2, 8, 1, 40, [], 16),
    (13, 2, 5, 4, 72, [1], 16),
    (17, 3, 8, 8, 131, [], 32),
    (9, 2, 4, 64, 48, [], 16),
]
# realistic sizes (hidden 4096, 64 experts, top-k 6): a GPU only, in every dtype
REALISTIC = [
    (48, 6, 64, 4, 4096, [], 16),
    (48, 6, 64, 8, 4096, [], 16),
    (48, 6, 64, 16, 4096, [], 16),
    (48, 6, 64, 32, 4096, [], 16),
    (48, 6, 64, 64, 4096, [], 64),
]
CASES = cases(SHAPES, LORA_DTYPES, cpu=[2, 3], gpu_only=REALISTIC)
# float32 exact (small integers: every product and sum is exact); float16 and bfloat16 round
# each output once, checked with upstream's tolerance (test_fused_moe_lora_kernel.py:
# atol = rtol = 1e-2 for both)
TOLERANCE = {torch.float32: 0.0, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "rank", "hidden", "disabled", "block_size", "dtype"),
    CASES,
)
def test_shrink_and_expand_match_dense_reference(
    device, num_tokens, top_k, num_experts, rank, hidden, disabled, block_size, dtype
) -> None:
    max_loras = 2
    gen = torch.Generator().manual_seed(1)
    topk = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    mapping = torch.randint(-1, max_loras, (num_tokens,), generator=gen, dtype=torch.int32)
    lora_ids = torch.tensor([-1, 0, 1], dtype=torch.int32)
    enabled = torch.ones(max_loras + 1, dtype=torch.int32)
    enabled[disabled] = 0
    padded, m_blocks = align_sizes(topk.numel(), num_experts, block_size)
    prefill = (
        torch.full((max_loras, padded), -2, dtype=torch.int32),
        torch.full((max_loras, m_blocks), -7, dtype=torch.int32),
        torch.full((max_loras,), -13, dtype=torch.int32),
    )
    aligned = moe_lora_align_reference(
        topk,
        mapping,
        lora_ids,
        enabled,
        prefill,
        num_experts=num_experts,
        block_size=block_size,
        max_loras=max_loras,
    )
    ints = lambda *shape: torch.randint(-2, 3, shape, generator=gen).to(dtype)
    x, lora_a = ints(num_tokens, hidden), ints(max_loras, num_experts, rank, hidden)
    # the shrink's output in the model's dtype, as upstream's intermediate cache
    out = torch.full((num_tokens * top_k, rank), -7.0, dtype=dtype)
    expected = fused_moe_lora_shrink_reference(x, lora_a, topk, mapping, enabled, out)
    out = out.to(device)
    fused_moe_lora_shrink(
        x.to(device),
        lora_a.to(device),
        *(t.to(device) for t in aligned),
        lora_ids.to(device),
        enabled.to(device),
        out,
        top_k=top_k,
        block_size=block_size,
    )
    _same("shrink", out, expected, TOLERANCE[dtype])
    lora_b = ints(max_loras, num_experts, hidden, rank)
    wide = torch.full((num_tokens * top_k, hidden), -5.0, dtype=dtype)
    # from the shrink's output as stored: the expand's own rounding only
    shrunk = out.cpu()
    expected = fused_moe_lora_expand_reference(shrunk, lora_b, topk, mapping, enabled, wide, 0.5)
    wide = wide.to(device)
    fused_moe_lora_expand(
        out,
        lora_b.to(device),
        *(t.to(device) for t in aligned),
        lora_ids.to(device),
        enabled.to(device),
        wide,
        scale=0.5,
        block_size=block_size,
    )
    _same("expand", wide, expected, TOLERANCE[dtype])


def _same(what: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """|actual - expected| <= tol * (1 + |expected|) everywhere (NaN differs)."""
    close = (actual.cpu().double() - expected).abs() <= tol * (1 + expected.abs())
    differ = ~close
    assert not differ.any(), (
        f"{what}: {int(differ.sum())} entries differ beyond {tol}, first at "
        f"{differ.nonzero()[0].tolist()}"
    )
