"""Scenarios of rank_rng_divergence (vLLM #17929): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.parallel import Collectives, ParallelConfig

PROMPT = (3, 1, 4, 1, 5)
# per verify step, what each draft is made to meet (the proposer chooses its draft and draft
# probability q against the float64 reference p and the shared seed's uniform u):
# "a": the most probable token, q = p / 2 (ratio 2: accepted whatever u); "r": the least
# probable token, q = 1 (ratio p: rejected, u is above it); "mid": a ratio 0.25 from the shared
# seed's u (the fixed ranks accept where u < 0.5), the two ranks' own draws on either side of
# it; "split": a ratio between the shared seed's u and the draw of a generator seeded again
# that step (a runner that reseeds every step repeats the first step's uniforms), with both
# ranks' own draws on the other side from the shared seed's (so a rank that kept the shared
# seed while its peer did not also diverges)
PLAN = (
    ("mid", "a"),
    ("r", "a"),
    ("split", "r", "a"),  # a rejection in the step after one: rejections in a row
    ("a", "a", "a"),  # every draft accepted: the bonus token
    ("r",),  # one draft
)
DEFAULT_SEED = 0  # what the fixed engine's unset seed becomes (vLLM #17929)
MARGIN = 0.05  # the least distance of a decisive draw from its acceptance ratio
TIE = 0.05  # logits: a recovered or bonus token within this of the reference's best


def _draws(seed: int, device: str) -> list[list[float]]:
    """The uniforms a generator seeded `seed` gives each verify step of PLAN, drawn as the
    runner draws them (one tensor of the step's drafts per step)."""
    gen = torch.Generator(device).manual_seed(seed)
    return [torch.rand(len(kinds), generator=gen, device=device).tolist() for kinds in PLAN]


def _ratios(draws: list[list[float]], device: str) -> list[list[float | None]]:
    """Each decisive draft's acceptance ratio (None for the others). "mid": 0.25 above a shared
    draw under 0.5 (accepted), 0.25 below one from 0.5 (rejected). "split": halfway between
    the shared draw and the one a generator seeded again at that step gives, so that a runner
    whose stream restarts every step decides it the other way."""
    ratios: list[list[float | None]] = []
    for step, kinds in enumerate(PLAN):
        again = torch.Generator(device).manual_seed(DEFAULT_SEED)
        restarted = torch.rand(len(kinds), generator=again, device=device).tolist()
        ratios.append([])
        for i, kind in enumerate(kinds):
            u = draws[step][i]
            if kind == "mid":
                ratios[-1].append(u + 0.25 if u < 0.5 else u - 0.25)
            elif kind == "split":
                if step == 0 or abs(u - restarted[i]) < 3 * MARGIN:
                    raise AssertionError(
                        f"trigger not reached: step {step + 1}'s draw {u:.3f} and a restarted "
                        f"stream's {restarted[i]:.3f} are too close to tell apart"
                    )
                ratios[-1].append((u + restarted[i]) / 2)
            else:
                ratios[-1].append(None)
    return ratios


def _side(u: float, ratio: float) -> int:
    """-1: accepted with a margin, 1: rejected with a margin, 0: too close to tell."""
    return -1 if u < ratio - MARGIN else 1 if u > ratio + MARGIN else 0


def _rank_process_seeds(
    shared: list[list[float]], ratios: list[list[float | None]], device: str
) -> tuple[int, int]:
    """Two process seeds (standing for the random state an unseeded worker process starts
    with, its own on each rank) whose draws fall on either side of every "mid" ratio, and on
    the other side from the shared seed's at every "split": the ranks of the buggy runner
    disagree by construction, and so would a rank that kept the shared seed and one that did
    not."""
    decisive = [(s, i, k) for s, kinds in enumerate(PLAN) for i, k in enumerate(kinds)]
    decisive = [(s, i, k) for s, i, k in decisive if k in ("mid", "split")]
    for j in range(500):
        seeds = (1000 + 2 * j, 1001 + 2 * j)
        own = [_draws(seed, device) for seed in seeds]
        good = True
        for s, i, kind in decisive:
            ratio = ratios[s][i]
            sides = [_side(d[s][i], ratio) for d in own]
            if kind == "mid":
                good &= sorted(sides) == [-1, 1]
            else:
                good &= sides == [-_side(shared[s][i], ratio)] * 2
        if good:
            return seeds
    raise AssertionError("trigger not reached: no process seeds split the ranks' draws")


def _probs(runner: ModelRunner, tokens: list[int], head: torch.Tensor) -> torch.Tensor:
    """float64 next-token probabilities after `tokens` (recomputed, no cache read)."""
    hidden = step_reference(runner, [Request("ref", tuple(tokens))])[0]
    return torch.softmax(hidden[-1] @ head.T, -1)


def tp_pair_verify_drafts(ctx: Context) -> str:
    """The steps of `tp_ranks_verify_drafts` (below) on one tensor-parallel group of two ranks,
    no data parallelism: the layout that runs on NCCL, one GPU per rank, on a machine with two
    GPUs (the four-rank one needs four). Fixed: every step as reference. Buggy: the drafter's
    all-reduce has one row more on one rank than on the other at step 1: collective_mismatch.
    """
    return tp_ranks_verify_drafts(ctx)


def tp_ranks_verify_drafts(ctx: Context) -> str:
    """Two data-parallel ranks of two tensor-parallel ranks each (four processes: DP 2 x TP
    2, as a DP deployment of TP engines lays them out) serve one request per DP rank with
    speculative decoding and an unset engine seed, each rank in its own engine loop (an
    external launcher's layout, no broadcast of rank 0's results). Each rank's process starts
    with its own random state (the scenario seeds the two TP positions apart, as unseeded
    worker processes are; the DP ranks alike). A prefill, then five verify steps of one to
    three drafts each; every draft comes with its draft probability, chosen against the
    float64 reference so that, with the uniforms of seed 0, the first step's first draft is
    decided by the draw (accepted where it is under 0.5), the third step's first by whether
    the generator's stream went on from the earlier steps (its ratio lies between that draw
    and a restarted stream's), a draft is rejected in two steps in a row, one step accepts
    all three (a bonus token) and one step has a single draft. After rejection sampling, each
    rank runs the drafter's first tensor-parallel layer on the hidden states of the tokens it
    kept (an all-reduce over the TP group, as many rows as tokens kept). Each rank checks the
    accepted counts, the recovered and bonus tokens and the reduced hidden states against the
    reference.

    Fixed: the unset seed is 0 on both ranks (vLLM #17929); they draw the same uniforms,
    accept the same drafts, and their all-reduces agree. Buggy: each rank seeds its sampling
    from its process's own state; the first draft's ratio lies between the two ranks' first
    draws (the scenario picks the process seeds so), so one rank accepts it and the other
    rejects it: the drafter's all-reduce has one row more on one rank than on the other at
    step 1 (upstream: an NCCL hang, or ranks silently running different tokens); the
    coordinator's trace comparison names it: collective_mismatch.
    """
    if ctx.world_size not in (2, 4):
        raise RuntimeError(f"runs as 2 or 4 ranks (Scenario.ranks), not {ctx.world_size}")
    device = ctx.device
    draws = _draws(DEFAULT_SEED, device)
    ratios = _ratios(draws, device)
    parallel = ParallelConfig(
        world_size=ctx.world_size,
        rank=ctx.rank,
        data_parallel_size=ctx.world_size // 2,
        tensor_parallel_size=2,
    )
    torch.manual_seed(_rank_process_seeds(draws, ratios, device)[parallel.tp_rank])
    config = runner_config(
        device,
        ctx.fixes,
        dtype=ctx.dtype,
        cudagraph_mode=CUDAGraphMode.NONE,
        enable_lora=False,
        rejection_sampling=True,
        max_model_len=32,
        parallel=parallel,
    )
    collectives = Collectives(parallel, device, ctx.trace)
    runner = ModelRunner(config, collectives=collectives)
    head = runner.model.head.detach().double().cpu()
    runner.kv_cache.free(0)
    seq, computed, drafts, problems, accepted_total = list(PROMPT), 0, [], [], 0
    for step in range(len(PLAN) + 1):
        kinds = PLAN[step - 1] if step else ()
        drafts, qs, ps = [], [], []
        for i, kind in enumerate(kinds):
            p = _probs(runner, seq + drafts, head)
            u = draws[step - 1][i]
            if kind == "a":
                d = int(p.argmax())
                q = float(p[d]) / 2
            elif kind == "r":
                d = int(p.argmin())
                q = 1.0
                assert u > float(p[d]) + MARGIN, f"trigger not reached: draw {u} under {p[d]}"
            else:
                ratio = ratios[step - 1][i]
                d = int(torch.where(p <= ratio, p, -1.0).argmax())
                q = float(p[d]) / ratio
            drafts.append(d)
            qs.append(q)
            ps.append(p)
        request = Request("req0", tuple((seq + drafts)[computed:]), 0, computed)
        out = runner.execute_spec_step(request, drafts, qs)
        collectives.end_step()
        where = f"step {step}, rank {ctx.rank}"
        decided = [
            k == "a" or (k in ("mid", "split") and draws[step - 1][i] < ratios[step - 1][i])
            for i, k in enumerate(kinds)
        ]
        accepted = decided.index(False) if False in decided else len(kinds)
        if out.num_accepted != accepted:
            problems.append(f"{where}: {out.num_accepted} drafts accepted, not {accepted}")
            break
        if out.tokens[:accepted] != drafts[:accepted]:
            problems.append(f"{where}: accepted tokens {out.tokens[:accepted]} not the drafts")
            break
        p = ps[accepted] if accepted < len(kinds) else _probs(runner, seq + drafts, head)
        if accepted < len(kinds):
            p = p.clone()
            p[drafts[accepted]] = -1.0  # the rejected draft is not recovered
        best, token = p.argmax(), out.tokens[-1]
        if torch.log(p[token].clamp_min(1e-300)) < torch.log(p[best]) - TIE:
            problems.append(f"{where}: token {token} (p {float(p[token]):.4f}), best {int(best)}")
            break
        kept = (seq + drafts)[: len(seq) + accepted]
        ref = step_reference(runner, [Request("ref", tuple(kept))])[0][computed:]
        problems.append(close(f"{where}: drafter's reduced hidden states", out.draft_hidden, ref))
        if problems[-1]:
            break
        seq += out.tokens
        computed = len(seq) - 1
        accepted_total += accepted
    expect_all(problems)
    total = sum(len(kinds) for kinds in PLAN)
    return f"{len(PLAN)} verify steps, {accepted_total} of {total} drafts accepted, as reference"
