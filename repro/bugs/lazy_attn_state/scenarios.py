"""Scenarios of lazy_attn_state (vLLM #42444): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all, replay_problems
from harness.record import Context
from harness.reference import draft_reference, step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelOutput, ModelRunner, runner_config

# Decode steps after capture: 3 requests (the 4-token graph), then 7 (the 8-token graph), then
# 3 again with other lengths (a second replay of one graph must not reuse the first's plan);
# lengths unlike the warm-up's (1 each), context seeded in the KV cache.
STEPS = ([5, 17, 1], [33, 2, 9, 12, 40, 3, 8], [29, 6, 44])


def decode_runner(ctx: Context, mode: CUDAGraphMode, draft: bool = False, **config) -> ModelRunner:
    settings = {"cudagraph_sizes": (4, 8), "enable_lora": False, **config}
    runner = ModelRunner(
        runner_config(
            ctx.device,
            ctx.fixes,
            dtype=ctx.dtype,
            cudagraph_mode=mode,
            decode_backend="flashmla",
            draft_attention=draft,
            max_model_len=48,
            **settings,
        )
    )
    runner.kv_cache.fill_random(ctx.seed + 7)
    return runner


def _decode(runner: ModelRunner, ctx: Context, step: int, lens: list[int], loras=()):
    """One decode step replayed: (requests, replay, eager), `eager()` the same step run
    eagerly (only where a check needs it: `replay_problems`). `loras`: each request's adapter
    (default: the base model)."""
    loras = loras or [0] * len(lens)
    requests = [
        Request(f"r{r}", ((ctx.seed + 3 * step + r) % 64,), lora, n - 1)
        for r, (n, lora) in enumerate(zip(lens, loras, strict=True))
    ]
    out = runner.execute_model(requests)
    replay = ModelOutput(
        out.hidden_states.clone(),
        out.logits.clone(),
        None if out.draft is None else out.draft.clone(),
        out.desc,
    )
    return requests, replay, lambda: runner.execute_model(requests, use_cudagraph=False)


def decode_steps(ctx: Context, mode: CUDAGraphMode, runner=None, steps=STEPS, loras=()) -> str:
    runner = runner or decode_runner(ctx, mode)
    runner.capture_model()
    problems, graphs = [], []
    for step, lens in enumerate(steps):
        requests, replay, eager = _decode(runner, ctx, step, lens, loras[step] if loras else ())
        case = replay.desc.num_active_loras
        graphs.append(
            f"{replay.desc.cg_mode.value} {replay.desc.num_tokens}"
            + (f" lora case {case}" if case else "")
        )
        reference = step_reference(runner, requests)
        problems += replay_problems(f"lengths {lens} ({graphs[-1]})", replay, reference, eager)
    if any(problems):
        launches = {
            f"{d.cg_mode.value} {d.num_tokens}": g.launches
            for d, g in runner.cudagraph_manager.graphs.items()
            if d.uniform_decode
        }
        problems.append(f"captured decode graphs: {launches}")
    expect_all(problems)
    return f"{len(steps)} decode steps ({', '.join(graphs)}): replay ~ reference"


def full_decode_graphs(ctx: Context) -> str:
    """FULL_AND_PIECEWISE capture (FULL decode graphs of 4 and 8 requests), then decode steps
    with 3, 7 and again 3 requests of other lengths than the warm-up's (the second replay of
    the 4-request graph with lengths unlike the first's).

    Each step: replay vs the dense float64 reference (and vs an eager step, a fresh plan, where
    they differ). Fixed: a
    fresh attention state is created for capture, so each FULL graph holds the planner and
    every replay plans for the live lengths. Buggy: warm-up and capture share one state, the
    planner ran in warm-up and is missing from the graphs; replays reuse the warm-up plan:
    wrong result in every FULL size.
    """
    return decode_steps(ctx, CUDAGraphMode.FULL_AND_PIECEWISE)


# Decode steps of 3 requests (the 4-token graph) in each LoRA capture case: two adapters and
# the base model (case 3), the base model alone (case 1), one adapter (case 2).
LORA_STEPS = ([5, 17, 1], [29, 6, 44], [11, 3, 20])
LORA_OF_STEP = ([1, 0, 2], [0, 0, 0], [2, 2, 0])


def lora_case_decode_graphs(ctx: Context) -> str:
    """FULL_AND_PIECEWISE capture with LoRA specialised by active-adapter count (upstream's
    per-count capture cases, #35536): a FULL decode graph of 4 requests per case (1, 2, 3),
    then decode steps in every case, with lengths unlike the warm-up's.

    Each step: replay vs the float64 reference (and vs eager where they differ). Fixed: every
    FULL graph of every
    LoRA case is captured on a fresh attention state, with its planner. Buggy: they share the
    warm-up's state: wrong result. A fresh state made for the first LoRA case only fails too.
    """
    runner = decode_runner(
        ctx,
        CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_sizes=(4,),
        enable_lora=True,
        specialize_active_lora=True,
    )
    runner.add_lora(1, seed=ctx.seed + 11)
    runner.add_lora(2, seed=ctx.seed + 12)
    return decode_steps(ctx, CUDAGraphMode.FULL_AND_PIECEWISE, runner, LORA_STEPS, LORA_OF_STEP)


def piecewise_decode(ctx: Context) -> str:
    """The same decode steps under PIECEWISE capture: the attention (and its lazy plan) runs
    eagerly between the captured pieces, with a fresh state every step. Buggy and fixed pass:
    upstream's "PIECEWISE was unaffected", shown."""
    return decode_steps(ctx, CUDAGraphMode.PIECEWISE)


def captured_state_consumer(ctx: Context) -> str:
    """A speculator's draft attention reuses the target's captured attention states
    (captured_attn_states): its graphs read the plan the target's graph makes at replay.

    FULL_AND_PIECEWISE capture with the draft; decode steps: the draft's replay vs the float64
    split-KV reference (query: the normalized target hidden state), and the replay's hidden
    states vs the step's reference; where one differs, vs its eager step too. Fixed:
    the kept state is the one captured with the planner: all match. Buggy: the kept state is
    the warm-up's, planned for the warm-up lengths: the draft reads a stale plan (wrong
    result). Also fails a fix that captures with a fresh state but keeps the warm-up one.
    """
    return draft_decode_steps(ctx)


def draft_decode_steps(ctx: Context, watch=None) -> str:
    """Capture with the draft attention, then decode steps: the draft's replay vs the float64
    reference (and vs its eager step where they differ). `watch(runner)`, before the capture,
    returns a list that the problems it finds join (checked with the steps')."""
    runner = decode_runner(ctx, CUDAGraphMode.FULL_AND_PIECEWISE, draft=True)
    problems = watch(runner) if watch else []
    runner.capture_model()
    for step, lens in enumerate(STEPS):
        requests, replay, eager = _decode(runner, ctx, step, lens)
        label = f"lengths {lens}"
        # the replay's own draft and hidden states against the references first; the eager
        # step only where one differs (`replay_problems`, for the draft)
        hidden = step_reference(runner, requests)[0]
        if close(label, replay.hidden_states, hidden) or close(
            label, replay.draft, draft_reference(runner, replay.hidden_states, lens)
        ):
            eager = eager()
            problems += [
                close(f"{label}: draft replay vs eager", replay.draft, eager.draft),
                close(
                    f"{label}: eager draft vs reference",
                    eager.draft,
                    draft_reference(runner, eager.hidden_states, lens),
                ),
            ]
    expect_all(problems)
    return f"{len(STEPS)} decode steps: draft replay ~ reference"
