"""The learned gate's softmax top-k (kernels/topk_gate.py) against its pure-torch twin, the same
compare loop: ids exactly, weights to float32 rounding (a GPU's exp is not the CPU's).

A kernel property first: rows of NaN, of ties, with -inf and +inf logits, order the same in the
interpreter and on a GPU (every compare with NaN is false on both), so the padding rows of
vLLM #39391 pick the same experts on either device. Then the bug's own tests: NaN rows pick
expert 0 twice without the clamp and distinct experts with it; padding rows get -1.
"""

from __future__ import annotations

import pytest
import torch

from kernels.topk_gate import MAX_EXPERTS, topk_gate, topk_gate_reference

NAN, INF = float("nan"), float("inf")


def _rows(experts: int) -> torch.Tensor:
    """Rows that decide the selection's corner cases, then seeded ordinary ones."""
    gen = torch.Generator().manual_seed(3)
    special = [
        [NAN] * experts,  # a padding row of a graph replay
        [1.0, NAN] + [0.5] * (experts - 2),  # one NaN: the softmax's sum is NaN
        [NAN] + [2.0] * (experts - 1),  # NaN first: the row max stays NaN
        [0.0] * experts,  # every expert ties: the lowest indices win
        [1.0, 3.0, 3.0] + [-1.0] * (experts - 3),  # a tie for the first pick
        [-INF] * (experts - 1) + [0.0],  # probability 0 but one
        [-INF] * experts,  # every logit -inf: exp(-inf - -inf) is NaN
        [INF, 1.0] + [0.0] * (experts - 2),  # +inf: inf - inf is NaN
        [-2.0, INF, INF] + [0.0] * (experts - 3),
    ]
    ordinary = torch.randint(-8, 9, (7, experts), generator=gen).float()
    return torch.cat([torch.tensor(special), ordinary])


def _run(device, logits, top_k, clamp, num_actual=None):
    ids = torch.full((logits.shape[0], top_k), -7, dtype=torch.int32, device=device)
    weights = torch.full((logits.shape[0], top_k), -7.0, device=device)
    actual = None
    if num_actual is not None:
        actual = torch.tensor([num_actual], dtype=torch.int32, device=device)
    topk_gate(logits.to(device), ids, weights, actual, clamp_nonfinite=clamp)
    return ids.cpu(), weights.cpu()


def _assert_parity(device, logits, top_k, clamp, num_actual=None) -> None:
    ids, weights = _run(device, logits, top_k, clamp, num_actual)
    want_ids, want_weights = topk_gate_reference(logits, top_k, num_actual, clamp)
    assert torch.equal(ids, want_ids), f"ids differ:\n{ids}\nvs the compare loop's\n{want_ids}"
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("clamp", [True, False], ids=["clamped", "unclamped"])
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (5, 5), (64, 6)])
def test_selection_matches_the_compare_loop(device, experts, top_k, clamp) -> None:
    _assert_parity(device, _rows(experts), top_k, clamp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_are_read_as_float32(device, dtype) -> None:
    logits = _rows(8).to(dtype)
    _assert_parity(device, logits, 2, True)


def test_padding_rows_get_the_sentinel(device) -> None:
    """Rows at or past the real token count: expert -1, weight 0, whatever their logits."""
    logits = _rows(8)
    ids, weights = _run(device, logits, 2, True, num_actual=5)
    assert (ids[5:] == -1).all() and (weights[5:] == 0).all(), (ids, weights)
    _assert_parity(device, logits, 2, True, num_actual=5)


def test_the_launcher_refuses_what_it_cannot_serve(device) -> None:
    logits = torch.zeros(4, MAX_EXPERTS + 1, device=device)
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="experts"):
        topk_gate(logits, ids, torch.zeros(4, 2, device=device))


@pytest.mark.moe_pad_nan_topk
@pytest.mark.parametrize("top_k", [2, 4])
def test_nan_rows_pick_expert_0_every_time_without_the_clamp(device, top_k) -> None:
    """vLLM #39391: a padding row's NaN logits; the clamp makes the picks 0, 1, ... distinct."""
    logits = torch.full((3, 8), NAN)
    buggy, _ = _run(device, logits, top_k, clamp=False)
    fixed, weights = _run(device, logits, top_k, clamp=True)
    assert (buggy == 0).all(), buggy
    assert fixed.tolist() == [list(range(top_k))] * 3 and (weights == 0).all(), (fixed, weights)
