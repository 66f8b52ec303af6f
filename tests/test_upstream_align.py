"""Upstream's parametrization of the MoE-LoRA align kernels as a regression test (the sizes are
vLLM's tests/lora/test_moe_lora_align_sum.py; the test is written here): tokens 100, 200, 1024,
4096; top-k 6 with distinct experts per token; 64 to 512 experts; max_loras 2 and 32; block
size 16; every token mapped to a real LoRA id; outputs prefilled with numel, num_experts and 0.
Its assertion (every non-padding entry of a block belongs to that block's expert) and the
project's reference, on both backends. The interpreter runs the cases up to 200 tokens; a GPU
runs all 32. Upstream's shape cannot see vLLM #40131 (no -1 among the ids): shown too."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.moe_lora_align import (
    AlignFixes,
    align_sizes,
    canonical_sorted_ids,
    moe_lora_align_block_size,
    moe_lora_align_reference,
    processed_lora_ids,
)

pytestmark = pytest.mark.moe_align_grid

TOP_K, BLOCK_SIZE = 6, 16
CASES = [
    *itertools.product((100, 200, 1024, 4096), (64, 128, 256, 512), (2, 32)),
    # the size upstream keeps in a comment (81920 tokens): a GPU only (the reference takes ~10 s)
    pytest.param(81920, 512, 32, marks=pytest.mark.gpu),
]
BACKENDS = ["triton", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(num_tokens: int, num_experts: int, max_loras: int):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_experts + max_loras)
    topk = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:TOP_K] for _ in range(num_tokens)]
    ).to(torch.int32)
    mapping = torch.randint(0, max_loras, (num_tokens,), generator=gen, dtype=torch.int32)
    lora_ids = torch.tensor([*range(max_loras), -1], dtype=torch.int32)  # -1 last: none is base
    enabled = torch.ones(max_loras + 1, dtype=torch.int32)
    numel = topk.numel()
    padded, m_blocks = align_sizes(numel, num_experts, BLOCK_SIZE)
    prefill = (
        torch.full((max_loras, padded), numel, dtype=torch.int32),
        torch.full((max_loras, m_blocks), num_experts, dtype=torch.int32),
        torch.zeros(max_loras, dtype=torch.int32),
    )
    return topk, mapping, lora_ids, enabled, prefill


def _align(device, backend, topk, mapping, lora_ids, enabled, prefill, num_experts, fixes):
    outputs = tuple(t.clone().to(device) for t in prefill)
    dev = lambda t: t.to(device)
    moe_lora_align_block_size(
        dev(topk),
        dev(mapping),
        dev(lora_ids),
        dev(enabled),
        *outputs,
        num_experts=num_experts,
        block_size=BLOCK_SIZE,
        max_loras=len(lora_ids) - 1,
        fixes=fixes,
        backend=backend,
    )
    return tuple(t.cpu() for t in outputs)


def _upstream_assertion(topk: torch.Tensor, outputs) -> None:
    """Every non-padding entry of a block belongs to that block's expert (vectorized per row)."""
    sorted_ids, expert_ids, post_pad = outputs
    flat, numel = topk.flatten(), topk.numel()
    for row in range(sorted_ids.shape[0]):
        blocks = int(post_pad[row]) // BLOCK_SIZE
        entries = sorted_ids[row, : blocks * BLOCK_SIZE].view(blocks, BLOCK_SIZE).long()
        real = entries < numel
        assert (entries[real] >= 0).all(), f"row {row}: a negative entry"
        owner = expert_ids[row, :blocks].long().unsqueeze(1).expand(blocks, BLOCK_SIZE)
        wrong = real & (flat[entries.clamp(0, numel - 1)] != owner)
        assert not wrong.any(), f"row {row} block {int(wrong.any(1).nonzero()[0])}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_tokens", "num_experts", "max_loras"), CASES)
def test_upstream_shapes(device, backend, num_tokens, num_experts, max_loras) -> None:
    if device == "cpu" and num_tokens > 200:
        pytest.skip("the interpreter runs the cases up to 200 tokens; a GPU runs all")
    topk, mapping, lora_ids, enabled, prefill = _inputs(num_tokens, num_experts, max_loras)
    outputs = _align(
        device, backend, topk, mapping, lora_ids, enabled, prefill, num_experts, AlignFixes()
    )
    _upstream_assertion(topk, outputs)
    expected = moe_lora_align_reference(
        topk,
        mapping,
        lora_ids,
        enabled,
        prefill,
        num_experts=num_experts,
        block_size=BLOCK_SIZE,
        max_loras=max_loras,
    )
    rows = processed_lora_ids(lora_ids, enabled, max_loras)
    assert torch.equal(canonical_sorted_ids(outputs[0], outputs[1], rows, BLOCK_SIZE), expected[0])
    assert torch.equal(outputs[1], expected[1]) and torch.equal(outputs[2], expected[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_upstream_shape_cannot_see_the_short_grid(device, backend) -> None:
    """The buggy grid (max_loras slots) passes upstream's assertion and matches the reference
    when no -1 sorts first: why the project's scenarios put -1 among the ids."""
    num_tokens, num_experts, max_loras = 100, 64, 2
    topk, mapping, lora_ids, enabled, prefill = _inputs(num_tokens, num_experts, max_loras)
    short = AlignFixes(grid_plus_one=False)
    outputs = _align(device, backend, topk, mapping, lora_ids, enabled, prefill, num_experts, short)
    _upstream_assertion(topk, outputs)
    assert (outputs[2] > 0).all(), "every real slot was processed"
