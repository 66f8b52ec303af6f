"""vLLM's fused MoE-LoRA kernel test (tests/lora/test_fused_moe_lora_kernel.py, read at commit
042eb529) as a regression test of this project's align, shrink and expand launchers; the sizes
and tolerances are upstream's, the test is written here.

Upstream's data: top-k distinct experts per token; the tokens split into contiguous sequences,
each with one LoRA drawn from [0, max_loras); lora_ids = the batch's sorted distinct ids, then -1
up to max_loras + 1 entries; every adapter enabled; x, LoRA A and B uniform in [0, 1) in the
model's dtype; output = x @ A[lora, expert].T @ B[lora, expert].T per (token, top-k) pair, one A
and B per slice, the slices side by side; torch.testing.assert_close, seed 42. Here: the align
(the CUDA C++ one on a GPU, as upstream calls, its Triton twin on the CPU) feeds shrink then
expand (scale 1, the rank-wide intermediate in the model's dtype); the reference is float64 (no
rounding: upstream's rounds in the model's dtype); outputs and the intermediate are prefilled
with NaN, align outputs with sentinels.

Upstream's 433 cases, mapped (fp16 and bf16 unless said; tolerance atol = rtol):
  test_fused_moe_lora_kernel (72): 100 tokens, top-k 6/12, 64 experts, max_loras 4/6/16,
    N 1408, K 2048, rank 16/32/64, block 16, slices 1/2, 10 sequences; 1e-2. All 72.
  test_fused_moe_lora_kernel_small_rank (64): 16/100 tokens, top-k 2, 8/64 experts,
    max_loras 4, N 1408, K 2048, rank 4/8, block 16/64, slices 1/2, min(tokens, 8)
    sequences; 1e-2. All 64 (the launchers pad a rank below 16 to the dot's 16 and mask it).
  test_fused_moe_lora_kernel_npid_path (8): 16/64 tokens, top-k 2, 8 experts, max_loras 4,
    N 2048, K 4096, rank 8/16/32/64, block 64, slices 2, bf16, 4 sequences; 2e-2. All 8: the
    math; the NPID split is upstream's launch heuristic, which these launchers have not.
  test_fused_moe_lora_kernel_large_rank_fallback (16): 8 tokens, top-k 2, 4 experts,
    max_loras 2, N = K = 256, rank 128/256, block 16, slices 1/2, 4 sequences; 2e-2. The 8
    with add_inputs=False; the 8 with add_inputs=True add onto a residual, and the launchers
    overwrite their pairs' rows: not expressible.
  test_fused_moe_lora_kernel_one_shot_early_exit (3): every lora_ids slot -1 leaves the
    output as it was (exact). The sorted-path trigger; its two naive-path ones are not
    expressible (below).
  Not expressible (272): naive_block_assignment (256) and those two triggers (the consumer
    fed topk_ids without the align; this one needs align outputs), fully_sharded (12: two
    GPUs, an output offset, a collective), zero_grid_no_crash (1: num_active_loras, a launch
    argument these launchers have not), rejects_bad_block_size_m (1: its wrapper's message).
The launchers have no slice axis: a two-slice case runs shrink and expand once per slice (N / 2
wide) and joins the outputs. 153 of 433: a GPU runs all (and the 152 that compute again on the
buggy kernels, below); the interpreter runs rank 4 in fp16, rank 128 in bf16 and the early
exit. It truncates bfloat16 (tests/dtypes.py), here twice (intermediate, output): at 1e-2 a bf16
case fails on the CPU (small_rank, rank 8: 1.25e-2 relative), hence its bf16 case is a 2e-2
one. Upstream's cases cannot see vLLM #40131 or #32277: shown at the end."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from kernels.fused_moe_lora import ConsumerFixes, fused_moe_lora_expand, fused_moe_lora_shrink
from kernels.moe_lora_align import AlignFixes, align_sizes, moe_lora_align_block_size

# the kernels vLLM #40131 feeds and #32277 launches
pytestmark = [pytest.mark.moe_align_grid, pytest.mark.moe_lora_consumer_grid]
FP16, BF16 = torch.float16, torch.bfloat16
# the kernels before the fixes: every fix part of #40131 and of #32277 off
BUGGY_ALIGN, BUGGY_CONSUMER = AlignFixes(False, False, False), ConsumerFixes(False, False)


@dataclass(frozen=True)
class Case:
    tokens: int
    top_k: int
    experts: int
    max_loras: int
    n: int
    k: int
    rank: int
    block: int
    slices: int
    dtype: torch.dtype
    sequences: int
    tol: float


# upstream test: (its axes in Case's order up to dtype, its cap on sequences, its tolerance)
# fmt: off
FAMILIES = {
    "kernel": ([(100,), (6, 12), (64,), (4, 6, 16), (1408,), (2048,), (16, 32, 64), (16,), (1, 2)],
               (FP16, BF16), 10, 1e-2),
    "small_rank": ([(16, 100), (2,), (8, 64), (4,), (1408,), (2048,), (4, 8), (16, 64), (1, 2)],
                   (FP16, BF16), 8, 1e-2),
    "npid": ([(16, 64), (2,), (8,), (4,), (2048,), (4096,), (8, 16, 32, 64), (64,), (2,)],
             (BF16,), 4, 2e-2),
    "large_rank": ([(8,), (2,), (4,), (2,), (256,), (256,), (128, 256), (16,), (1, 2)],
                   (FP16, BF16), 4, 2e-2),
}
# fmt: on
REPRESENTATIVE_ID = "large_rank-8-2-4-2-256-256-128-16-1-bf16"
CPU_CASES = {"small_rank-16-2-8-4-1408-2048-4-64-1-fp16", REPRESENTATIVE_ID}
NAMES = {FP16: "fp16", BF16: "bf16"}


def _params(cpu: set[str]) -> list:
    params = []
    for family, (axes, dtypes, cap, tol) in FAMILIES.items():
        for *shape, dtype in itertools.product(*axes, dtypes):
            name = "-".join([family, *map(str, shape), NAMES[dtype]])
            case = Case(*shape, dtype, min(shape[0], cap), tol)
            marks = () if name in cpu else pytest.mark.gpu
            params.append(pytest.param(case, id=name, marks=marks))
    return params


CASES = _params(CPU_CASES)
REPRESENTATIVE = next(p.values[0] for p in CASES if p.id == REPRESENTATIVE_ID)


def _inputs(case: Case, device: str, base_sequence: bool = False):
    """Upstream's data, seeded (42, as upstream): routing on the CPU, weights on the device.
    base_sequence: the first sequence's tokens go to the base model (-1) instead."""
    gen = torch.Generator().manual_seed(42)
    topk = torch.rand(case.tokens, case.experts, generator=gen).argsort(1)[:, : case.top_k]
    sequence = torch.arange(case.tokens) * case.sequences // case.tokens
    mapping = torch.randint(0, case.max_loras, (case.sequences,), generator=gen)[sequence]
    if base_sequence:
        mapping[sequence == 0] = -1
    lora_ids = torch.full((case.max_loras + 1,), -1)
    ids = mapping.unique(sorted=True)
    lora_ids[: len(ids)] = ids
    dev = torch.Generator(device=device).manual_seed(42)
    rand = lambda *shape: torch.rand(shape, generator=dev, device=device, dtype=case.dtype)
    width = case.n // case.slices
    a = [rand(case.max_loras, case.experts, case.rank, case.k) for _ in range(case.slices)]
    b = [rand(case.max_loras, case.experts, width, case.rank) for _ in range(case.slices)]
    ints = (t.to(device=device, dtype=torch.int32) for t in (topk, mapping, lora_ids))
    return (*ints, rand(case.tokens, case.k), a, b)


