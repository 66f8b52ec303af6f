"""Scenarios of lora_dummy_run (vLLM #43139): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.fixes import Fix
from harness.oracle import close, expect_all, mismatch, replay_problems
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request, dummy_lengths
from harness.runner.model_runner import ModelRunner, runner_config

DUMMY_TOKENS, DUMMY_REQS = 8, 2
# Real batches after a capture, one per FULL graph size (4, 8 tokens), then the 4-token graph
# again with other requests; every adapter and the base model mixed; the LM-head LoRA sees each
# request's adapter. (A 16-token graph and a 12-token batch for it were dropped, 2026-11-28: no
# regression of the sets needed them, and they were a third of a scenario's interpreted time.)
CAPTURE_SIZES = (4, 8)
BATCHES = (
    ("3 tokens, all on adapter 1", (Request("a", (3, 5), 1), Request("b", (7,), 1))),
    (
        "7 tokens: base + adapter 1 + adapter 2",
        (Request("a", (2, 4, 6), 0), Request("b", (8,), 1), Request("c", (9, 10, 12), 2)),
    ),
    (
        "4 tokens again: adapter 2, base, adapter 1",
        (Request("p", (6,), 2), Request("q", (11, 13), 0), Request("r", (5,), 1)),
    ),
)


def lora_runner(ctx: Context, adapters: bool = True, **config) -> ModelRunner:
    """A runner with LoRA enabled and two adapters loaded (ids 1 and 2; `adapters=False`:
    none yet, `add_adapters`), no mapping set yet."""
    config = {"cudagraph_sizes": CAPTURE_SIZES, **config}
    runner = ModelRunner(runner_config(ctx.device, ctx.fixes, dtype=ctx.dtype, **config))
    if adapters:
        add_adapters(runner, ctx)
    return runner


def add_adapters(runner: ModelRunner, ctx: Context) -> None:
    """Adapters 1 and 2, seeded from the run's seed."""
    runner.add_lora(1, seed=ctx.seed + 11)
    runner.add_lora(2, seed=ctx.seed + 12)


def check_batches(runner: ModelRunner) -> list[str | None]:
    """Every batch of BATCHES: graph replay vs the dense reference (and vs eager, where they
    differ: `replay_problems`); and which LoRA kernels the graphs hold, when something
    diverged."""
    problems = []
    for label, requests in BATCHES:
        replay = runner.execute_model(list(requests))
        graph = replay.desc
        replay = type(replay)(replay.hidden_states.clone(), replay.logits.clone(), None, graph)
        problems += replay_problems(
            f"{label} ({graph and graph.cg_mode.value} {graph and graph.num_tokens})",
            replay,
            step_reference(runner, list(requests)),
            lambda: runner.execute_model(list(requests), use_cudagraph=False),  # noqa: B023
        )
    if any(problems):
        graphs = runner.cudagraph_manager.graphs
        captured = sorted({n for g in graphs.values() for n in g.launches if "lora" in n})
        problems.append(f"LoRA kernels in the captured graphs: {captured or 'none'}")
    return problems


