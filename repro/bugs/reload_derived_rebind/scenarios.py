"""Scenarios of reload_derived_rebind (vLLM #48251): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.oracle import close, expect_all, mismatch
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.model import ModelConfig
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.post_load import derive
from harness.runner.worker import Worker
from repro.bugs.level2_sleep_state.scenarios import _step  # the same steps

NEW_CHECKPOINT = 1  # the trainer's update: weights seeded 1 (the load's are seeded 0)


def _sleep(level: int, *wakes: list[str] | None) -> Callable[[Worker], None]:
    def cycle(worker: Worker) -> None:
        worker.sleep(level)
        for tags in wakes:
            worker.wake_up(tags)

    return cycle


# (label, what happens to the weights) in order; every cycle replays the graph captured before
# the first. Only level 2 reloads at its wake (level 1 restores the weights pool's backup)
CYCLES: tuple[tuple[str, Callable[[Worker], None]], ...] = (
    ("reload_weights(), the same checkpoint", lambda w: w.model_runner.reload_weights()),
    (
        "reload_weights(), a new checkpoint",
        lambda w: w.model_runner.reload_weights(NEW_CHECKPOINT),
    ),
    ("sleep(1) -> wake_up()", _sleep(1, None)),
    ("sleep(2) -> wake_up()", _sleep(2, None)),
    ("sleep(2) -> wake_up([weights]) -> wake_up([kv_cache])", _sleep(2, ["weights"], ["kv_cache"])),
)


def _check(runner: ModelRunner, label: str, captured: dict[str, torch.Tensor]) -> list:
    """The replayed and the eager logits vs the float64 reference of the live parameters, and
    each derived tensor, at the storage the graph captured, vs a derivation of the live
    parameters."""
    model = runner.model
    requests, logits = _step(runner, graph=True)
    reference = step_reference(runner, requests)[1]  # a prefill: it reads no cached token
    eager = _step(runner, graph=False)[1]
    expected = derive(model.head, model.embed)
    return [
        close(f"{label}: graph logits vs reference", logits, reference),
        close(f"{label}: eager logits vs reference", eager, reference),
        *(
            mismatch(
                f"{label}: {name} at its captured storage vs the parameters", t, expected[name]
            )
            for name, t in captured.items()
        ),
    ]


def reload_under_graph(ctx: Context) -> str:
    """A model whose post-load processing derives two tensors the forward reads (the LM head
    transposed, as MLA's W_UK_T is a permuted copy of kv_b_proj, and a float32 embedding table,
    as FlashInfer's copy of the attention sinks), in the weights pool, and a FULL CUDA graph of
    4 tokens captured once, before any reload (it holds the derived tensors' addresses): for
    each cycle reload or sleep and wake, then prefill two prompts (4 tokens, 2 requests) by
    replaying that graph and eagerly; both logits must match the float64 reference of the live
    parameters, and each derived tensor, read where the graph captured it, must equal a
    derivation of the live parameters. In the run's dtype, and in bfloat16 beside a float32
    run (the float32 table then converts, as the sinks' copy does).

    Cycles: reload_weights() of the same checkpoint; reload_weights() of a new one (a trainer's
    update, seed 1); sleep(1) -> wake_up() (the weights pool's backup restored, no reload);
    sleep(2) -> wake_up() (the wake reloads the checkpoint into new memory); sleep(2) staged,
    the weights first. Fixed: each reload writes the derived values into the captured storage:
    every cycle matches. Buggy: the reload binds new tensors. Eager steps read them and pass in
    every cycle; the graph replays the old storage: unseen after the same checkpoint (the old
    values are the new), the old weights' logits after the new checkpoint (wrong result), and
    after a level-2 wake the fresh memory's 0xFF bytes, NaN logits (wrong result, on the GPU as
    on the CPU; no fault: nothing indexes memory with them).
    """
    problems, held = [], []
    # the run's dtype, and bfloat16 beside a float32 run: there the float32 embedding table is a
    # conversion, as FlashInfer's float32 copy of bfloat16 sinks (in float32, a plain copy)
    dtypes = [ctx.dtype] if ctx.dtype == "bfloat16" else [ctx.dtype, "bfloat16"]
    for dtype in dtypes:
        config = runner_config(
            ctx.device,
            ctx.fixes,
            model=ModelConfig(derived_weights=True),
            dtype=dtype,
            cudagraph_mode=CUDAGraphMode.FULL,
            cudagraph_sizes=(4,),
            enable_lora=False,
            max_model_len=8,
        )
        worker = Worker(config)
        runner = worker.model_runner
        runner.capture_model()  # before any reload
        # NOTE: held here, so the old storage stays allocated on either device (a GPU graph
        # holds addresses, not tensors: a rebound tensor's storage could be handed out again)
        captured = dict(runner.model.derived.tensors)
        held.append((worker, captured))
        problems += _check(runner, f"{dtype}, after load", captured)
        for label, cycle in CYCLES:
            cycle(worker)
            problems += _check(runner, f"{dtype}, {label}", captured)
    expect_all(problems)
    names = ", ".join(dtypes)
    return f"{len(CYCLES)} reloads and sleep/wake cycles on a graph captured before them ({names})"
