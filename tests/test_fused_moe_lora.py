"""The fused MoE-LoRA shrink consumer against the dense reference, fed by reference align."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe_lora import fused_moe_lora_shrink, fused_moe_lora_shrink_reference
from kernels.moe_lora_align import align_sizes, moe_lora_align_reference

pytestmark = pytest.mark.moe_align_grid  # the kernels vLLM #40131 lives in


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "rank", "hidden", "disabled"),
    [
        (7, 2, 8, 16, 200, []),
        (29, 3, 5, 32, 131, [1]),
        (3, 1, 4, 16, 64, [0]),
    ],
)
def test_shrink_matches_dense_reference(
    device, num_tokens, top_k, num_experts, rank, hidden, disabled
) -> None:
    max_loras, block_size = 2, 16
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
    x = torch.randint(-2, 3, (num_tokens, hidden), generator=gen).float()
    lora_a = torch.randint(-2, 3, (max_loras, num_experts, rank, hidden), generator=gen).float()
    out = torch.full((num_tokens * top_k, rank), -7.0)
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
    differ = out.cpu().double() != expected
    assert not differ.any(), (
        f"{int(differ.sum())} entries differ, first at {differ.nonzero()[0].tolist()}"
    )