def _fused(case: Case, device: str, inputs, align: AlignFixes, consumer: ConsumerFixes):
    """Align, then shrink and expand per slice: [tokens * top_k, N] in the model's dtype."""
    topk, mapping, lora_ids, x, a, b = inputs
    loras, numel = case.max_loras, topk.numel()
    padded, m_blocks = align_sizes(numel, case.experts, case.block)
    full = lambda shape, value, dtype: torch.full(shape, value, dtype=dtype, device=device)
    aligned = (
        full((loras, padded), -2, torch.int32),
        full((loras, m_blocks), -7, torch.int32),
        full((loras,), -13, torch.int32),
    )
    enabled = full((loras + 1,), 1, torch.int32)
    backend = "cuda" if device == "cuda" else "triton"
    moe_lora_align_block_size(
        *(topk, mapping, lora_ids, enabled, *aligned),
        num_experts=case.experts,
        block_size=case.block,
        max_loras=loras,
        fixes=align,
        backend=backend,
    )
    slots = (*aligned, lora_ids, enabled)
    outputs = []
    for a_s, b_s in zip(a, b, strict=True):
        shrunk = full((numel, case.rank), float("nan"), case.dtype)
        fused_moe_lora_shrink(
            x, a_s, *slots, shrunk, top_k=case.top_k, block_size=case.block, fixes=consumer
        )
        out = full((numel, b_s.shape[2]), float("nan"), case.dtype)
        fused_moe_lora_expand(
            shrunk, b_s, *slots, out, scale=1.0, block_size=case.block, fixes=consumer
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1)


