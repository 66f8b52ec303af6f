"""Align kernels (Triton twin on the run's device; CUDA C++ on a GPU) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_lora_align import (
    align_sizes,
    canonical_sorted_ids,
    is_small_batch,
    moe_lora_align_block_size,
    moe_lora_align_reference,
    processed_lora_ids,
)

pytestmark = pytest.mark.moe_align_grid  # the kernels vLLM #40131 lives in


# (num_tokens, top_k, num_experts, block_size, max_loras, lora_ids, disabled ids)
CASES = [
    pytest.param((7, 2, 8, 16, 2, [-1, 0, 1], []), id="small-mixed"),
    pytest.param((1, 1, 3, 16, 1, [-1, 0], []), id="small-one-token"),
    pytest.param((31, 3, 61, 16, 3, [-1, 0, 2, -1], []), id="small-61-experts-gap"),
    pytest.param((13, 2, 5, 32, 3, [0, 1, 2, -1], [1]), id="small-no-base-disabled"),
    pytest.param((613, 2, 8, 16, 2, [-1, 0, 1], []), id="large-numel"),
    pytest.param((37, 3, 67, 16, 3, [-1, 0, 1, 2], [2]), id="large-67-experts"),
    pytest.param((509, 4, 16, 64, 4, [-1, 0, 1, 3, -1], [0]), id="large-block-64"),
]


def _run(
    backend: str,
    device: str,
    num_tokens,
    top_k,
    num_experts,
    block_size,
    max_loras,
    lora_ids,
    disabled,
    seed: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    topk = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    owners = torch.tensor(lora_ids, dtype=torch.int32)
    mapping = owners[torch.randint(0, len(lora_ids), (num_tokens,), generator=gen)]
    enabled = torch.ones(max_loras + 1, dtype=torch.int32)
    enabled[disabled] = 0
    padded, m_blocks = align_sizes(topk.numel(), num_experts, block_size)
    prefill = (
        torch.full((max_loras, padded), -2, dtype=torch.int32),
        torch.full((max_loras, m_blocks), -7, dtype=torch.int32),
        torch.full((max_loras,), -13, dtype=torch.int32),
    )
    outputs = tuple(t.to(device) for t in prefill)
    moe_lora_align_block_size(
        topk.to(device),
        mapping.to(device),
        owners.to(device),
        enabled.to(device),
        *outputs,
        num_experts=num_experts,
        block_size=block_size,
        max_loras=max_loras,
        backend=backend,
    )
    expected = moe_lora_align_reference(
        topk,
        mapping,
        owners,
        enabled,
        prefill,
        num_experts=num_experts,
        block_size=block_size,
        max_loras=max_loras,
    )
    rows = processed_lora_ids(owners, enabled, max_loras)
    got = canonical_sorted_ids(outputs[0], outputs[1], rows, block_size)
    assert torch.equal(got, expected[0]), (
        f"sorted_token_ids differ at {(got != expected[0]).nonzero()[:5].tolist()}"
    )
    assert torch.equal(outputs[1].cpu(), expected[1]), (
        f"expert_ids {outputs[1].cpu()} != {expected[1]}"
    )
    assert torch.equal(outputs[2].cpu(), expected[2]), (
        f"num_tokens_post_pad {outputs[2].cpu()} != {expected[2]}"
    )


@pytest.mark.parametrize("case", CASES)
def test_triton_twin_matches_reference(device: str, case) -> None:
    _run("triton", device, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_csrc_matches_reference(case) -> None:
    _run("cuda", "cuda", *case)


def test_cases_cover_both_paths() -> None:
    paths = {is_small_batch(c.values[0][0] * c.values[0][1], c.values[0][2]) for c in CASES}
    assert paths == {True, False}


def test_reference_pads_each_expert_to_block_size() -> None:
    topk = torch.tensor([[0, 1], [0, 0], [2, 1]], dtype=torch.int32)
    mapping = torch.tensor([0, -1, 0], dtype=torch.int32)
    prefill = (
        torch.full((1, 56), -2, dtype=torch.int32),
        torch.full((1, 7), -7, dtype=torch.int32),
        torch.full((1,), -13, dtype=torch.int32),
    )
    lora_ids, enabled = torch.tensor([-1, 0], dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    sorted_ids, expert_ids, post_pad = moe_lora_align_reference(
        topk, mapping, lora_ids, enabled, prefill, num_experts=3, block_size=8, max_loras=1
    )
    # lora 0 owns pairs 0, 1 (token 0) and 4, 5 (token 2): expert 0 <- 0; 1 <- 1, 5; 2 <- 4
    assert post_pad.tolist() == [24]
    assert expert_ids.tolist() == [[0, 1, 2, -1, -1, -1, -1]]
    assert sorted_ids[0, :24].tolist() == [0] + [6] * 7 + [1, 5] + [6] * 6 + [4] + [6] * 7
    assert (sorted_ids[0, 24:] == 6).all()
