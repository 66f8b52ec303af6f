"""Scenarios of level2_sleep_state (vLLM #16889): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all, mismatch
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.model import ModelConfig
from harness.runner.model_runner import runner_config
from harness.runner.worker import Worker

PROMPTS = ([1, 2, 3], [7])
# Gemma's normalizer: sqrt(hidden_size) (not 1.0: a reset to a default must show)
SCALE = ModelConfig().hidden_size ** 0.5
# (label, level, the wake_up calls' tags); level 1 backs the weights pool up, buffer included
CYCLES = (
    ("sleep(1) -> wake_up()", 1, (None,)),
    ("sleep(2) -> wake_up()", 2, (None,)),
    ("sleep(2) -> wake_up([weights]) -> wake_up([kv_cache])", 2, (["weights"], ["kv_cache"])),
    ("sleep(2) -> wake_up([kv_cache]) -> wake_up([weights])", 2, (["kv_cache"], ["weights"])),
)


def _prefill(worker: Worker, label: str) -> tuple[list[int], list[str | None]]:
    """Greedy first tokens of PROMPTS, the logits vs the float64 reference (which uses the
    config's normalizer), and the live normalizer vs the config's value."""
    runner = worker.model_runner
    tokens, steps = runner.generate([list(p) for p in PROMPTS], 1)
    (requests, logits), model = steps[0], runner.model
    expected = model.normalizer.new_full((1,), model.config.embed_scale)
    return [t[0] for t in tokens], [
        mismatch(f"{label}: the normalizer buffer vs the config", model.normalizer, expected),
        close(f"{label}: logits vs reference", logits, step_reference(runner, requests)[1]),
    ]


def sleep_wake_normalizer(ctx: Context) -> str:
    """A model with a normalizer buffer (Gemma's sqrt(hidden_size), multiplied into the
    embedding output; in the weights pool, no checkpoint parameter): for each cycle sleep,
    wake and prefill two prompts; the logits must match the float64 reference (computed with
    the config's normalizer), the live buffer must hold the config's value, and the first
    tokens must be the first cycle's.

    Cycles: sleep(1) -> wake_up() (weights backed up: the buffer survives in any variant);
    sleep(2) -> wake_up(); sleep(2) staged, the weights first; sleep(2) staged, the KV cache
    first (the saved buffers must wait for the weights: restoring them into the sleeping pool
    faults). Fixed: every cycle as before the sleep. Buggy: level 2 keeps no host copy of the
    weights pool and reload_weights() writes checkpoint parameters only, so the normalizer
    wakes as the pool's 0xFF bytes, NaN: every logit is NaN from the first level-2 cycle on
    (wrong result, on the GPU as on the CPU; no fault: nothing indexes memory with it).
    """
    model = ModelConfig(embed_scale=SCALE)
    config = runner_config(
        ctx.device,
        ctx.fixes,
        model=model,
        dtype=ctx.dtype,
        cudagraph_mode=CUDAGraphMode.NONE,
        enable_lora=False,
        max_model_len=8,
    )
    worker, problems, tokens = Worker(config), [], []
    for label, level, wakes in CYCLES:
        worker.sleep(level)
        for tags in wakes:
            worker.wake_up(tags)
        got, found = _prefill(worker, label)
        problems += found
        tokens.append(got)
        if got != tokens[0]:
            problems.append(f"{label}: first tokens {got}, after {CYCLES[0][0]} {tokens[0]}")
    expect_all(problems)
    return f"{len(CYCLES)} sleep/wake cycles: normalizer {SCALE:.4f} kept, tokens {tokens[0]}"
