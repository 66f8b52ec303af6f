"""Scenarios of level2_sleep_state (vLLM #16889): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all, mismatch
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model import ModelConfig
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.worker import Worker

PROMPTS = ([1, 2, 3], [7])  # 4 tokens, 2 requests: the FULL graph of 4, padded by requests
# Gemma's normalizer: sqrt(hidden_size) (not 1.0: a reset to a default must show)
SCALE = ModelConfig().hidden_size ** 0.5
# (label, level, the wake_up calls' tags, eager too); level 1 backs the weights pool up, buffer
# included; every cycle replays the graph captured before the first sleep
CYCLES = (
    ("sleep(1) -> wake_up()", 1, (None,), False),
    ("sleep(2) -> wake_up()", 2, (None,), True),
    (
        "sleep(2) -> wake_up([weights]) -> wake_up([kv_cache])",
        2,
        (["weights"], ["kv_cache"]),
        False,
    ),
    (
        "sleep(2) -> wake_up([kv_cache]) -> wake_up([weights])",
        2,
        (["kv_cache"], ["weights"]),
        False,
    ),
)


def _step(runner: ModelRunner, graph: bool) -> tuple[list[Request], torch.Tensor]:
    """PROMPTS prefilled as new requests in rows 0 and 1 (a replay of the FULL graph of 4 when
    `graph`, else eagerly), then finished; the requests and a copy of their logits."""
    kv, requests = runner.kv_cache, [Request(f"req{r}", tuple(p)) for r, p in enumerate(PROMPTS)]
    out = runner.execute_model(requests, use_cudagraph=graph)
    assert (out.desc is not None) == graph, f"trigger not reached: graph {out.desc}"
    for row in range(len(requests)):
        kv.free(row)
    return requests, out.logits.clone()


def _prefill(worker: Worker, label: str, eager: bool) -> tuple[list[int], list[str | None]]:
    """Greedy first tokens of PROMPTS on the captured graph (and eagerly, when `eager`), the
    logits vs the float64 reference (which uses the config's normalizer), and the live
    normalizer (what an eager step reads) vs the config's value."""
    runner = worker.model_runner
    requests, logits = _step(runner, graph=True)
    model = runner.model
    expected = model.normalizer.new_full((1,), model.config.embed_scale)
    reference = step_reference(runner, requests)[1]  # a prefill: it reads no cached token
    problems = [
        mismatch(f"{label}: the normalizer buffer vs the config", model.normalizer, expected),
        close(f"{label}: graph logits vs reference", logits, reference),
    ]
    if eager:
        eager_logits = _step(runner, graph=False)[1]
        problems.append(close(f"{label}: eager logits vs reference", eager_logits, reference))
    return logits.argmax(-1).tolist(), problems


def sleep_wake_normalizer(ctx: Context) -> str:
    """A model with a normalizer buffer (Gemma's sqrt(hidden_size), multiplied into the
    embedding output; in the weights pool, no checkpoint parameter) and a FULL CUDA graph of 4
    tokens, captured once before the first sleep (it holds the addresses of the weights, the
    buffer and the KV cache): for each cycle sleep, wake and prefill two prompts (4 tokens, 2
    requests) by replaying that graph; the logits must match the float64 reference (computed
    with the config's normalizer), the live buffer must hold the config's value, and the first
    tokens must be the first cycle's. After sleep(2) -> wake_up() the prompts also run eagerly
    (the live buffer's path), against the same reference.

    Cycles: sleep(1) -> wake_up() (weights backed up: the buffer survives in any variant);
    sleep(2) -> wake_up(); sleep(2) staged, the weights first; sleep(2) staged, the KV cache
    first (the saved buffers must wait for the weights: restoring them into the sleeping pool
    faults). The graph reads the buffer where it lived at capture: a restore that rebinds it
    to new memory instead of writing it in place leaves the graph the wake's bytes while the
    live buffer looks right. Fixed: every cycle as before the sleep. Buggy: level 2 keeps no
    host copy of the weights pool and reload_weights() writes checkpoint parameters only, so
    the normalizer wakes as the pool's 0xFF bytes, NaN: every logit is NaN from the first
    level-2 cycle on, replayed and eager (wrong result, on the GPU as on the CPU; no fault:
    nothing indexes memory with it).
    """
    model = ModelConfig(embed_scale=SCALE)
    config = runner_config(
        ctx.device,
        ctx.fixes,
        model=model,
        dtype=ctx.dtype,
        cudagraph_mode=CUDAGraphMode.FULL,
        cudagraph_sizes=(4,),
        enable_lora=False,
        max_model_len=8,
    )
    worker, problems, tokens = Worker(config), [], []
    worker.model_runner.capture_model()  # before any sleep
    for label, level, wakes, eager in CYCLES:
        worker.sleep(level)
        for tags in wakes:
            worker.wake_up(tags)
        got, found = _prefill(worker, label, eager)
        problems += found
        tokens.append(got)
        if got != tokens[0]:
            problems.append(f"{label}: first tokens {got}, after {CYCLES[0][0]} {tokens[0]}")
    expect_all(problems)
    return (
        f"{len(CYCLES)} sleep/wake cycles on a graph captured before them: normalizer "
        f"{SCALE:.4f} kept, tokens {tokens[0]}"
    )
