"""Scenarios of lazy_attn_state (vLLM #42444): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import expect_all, mismatch
from harness.record import Context
from harness.runner.flashmla import DecodeAttention
from kernels.split_kv_attention import split_kv_attention_reference

WARMUP_LENS = [1, 1, 1, 1]
STEPS = ([5, 17, 1, 40], [33, 2, 9, 12], [48, 48, 3, 7])


def replay_vs_eager(ctx: Context) -> str:
    """Warm-up with dummy lengths -> FULL capture -> decode steps with other lengths, in a row.

    Each step: replay vs an eager step with a fresh plan vs the float64 reference. Fixed: the
    planner is in the graph, so each replay plans for the live lengths and equals eager.
    Buggy: the graph holds no planner launch and replays reuse the warm-up plan: wrong result.
    """
    attn = DecodeAttention(ctx.device, ctx.fixes, seed=ctx.seed)
    attn.capture(WARMUP_LENS)
    problems = []
    for i, lens in enumerate(STEPS):
        replay = attn.replay(lens, seed=ctx.seed + i)
        eager = attn.eager(lens, seed=ctx.seed + i)
        reference = split_kv_attention_reference(
            attn.query,
            attn.kv.k_caches[0],
            attn.kv.v_caches[0],
            attn.block_table,
            attn.backend.seq_lens.cpu(),
            attn.shape.head_dim**-0.5,
        )
        if not torch.allclose(eager.cpu().double(), reference, rtol=1e-4, atol=1e-5):
            problems.append(f"lengths {lens}: eager differs from the float64 reference")
        problems.append(mismatch(f"lengths {lens}: graph replay vs eager", replay, eager))
    launches = attn.graphs.graphs[attn.desc].launches
    if any(problems):
        problems.append(f"captured launches: {launches}")
    expect_all(problems)
    return f"{len(STEPS)} steps: replay == eager ~ reference; captured {launches}"
