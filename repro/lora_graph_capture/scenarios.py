"""Scenarios of lora_graph_capture (vLLM #43314): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import decoder_reference, expect_all, mismatch
from harness.record import Context
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner
from repro.lora_dummy_run.scenarios import lora_runner

BATCHES = (
    ("all tokens on adapter 1", (Request("a", (3, 5, 7), 1), Request("b", (11, 13), 1))),
    (
        "mixed base + adapter 1 + adapter 2",
        (Request("a", (2, 4, 6), 0), Request("b", (8,), 1), Request("c", (9, 10, 12, 14), 2)),
    ),
    (
        "adapter 2 and base, 12 tokens",
        (Request("x", tuple(range(20, 31)), 2), Request("y", (1,), 0)),
    ),
)


def _check_batch(runner: ModelRunner, label: str, requests: list[Request]) -> list[str | None]:
    replay = runner.execute_model(requests).clone().cpu()
    eager = runner.execute_model(requests, use_cudagraph=False).cpu()
    adapters = runner.lora_manager._adapter_manager.lora_index_to_id
    slots = [adapters.index(r.lora_id) if r.lora_id else -1 for r in requests for _ in r.token_ids]
    tokens = [t for r in requests for t in r.token_ids]
    reference = decoder_reference(runner.model, tokens, slots)
    if reference.equal(decoder_reference(runner.model, tokens, [-1] * len(tokens))):
        raise RuntimeError(f"{label}: the adapters do not change the logits; scenario is void")
    return [
        mismatch(f"{label}: eager vs dense reference", eager.double(), reference),
        mismatch(f"{label}: graph replay vs eager", replay, eager),
    ]


def replay_vs_eager(ctx: Context) -> str:
    """Warm-up dummy run -> capture (8, 16 tokens) -> real LoRA batches, replay vs eager.

    Batches, in a row: all tokens on adapter 1; base + adapter 1 + adapter 2 mixed; adapter 2
    and base (12 tokens, the 16-token graph). Fixed: every replay equals eager, and eager
    equals the dense reference. Buggy: replays miss the LoRA delta (wrong result) and the
    captured launches hold no LoRA kernel. With lora_dummy_mapping off too, the warm-up dummy
    run already fails with the device-side assert of lora_dummy_run.
    """
    runner = lora_runner(ctx)
    runner.execute_model(dummy_run=True, num_tokens=16, num_reqs=4)
    runner.capture_model()
    problems = []
    for label, requests in BATCHES:
        problems += _check_batch(runner, label, list(requests))
    graphs = runner.cudagraph_manager.graphs
    captured = sorted({n for g in graphs.values() for n in g.launches if "lora" in n})
    if any(problems):
        problems.append(f"LoRA kernels in the captured graphs: {captured or 'none'}")
    expect_all(problems)
    return f"{len(BATCHES)} batches: replay == eager == reference; captured {captured}"
