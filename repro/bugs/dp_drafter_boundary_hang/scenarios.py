"""Scenarios of dp_drafter_boundary_hang (vLLM #44185, #40589): each function's docstring is its
bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import step_reference
from harness.runner.engine import DataParallelEngine
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner
from repro.bugs.dp_zero_token_skip.scenarios import dp_runner

MAX_MODEL_LEN = 12
K = 3  # draft tokens per request and step: a batch whose longest sequence is past 12 - 3 skips
# each rank's prompts, one request at a time, each run until its tokens reach MAX_MODEL_LEN:
# rank 1's first request (11 tokens) is past the drafter's limit at its first step, before any
# draft agreement, while rank 0's drafts (step 0); rank 0's first request reaches the limit
# while rank 1's second drafts (steps 4, 5); rank 1's reaches it while rank 0's second drafts
# (step 8), then both are past it (step 9), then rank 0's is past it while rank 1 idles (step
# 10: its requests finished, rank 0's not)
PROMPTS = (
    ((1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12, 13)),
    ((16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26), (14, 15, 27)),
)
STEPS = 11
DUMMY = [1, 1]  # a dummy draft step's batch: one token, one request (upstream: dummy_run(1))


def timeline(prompts: tuple[tuple[int, ...], ...]) -> list[tuple[int, int] | None]:
    """Per step, the running request's (index, sequence length after the step), or None: idle
    (a request runs until its prompt and generated tokens reach MAX_MODEL_LEN)."""
    steps: list[tuple[int, int] | None] = []
    for i, prompt in enumerate(prompts):
        steps += [(i, n) for n in range(len(prompt), MAX_MODEL_LEN)]
    return (steps + [None] * STEPS)[:STEPS]


def fits(entry: tuple[int, int] | None) -> bool:
    return entry is not None and entry[1] + K <= MAX_MODEL_LEN


def draft_reference(runner: ModelRunner, sampled: int) -> list[int]:
    """The drafts after `sampled`, in float64: argmax(embed[t] @ head.T), chained."""
    embed, head = runner.model.embed.double().cpu(), runner.model.head.double().cpu()
    drafts, t = [], sampled
    for _ in range(K):
        t = int((embed[t] @ head.T).argmax())
        drafts.append(t)
    return drafts


def expected_batches(step: int) -> list[list[list[int]]]:
    """Per draft step at `step`, each rank's draft batch (tokens, requests): its own when it
    drafts (the first draft step reads every token of the step: a prompt's, or one), a
    dummy's when it does not (past the limit, or idle)."""
    rows = []
    for prompts in PROMPTS:
        entry = timeline(prompts)[step]
        if not fits(entry):
            rows.append([DUMMY] * K)
            continue
        prompt = len(prompts[entry[0]])
        rows.append([[prompt if entry[1] == prompt else 1, 1]] + [[1, 1]] * (K - 1))
    return [[row[d] for row in rows] for d in range(K)]


def drafter_at_the_boundary(ctx: Context) -> str:
    """Two data-parallel ranks with a drafter of three tokens (max_model_len 12: a batch whose
    longest sequence is past 9 after a step takes no drafts), one request at a time each. At step 0
    rank 1's first request, a long prompt of 11 tokens (one token to generate), is past the
    drafter's limit at its very first step, before the ranks have agreed on any draft step, while
    rank 0's first request (6 tokens) drafts. Rank 0's first request crosses the limit at step 4
    while rank 1's second (3 tokens) still drafts; rank 0's second (7 tokens) drafts at step 8
    while rank 1's has crossed; both are past at step 9; at step 10 rank 0's is past it and rank 1
    idles (its requests finished: zero tokens, a dummy step). Steps 3, 7 and 8 sit exactly on the
    limit (sequence 9 + 3 drafts = 12: drafts). Each step the ranks agree on their unfinished
    requests, run the target's step (agreeing on each rank's token count), then the drafter's three
    draft steps, each agreeing on each rank's draft batch (tokens, requests: an all-reduce of a 2x2
    int32). Each rank checks its logits against the float64 reference, its drafts against the
    float64 chain (none past the limit), and, when it drafts, each draft step's agreed batches
    against the plan (a rank past the limit or idle counts a dummy's one token and one request).

    Fixed: a rank past the limit runs the drafter's three dummy steps, so it joins the
    agreements of the rank that drafts, from its first step on; the traces agree. Buggy: it
    returns no drafts and ends its step, while its peer waits in the first draft step's
    all-reduce (upstream: a hang, "No available shared memory broadcast block found"); the
    coordinator's trace comparison names it: collective_mismatch at step 0 (rank 1's long
    prompt; without it, at step 4). A rank that ran the dummy steps only once some draft step
    had been agreed (a gate read from the last agreement) would pass steps 4 to 10, not 0.
    """
    runner = dp_runner(ctx, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=K)
    engine = DataParallelEngine(runner)
    plans = [timeline(p) for p in PROMPTS]
    mine_prompts, problems, drafted, skipped = PROMPTS[ctx.rank], [], 0, 0
    seq, computed, current = [], 0, None
    for step in range(STEPS):
        entry = plans[ctx.rank][step]
        requests = []
        if entry is not None:
            if entry[0] != current:  # a new request: the last one's row is freed
                runner.kv_cache.free(0)
                current, seq, computed = entry[0], list(mine_prompts[entry[0]]), 0
            requests = [Request(f"req{ctx.rank}.{current}", tuple(seq[computed:]), 0, computed)]
        out, unfinished = engine.step(requests, unfinished=int(entry is not None))
        where = f"step {step}, rank {ctx.rank}"
        expected = sum(p[step] is not None for p in plans)
        if unfinished != expected:
            problems.append(
                f"{where}: {unfinished} unfinished requests across ranks, not {expected}"
            )
        if not requests:
            continue
        problems.append(
            close(f"{where}: logits vs reference", out.logits, step_reference(runner, requests)[1])
        )
        sampled = int(out.logits[0].argmax())
        if not fits(entry):
            skipped += 1
            if out.drafts is not None:
                problems.append(f"{where}: drafts past the drafter's limit: {out.drafts.tolist()}")
        elif out.drafts is None:
            problems.append(f"{where}: no drafts, sequence {entry[1]} + {K} fits {MAX_MODEL_LEN}")
        else:
            drafted += 1
            if out.drafts.tolist() != [draft_reference(runner, sampled)]:
                problems.append(f"{where}: drafts {out.drafts.tolist()} vs reference")
            agreed = expected_batches(step)
            batches = runner.drafter.batches_across_dp
            if batches != agreed:
                problems.append(f"{where}: draft batches across DP {batches}, not {agreed}")
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        computed = len(seq)
        seq.append(sampled)
    expect_all(problems)
    return f"{STEPS} steps: drafted {drafted}, past the drafter's limit {skipped}, as reference"