def dummy_run_before_mapping(ctx: Context) -> str:
    """Profile-style dummy runs with LoRA enabled before any real LoRA mapping, on an eager
    runner (graph mode NONE: the dummy mapping is no capture concern): the first at
    startup, before any adapter is loaded, of max_num_tokens (32: longer than the largest
    capture size, 16), the second of 8 tokens once two adapters are loaded.

    Fixed: both runs complete, their hidden states and logits equal the base model's (dummy
    token 0, nothing cached), every wrapper's token and prompt metas hold slot -1 for every
    token and request of the dummy batch (active_lora_ids all -1), and no_lora_flag_cpu is
    set (cleared again, with num_active_loras_cpu = 1, where lora_capture_launch is on).
    Buggy: the LoRA embedding gathers with poisoned offsets: device-side assert on the GPU;
    torch's CPU gather raises IndexError("index out of range in self"), the same check. A
    mapping skipped while no adapter is loaded, or sized for the capture sizes rather than
    the dummy batch, leaves the same poisoned offsets (the first run shows both).
    """
    runner = ModelRunner(
        runner_config(ctx.device, ctx.fixes, dtype=ctx.dtype, cudagraph_mode=CUDAGraphMode.NONE)
    )
    problems = _dummy_matches_base(runner, runner.config.max_num_tokens, DUMMY_REQS, "no adapter")
    runner.add_lora(1, seed=ctx.seed + 11)
    runner.add_lora(2, seed=ctx.seed + 12)
    problems += _dummy_matches_base(runner, DUMMY_TOKENS, DUMMY_REQS, "adapters 1 and 2")
    launch_anyway = Fix.LORA_CAPTURE_LAUNCH in ctx.fixes
    for i, wrapper in enumerate(runner.lora_manager._adapter_manager.distinct_wrappers()):
        for name, rows in (
            ("token_mapping_meta", DUMMY_TOKENS),
            ("prompt_mapping_meta", DUMMY_REQS),
        ):
            meta = getattr(wrapper, name)
            for field in ("active_lora_ids", "token_lora_mapping"):  # every row of the batch
                got = getattr(meta, field).cpu()[: rows if field == "token_lora_mapping" else None]
                problems.append(
                    mismatch(f"wrapper {i} {name} {field}", got, torch.full_like(got, -1))
                )
            flag, active = bool(meta.no_lora_flag_cpu[0]), int(meta.num_active_loras_cpu[0])
            if (flag, active) != (not launch_anyway, int(launch_anyway)):
                problems.append(
                    f"wrapper {i} {name}: no_lora_flag_cpu={flag}, num_active_loras_cpu={active}"
                )
    expect_all(problems)
    first = runner.config.max_num_tokens
    return f"dummy runs of {first} and {DUMMY_TOKENS} tokens equal the base model; LoRA ids -1"


def _dummy_matches_base(runner: ModelRunner, tokens: int, reqs: int, label: str) -> list:
    out = runner.execute_model(dummy_run=True, num_tokens=tokens, num_reqs=reqs)
    lengths = dummy_lengths(tokens, reqs)
    requests = [Request(f"dummy{r}", (0,) * n) for r, n in enumerate(lengths)]
    hidden, logits = step_reference(runner, requests, dummy=True)
    return [
        close(
            f"{label}: {tokens}-token dummy-run hidden states vs base", out.hidden_states, hidden
        ),
        close(f"{label}: {tokens}-token dummy-run logits vs base model", out.logits, logits),
    ]


def capture_and_check(
    ctx: Context,
    before: Callable[[ModelRunner], object],
    adapters_after: bool = False,
    **config,
) -> str:
    """A LoRA runner, `before` it captures, capture_model, then BATCHES checked.
    `adapters_after`: the adapters are added after the capture (a server's order)."""
    runner = lora_runner(ctx, adapters=not adapters_after, **config)
    before(runner)
    runner.capture_model()
    if adapters_after:
        add_adapters(runner, ctx)
    expect_all(check_batches(runner))
    graphs = runner.cudagraph_manager.graphs
    captured = sorted({n for g in graphs.values() for n in g.launches if "lora" in n})
    return f"{len(graphs)} graphs, {len(BATCHES)} batches: replay ~ reference; {captured}"


def capture_without_dummy_run(ctx: Context) -> str:
    """CUDA-graph capture straight after loading the adapters: no dummy run came first.

    capture_model's LoRA capture hook sets the dummy LoRA state itself, then every FULL graph
    (4, 8 tokens) is captured on it; real batches follow. Fixed: replay ~ reference. Without
    lora_dummy_mapping: the capture's warm-up runs the LoRA embedding on the unset (poisoned)
    metadata: device-side assert on the GPU, IndexError on the CPU.
    Without lora_capture_launch: the graphs hold no LoRA kernel: wrong result.
    """
    return capture_and_check(ctx, lambda runner: None, cudagraph_mode=CUDAGraphMode.FULL)


def capture_after_base_batch(ctx: Context) -> str:
    """A real base-model batch first (its mapping is all no-LoRA: no_lora_flag_cpu set), then
    capture with no dummy run, then LoRA batches. Fixed: the capture hook's dummy LoRA state
    clears the flag; all match. Without lora_capture_launch: the flag the real batch left is
    frozen into every graph: wrong result. Without lora_dummy_mapping: the largest capture
    reads embedding offsets the 5-token batch never wrote: device-side assert."""
    base = [Request("a", (1, 2, 3), 0), Request("b", (4, 5), 0)]
    return capture_and_check(
        ctx, lambda runner: runner.execute_model(base), cudagraph_mode=CUDAGraphMode.FULL
    )
