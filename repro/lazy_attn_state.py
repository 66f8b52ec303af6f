"""lazy_attn_state (vLLM #42444): lazy attention plan made in warm-up, missing from the graph.

FlashMLA-style attention plans its split-KV work partition on first use
(tile_scheduler_metadata is None -> allocate and run the planner). CudaGraphManager.capture()
shared one attention state between warm-up and FULL capture, so the planner ran in warm-up and
was never recorded; every replay reuses the plan made for the dummy warm-up lengths (DeepSeek
V4 produced garbled or looping output upstream). The fix calls create_forward_fn(desc) again
before FULL capture and keeps that fresh state. Run alone: `python -m repro.lazy_attn_state`.
"""

from __future__ import annotations

import torch

from harness.fixes import Fix
from harness.oracle import expect_all, mismatch
from harness.outcome import ByDevice, Outcome
from harness.record import BugRecord, Context, Expect, Scenario
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


WRONG = ByDevice.both(Outcome.WRONG_RESULT)

RECORD = BugRecord(
    id="lazy_attn_state",
    title="Lazy attention plan made in warm-up, missing from the CUDA graph",
    upstream="https://github.com/vllm-project/vllm/pull/42444",
    symptom="garbled or repeating output with full CUDA graphs (DeepSeek V4, FlashMLA)",
    root_cause=(
        "capture() shared one attention state between warm-up and capture: the lazy planner "
        "ran in warm-up, so the graph replays a plan made for the dummy lengths"
    ),
    trigger="FULL CUDA-graph capture of an attention backend that initializes state lazily",
    fix_parts=(Fix.FRESH_ATTN_STATE_FOR_CAPTURE,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "replay_vs_eager",
            replay_vs_eager,
            (Expect(frozenset({Fix.FRESH_ATTN_STATE_FOR_CAPTURE}), WRONG),),
        ),
    ),
    history="PIECEWISE capture was unaffected: attention runs outside its graphs.",
)


if __name__ == "__main__":
    from harness.cli import run_alone

    run_alone(RECORD.id)
