"""Scenarios of moe_pad_sentinel (vLLM #57036, #57946): each function's docstring is its bug
report.

The record (fix parts, expected outcomes) is in the package; see its docstring. The runner and
kernel helpers are moe_pad_nan_topk's: the same gate, the same consumer.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all, mismatch
from harness.record import Context
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.model import POISON_ROW, finalize_skips
from kernels.moe_permute import moe_finalize, moe_permute_experts, moe_permute_reference
from kernels.topk_gate import topk_gate
from repro.bugs.moe_pad_nan_topk.scenarios import (
    NUM_TOKENS,
    REAL_LOGITS,
    TOP_K,
    gate_and_experts,
    padded_decode_steps,
)


def full_graph_padded_decode(ctx: Context) -> str:
    """A FULL graph of 4 tokens with VLLM_MOE_SKIP_PADDING's contract on (the gate writes
    expert -1, weight 0, for rows at or past the step's real token count, read on the device
    at every replay), then decode steps of 3 and 2 requests replayed padded to 4; replay vs
    eager vs the dense float64 reference.

    Fixed: the finalize skips ids outside [0, num_experts): padding rows add nothing, and
    replay == eager ~ reference. Buggy: the finalize never learned the contract: it gathers a
    padding pair's row through `unpermuted_rows`, which the sort (a row per expert 0..E-1, none
    for -1) never wrote: row 2^31 - 1: an illegal address on the GPU, SIGSEGV in the
    interpreter, at the first replay. (The padding rows hold numbers here: the bug needs no
    NaN.)
    """
    return padded_decode_steps(ctx, CUDAGraphMode.FULL, skip_padding=True)


def piecewise_padded_decode(ctx: Context) -> str:
    """The same steps on a PIECEWISE graph of 4 tokens: the padding rows are NaN too (attention
    runs eagerly on the real tokens), and marked -1 before the NaN could matter.

    Fixed: replay == eager ~ reference. Buggy: the finalize gathers the padding pairs' unwritten
    rows: illegal address (GPU), SIGSEGV (interpreter), whatever the rows held.
    """
    return padded_decode_steps(ctx, CUDAGraphMode.PIECEWISE, skip_padding=True)


# Expert parallelism, rank 0 of 2 over 16 experts: global experts 0-7 are its local experts
# 0-7, experts 8-15 live on the other rank (-1). The gate's real rows pick [12, 3], [6, 9] and
# [0, 7] (a margin of 1 logit each), mapped to [-1, 3], [6, -1], [0, 7]: -1 per (token, slot)
# pair, not per row; a padding row's -1 stays -1. 8 local experts, the size the other
# scenarios run (4 gave wrong rows on an H200 until kernels/moe_permute.py's expert tile
# became at least 8 wide: see its NOTE)
EXPERT_MAP = tuple(range(8)) + (-1,) * 8
EP_PICKS = ((12, 3), (6, 9), (0, 7))
LOCAL_IDS = ((-1, 3), (6, -1), (0, 7), (-1, -1), (-1, -1))


def local_experts(ctx: Context):
    """The top-2 gate over 16 experts (5 tokens, 3 real), its ids mapped through EXPERT_MAP on
    the device, then the sort, the GEMM and the finalize of rank 0's 8 experts, seeded: (local
    ids, output, its float64 reference)."""
    logits = torch.ones(NUM_TOKENS, len(EXPERT_MAP))
    for t, (first, second) in enumerate(EP_PICKS):
        logits[t].zero_()
        logits[t, first], logits[t, second] = 5.0, 4.0
    gen = torch.Generator().manual_seed(ctx.seed + 1)
    tokens, local = NUM_TOKENS, max(EXPERT_MAP) + 1
    h = torch.randint(-2, 3, (tokens, 16), generator=gen).float().to(ctx.device)
    weights = torch.randint(-2, 3, (local, 16, 16), generator=gen).float().to(ctx.device)
    ids = torch.empty(tokens, TOP_K, dtype=torch.int32, device=ctx.device)
    routing = torch.empty(tokens, TOP_K, device=ctx.device)
    actual = torch.tensor([len(EP_PICKS)], dtype=torch.int32, device=ctx.device)
    topk_gate(logits.to(ctx.device), ids, routing, actual, clamp_nonfinite=True)
    table = torch.tensor(EXPERT_MAP, dtype=torch.int32, device=ctx.device)
    mapped = torch.where(ids >= 0, table[ids.clamp(min=0).long()], -1).to(torch.int32)
    mapped = mapped.contiguous()
    rows = torch.full((tokens * TOP_K,), POISON_ROW, dtype=torch.int32, device=ctx.device)
    permuted = torch.empty(tokens * TOP_K, 16, device=ctx.device)
    moe_permute_experts(h, weights, mapped, permuted, rows)
    out = torch.full((tokens, 16), -7.0, device=ctx.device)
    moe_finalize(
        permuted, rows, mapped, routing, out, local, skip_invalid=finalize_skips(ctx.fixes)
    )
    return mapped.cpu(), out.cpu(), moe_permute_reference(h, weights, mapped, routing)


def sentinel_rows(ctx: Context) -> str:
    """Kernel level: gate logits of 5 tokens of which 3 are real (the step's count, a device
    scalar), top-2 of 8 experts with padding rows marked -1, the sort, the GEMM, the finalize.
    Then an expert-parallel rank (rank 0 of 2, 16 experts, 0-7 local): the gate's top-2 of
    16 (3 real rows of 5) mapped through the rank's expert map, which marks another rank's
    experts -1 (vLLM's expert_map; the EP dispatches hand the experts such ids, #46408,
    #47785): the real rows become [-1, 3], [6, -1], [0, 7], -1 per (token, slot) pair beside
    a local expert in the same row; the rank's sort, GEMM and finalize over its 8 experts.

    Fixed: the padding rows' outputs are 0 and the real rows equal the float64 reference; on
    the EP rank each row is the sum over its local pairs only, as the reference. Buggy: the
    finalize gathers the -1 pairs through entries the sort never wrote: illegal address (GPU),
    SIGSEGV (interpreter). A guard that tests one id per row (slot 0, as if -1 came in whole
    rows) gathers row [6, -1]'s second pair through its unwritten entry: the same fault.
    """
    logits = torch.cat([torch.tensor(REAL_LOGITS), torch.ones(NUM_TOKENS - 3, 8)])
    ids, _, out, reference = gate_and_experts(
        ctx, logits, 3, True, skip_invalid=finalize_skips(ctx.fixes)
    )
    problems = [
        mismatch("padding rows' ids", ids[3:], torch.full((2, TOP_K), -1, dtype=torch.int32)),
        mismatch("padding rows' outputs", out[3:], torch.zeros(2, 16)),
        close("real rows vs reference", out[:3], reference[:3]),
    ]
    mapped, out, reference = local_experts(ctx)
    problems += [
        mismatch("EP rank's local ids", mapped, torch.tensor(LOCAL_IDS, dtype=torch.int32)),
        close("EP rank's rows vs reference", out, reference),
    ]
    expect_all(problems)
    return (
        "padding rows marked -1 add nothing; real rows as the reference; an EP rank's -1 pairs "
        "(non-local experts) add nothing"
    )
