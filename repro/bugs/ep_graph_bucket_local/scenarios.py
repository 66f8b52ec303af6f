"""Scenarios of ep_graph_bucket_local (SGLang #30450, issue #30242): each function's docstring is
its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.oracle import close, expect_all
from harness.record import Context
from harness.runner.expert_parallel import ExpertParallelMoE
from harness.runner.parallel import Collectives, ParallelConfig

CAPTURE_SIZES = (2, 4, 8)
HIDDEN, EXPERTS = 16, 4
# per decode step, each rank's batch (tokens); with capture sizes 2, 4, 8 the local buckets
# are in brackets
PLAN = (
    ("one bucket, equal batches", (2, 2)),  # [2, 2]
    ("larger batch on rank 0", (3, 1)),  # [4, 2]
    ("larger batch on rank 1", (1, 3)),  # [2, 4]
    ("one bucket, different batches", (3, 4)),  # [4, 4]
    ("rank 0 idle", (0, 5)),  # [2, 8]: an idle rank's dummy step
    ("rank 1 idle", (6, 0)),  # [8, 2]
    ("the largest bucket", (8, 7)),  # [8, 8]
)
MARGIN = 1e-3  # the least gap between a token's best and second gate probabilities


def bucket_of(count: int) -> int:
    return min(size for size in CAPTURE_SIZES if size >= max(count, 1))


def ep_layer(ctx: Context) -> ExpertParallelMoE:
    """This rank's layer: two ranks, each of them a DP rank and an EP rank of two experts."""
    if ctx.world_size != 2:
        raise RuntimeError(f"runs as 2 ranks (Scenario.ranks), got world size {ctx.world_size}")
    parallel = ParallelConfig(
        world_size=2, rank=ctx.rank, data_parallel_size=2, expert_parallel_size=2
    )
    collectives = Collectives(parallel, ctx.device, ctx.trace)
    directory = Path(ctx.trace).parent
    return ExpertParallelMoE(
        parallel,
        collectives,
        ctx.device,
        directory,
        fixes=ctx.fixes,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capture_sizes=CAPTURE_SIZES,
        seed=ctx.seed,
    )


def _tokens(layer: ExpertParallelMoE, step: int, rank: int, n: int) -> torch.Tensor:
    """The step's tokens of `rank` (seeded apart per step and rank), each with a clear best
    expert (routing that float32 and float64 agree on), spread over both ranks' experts."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, HIDDEN, generator=gen)
    probs = torch.softmax(x.double() @ layer.router.double(), dim=-1).sort(dim=-1).values
    gaps = probs[:, -1] - probs[:, -2] if n else probs.new_ones(0)
    assert bool((gaps > MARGIN).all()), f"trigger not reached: a near tie at step {step}"
    return x


def ep_decode_buckets(ctx: Context) -> str:
    """Two expert-parallel ranks (each owns two of four experts; top-1 gate) run seven decode
    steps of an MoE layer whose decode step replays CUDA graphs captured for 2, 4 and 8 rows per
    rank. Each step the ranks agree on their token counts (an all-reduce, outside the graphs),
    pick a bucket, and replay its graphs: the dispatch (a Triton kernel writes each of the
    rank's bucket slots into every rank's receive rows, laid out per source rank with the
    bucket's rows each: the token's local expert index where the owner's rows are, -1 in the
    others and for padding slots), a barrier, the experts (each rank reads its own receive
    rows by its own bucket, loads the expert the row names, writes the product back into the
    source's out rows; then poisons its receive rows again), a barrier, the gate's weights.
    Receive rows start poisoned (expert index int32 max, NaN rows). The steps walk batches in
    one bucket (equal and different counts), in different buckets with the larger batch on
    either rank, either rank idle (a dummy step of no tokens) and the largest bucket. Each rank
    checks the agreed counts and its bucket against the plan and its outputs against the
    float64 MoE.

    Fixed: every rank picks the bucket of the agreed count (the max over the ranks): one
    geometry, every receive row read was written this step. Buggy: each rank picks the bucket
    of its local batch; at step 1 (3 tokens on rank 0, 1 on rank 1) rank 0 replays the 4-row
    graphs and rank 1 the 2-row ones, so rank 1's rows land at rows 2-3 of rank 0's receive
    buffer while rank 0 reads rank 1's rows at 4-7: rows nobody wrote, whose poisoned expert
    index sends the expert load to a wild address (upstream: an illegal memory access, SGLang
    #30242): illegal_address on rank 0.
    """
    layer = ep_layer(ctx)
    problems, checked = [], 0
    for step, (label, counts) in enumerate(PLAN):
        n = counts[ctx.rank]
        x = _tokens(layer, step, ctx.rank, n)
        y = layer.step(x.to(ctx.device))
        where = f"step {step} ({label}), rank {ctx.rank}"
        if layer.counts_across_ep != list(counts):
            problems.append(f"{where}: counts across EP {layer.counts_across_ep}, not {counts}")
        if layer.rows != bucket_of(max(counts)):
            problems.append(f"{where}: bucket {layer.rows}, not {bucket_of(max(counts))}")
        if n:
            problems.append(close(f"{where}: MoE output vs reference", y, layer.reference(x)))
            checked += n
    expect_all(problems)
    return f"{len(PLAN)} decode steps, {checked} tokens on rank {ctx.rank} as the float64 MoE"