def _reference(case: Case, inputs) -> torch.Tensor:
    """float64 on the device, one (LoRA, expert) group of pairs at a time; base pairs NaN."""
    topk, mapping, _, x, a, b = inputs
    owner = mapping.long().repeat_interleave(case.top_k)
    key = owner * case.experts + topk.flatten().long()  # negative for base-model pairs
    out = torch.full((topk.numel(), case.n), float("nan"), dtype=torch.float64, device=x.device)
    for group in key[owner >= 0].unique().tolist():
        pairs = (key == group).nonzero().flatten()
        lora, expert = divmod(group, case.experts)
        rows = x[pairs // case.top_k].double()
        w = [
            (a_s[lora, expert].double(), b_s[lora, expert].double())
            for a_s, b_s in zip(a, b, strict=True)
        ]
        out[pairs] = torch.cat([rows @ a_w.T @ b_w.T for a_w, b_w in w], dim=1)
    return out


def _upstream_assertion(case: Case, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Upstream's: |actual - expected| <= tol + tol * |expected| everywhere; NaN only where
    the reference has it (base-model pairs keep the prefill)."""
    actual = actual.double()
    torch.testing.assert_close(actual, expected, atol=case.tol, rtol=case.tol, equal_nan=True)


@pytest.mark.parametrize("case", CASES)
def test_upstream_cases(device, case: Case) -> None:
    inputs = _inputs(case, device)
    actual = _fused(case, device, inputs, AlignFixes(), ConsumerFixes())
    _upstream_assertion(case, actual, _reference(case, inputs))


def test_upstream_every_slot_base_model_writes_nothing(device) -> None:
    """Upstream's early exit (sorted path: 32 tokens, top-k 2, 8 experts, max_loras 4, rank 16,
    N = K = 1024, two slices, bf16): lora_ids all -1, no launch writes (exact). Upstream's
    align rows route nothing (nothing padded); these would route every pair to expert 0."""
    case = Case(32, 2, 8, 4, 1024, 1024, 16, 16, 2, BF16, 4, 0.0)
    topk, _, _, x, a, b = _inputs(case, device)
    numel = topk.numel()
    padded, m_blocks = align_sizes(numel, case.experts, case.block)
    ints = lambda t: t.to(device=device, dtype=torch.int32)
    rows = ints(torch.arange(padded).clamp(max=numel).repeat(4, 1))
    slots = (rows, ints(torch.zeros(4, m_blocks)), ints(torch.full((4,), padded)))
    slots = (*slots, ints(torch.full((5,), -1)), ints(torch.ones(5)))
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(shape, generator=gen).to(device=device, dtype=case.dtype)
    for a_s, b_s in zip(a, b, strict=True):
        shrunk, out = randn(numel, case.rank), randn(numel, case.n // 2)
        before = (shrunk.clone(), out.clone())
        fused_moe_lora_shrink(x, a_s, *slots, shrunk, top_k=case.top_k, block_size=case.block)
        fused_moe_lora_expand(shrunk, b_s, *slots, out, scale=1.0, block_size=case.block)
        assert torch.equal(shrunk, before[0]) and torch.equal(out, before[1])


@pytest.mark.parametrize("case", _params({REPRESENTATIVE_ID}))
def test_upstream_cases_cannot_see_the_short_grids(device, case: Case) -> None:
    """The kernels before both fixes (every part of #40131's and #32277's off) pass upstream's
    cases. A grid of max_loras slots drops only lora_ids' last slot, and upstream's is always
    -1: no token is the base model's, so no -1 sorts first, and at most max_loras distinct ids
    take the first max_loras slots (with max_loras 16, at most 10 sequences' ids: even a -1
    first would leave the last slot -1)."""
    inputs = _inputs(case, device)
    mapping, lora_ids = inputs[1], inputs[2]
    assert (mapping >= 0).all() and int(lora_ids[-1]) == -1
    actual = _fused(case, device, inputs, BUGGY_ALIGN, BUGGY_CONSUMER)
    _upstream_assertion(case, actual, _reference(case, inputs))


def test_a_base_model_sequence_shows_them(device) -> None:
    """The representative case with its first sequence on the base model, as vLLM's batches
    mix them: -1 sorts first and every LoRA is active, the last in slot max_loras. Fixed:
    passes. Either grid one slot short (the other kernel fixed) leaves that LoRA's pairs NaN
    and upstream's assertion fails; the other pairs still pass it."""
    case = REPRESENTATIVE
    inputs = _inputs(case, device, base_sequence=True)
    assert inputs[2].tolist() == [-1, 0, 1], inputs[2]
    expected = _reference(case, inputs)
    _upstream_assertion(case, _fused(case, device, inputs, AlignFixes(), ConsumerFixes()), expected)
    last = (inputs[1] == 1).repeat_interleave(case.top_k)
    for align, consumer in ((BUGGY_ALIGN, ConsumerFixes()), (AlignFixes(), BUGGY_CONSUMER)):
        actual = _fused(case, device, inputs, align, consumer)
        with pytest.raises(AssertionError, match="not close"):
            _upstream_assertion(case, actual, expected)
        assert actual[last].isnan().all(), "the last LoRA's pairs keep the prefill"
        _upstream_assertion(case, actual[~last], expected[~last])
