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
from harness.runner.model import finalize_skips
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


def sentinel_rows(ctx: Context) -> str:
    """Kernel level: gate logits of 5 tokens of which 3 are real (the step's count, a device
    scalar), top-2 of 8 experts with padding rows marked -1, the sort, the GEMM, the finalize.

    Fixed: the padding rows' outputs are 0 and the real rows equal the float64 reference.
    Buggy: the finalize gathers the -1 pairs through entries the sort never wrote: illegal
    address (GPU), SIGSEGV (interpreter).
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
    expect_all(problems)
    return "padding rows marked -1 add nothing; real rows as the reference"
