"""Scenarios of dp_zero_token_skip (vLLM #28774): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.engine import DataParallelEngine
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.parallel import Collectives, ParallelConfig

PROMPTS = ((1, 2, 3), (4, 5))  # rank r's one request
# per step, whether each rank's scheduler gives its request tokens (a rank without: its
# request waits, unfinished: async scheduling's zero-token step, or a grammar compiling)
PLAN = (
    ("rank 0 only", (True, False)),  # rank 1 idle at its first step: no agreement before
    ("both", (True, True)),
    ("rank 1 only", (False, True)),
    ("rank 0 only", (True, False)),
    ("neither", (False, False)),  # every rank idle at once (#29433's case)
    ("both", (True, True)),
    ("rank 0 only", (True, False)),
)
# per step, whether each rank still has an unfinished request: rank 1's ends after the sixth
# step, so at the seventh it is idle with nothing unfinished while rank 0 decodes on
UNFINISHED = ((1, 1),) * (len(PLAN) - 1) + ((1, 0),)
DUMMY_TOKENS = 1  # an idle rank's dummy step (upstream: _dummy_run(1))
K = 2  # the drafter's tokens per request and step: a busy rank drafts after every step


def dp_runner(ctx: Context, **config) -> ModelRunner:
    """This rank's eager runner (no LoRA) of two data-parallel ranks, its collectives recorded
    in the run's trace; `config`: more of runner_config's keywords."""
    if ctx.world_size != 2:
        raise RuntimeError(f"runs as 2 ranks (Scenario.ranks), got world size {ctx.world_size}")
    parallel = ParallelConfig(world_size=2, rank=ctx.rank, data_parallel_size=2)
    settings = {"cudagraph_mode": CUDAGraphMode.NONE, "enable_lora": False, **config}
    flat = runner_config(ctx.device, ctx.fixes, dtype=ctx.dtype, parallel=parallel, **settings)
    return ModelRunner(flat, collectives=Collectives(parallel, ctx.device, ctx.trace))


def draft_chain(runner: ModelRunner, sampled: int) -> list[int]:
    """The K drafts after `sampled`, in float64: argmax(embed[t] @ head.T), chained."""
    embed, head = runner.model.embed.double().cpu(), runner.model.head.double().cpu()
    drafts, t = [], sampled
    for _ in range(K):
        t = int((embed[t] @ head.T).argmax())
        drafts.append(t)
    return drafts


def zero_token_rank_steps(ctx: Context) -> str:
    """Two data-parallel ranks, one request each, walk seven steps: rank 0 with tokens and
    rank 1 with none at the first step (its request waits from the start, before any
    agreement), both, the reverse (rank 1 only), rank 0 only again, neither (every rank idle
    at once), both, then rank 0 only once rank 1's request has finished (rank 1 has nothing
    unfinished, and still runs the step). Each step the ranks first agree on the unfinished
    requests across them (an all-reduce of one count), then each runs its step, whose start
    agrees with the other rank on each rank's token count (an all-reduce of one count per
    rank; upstream: coordinate_batch_across_dp). The runner has a drafter of two tokens
    (speculative decoding): after its step a busy rank runs two draft steps, each agreeing
    with the other rank on each rank's draft batch (an all-reduce of a 2x2 int32), so an idle
    rank's one-token dummy step must run the drafter's dummy steps too (upstream: _dummy_run
    calls drafter.dummy_run whatever its size). Each rank checks its logits against the
    float64 reference, the agreed counts against the plan (an idle rank counts its dummy
    step's one token), its drafts against the float64 chain and each draft step's agreed
    batches (an idle rank's row: its dummy's one token, one request).

    Fixed: a rank with zero tokens runs a one-token dummy step first, so it joins the count
    agreement and the draft steps' agreements; the traces of both ranks agree. A dummy step
    that joined the count but skipped the drafter's dummy (as if a one-token dummy had nothing
    to draft) would leave the busy rank's first draft-step all-reduce unmatched at step 0.
    Buggy: the idle rank returns its empty output
    before the agreement, ends its step and enters the next step's unfinished-count
    all-reduce (4 bytes) while its peer waits in the token-count all-reduce (8 bytes): the
    ranks' collectives disagree (upstream: gloo's "EnforceNotMet ... 8 vs 4", or a hang), the
    coordinator's trace comparison names it: collective_mismatch at step 0.
    """
    runner = dp_runner(ctx, max_model_len=16, num_speculative_tokens=K)
    engine = DataParallelEngine(runner)
    seq, computed, problems = list(PROMPTS[ctx.rank]), 0, []
    started = [False] * len(PROMPTS)  # each rank's request past its prefill (the plan says)
    runner.kv_cache.free(0)
    for step, (label, busy) in enumerate(PLAN):
        # each rank's count: its prompt, then one token a step; idle: its dummy step's
        counts = [
            (1 if started[j] else len(PROMPTS[j])) if b else DUMMY_TOKENS
            for j, b in enumerate(busy)
        ]
        started = [s or b for s, b in zip(started, busy, strict=True)]
        mine = []
        if busy[ctx.rank]:
            mine = [Request(f"req{ctx.rank}", tuple(seq[computed:]), 0, computed)]
        out, unfinished = engine.step(mine, unfinished=UNFINISHED[step][ctx.rank])
        where = f"step {step} ({label}), rank {ctx.rank}"
        if unfinished != sum(UNFINISHED[step]):
            problems.append(
                f"{where}: {unfinished} unfinished requests across ranks, "
                f"not {sum(UNFINISHED[step])}"
            )
        if not mine:
            continue
        if runner.num_tokens_across_dp != counts:
            problems.append(
                f"{where}: token counts across DP {runner.num_tokens_across_dp}, not {counts}"
            )
        reference = step_reference(runner, mine)[1]
        problems.append(close(f"{where}: logits vs reference", out.logits, reference))
        sampled = int(out.logits[0].argmax())
        drafts = None if out.drafts is None else out.drafts.tolist()
        if drafts != [draft_chain(runner, sampled)]:
            problems.append(f"{where}: drafts {drafts} vs reference")
        # each draft step's batches: the first reads the step's tokens (an idle rank's dummy:
        # its one token), the later ones one token per request
        agreed = [[[c, 1] for c in counts]] + [[[1, 1]] * len(counts)] * (K - 1)
        if runner.drafter.batches_across_dp != agreed:
            problems.append(
                f"{where}: draft batches across DP {runner.drafter.batches_across_dp}, not {agreed}"
            )
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        computed = len(seq)
        seq.append(sampled)
    expect_all(problems)
    return f"{len(PLAN)} steps, {len(seq) - len(PROMPTS[ctx.rank])} tokens, as reference"
