"""lora_graph_capture (vLLM #43314): LoRA kernels never captured in CUDA graphs.

The fix of #43139 sets an all-zero LoRAMapping in dummy runs; prepare_tensors then finds every
token on slot -1 and sets no_lora_flag_cpu, so the shrink/expand host wrappers return before
launching. Capture runs host code once: the graphs hold no LoRA kernel, and every replay drops
the LoRA delta silently (a spec-decode LoRA test fell to 76/100 matches upstream). The fix
clears the flag and sets num_active_loras_cpu = 1 on each distinct punica wrapper after the
dummy mapping: the kernels are captured and each program exits on lora_id == -1 until a real
batch refreshes the same buffers. Run alone: `python -m repro.lora_graph_capture`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.oracle import expect_all, mismatch
from harness.outcome import ByDevice, Outcome
from harness.record import BugRecord, Context, Expect, Scenario
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner
from repro.lora_dummy_run import lora_runner

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
    reference = runner.model.reference(tokens, slots)
    if reference.equal(runner.model.reference(tokens, [-1] * len(tokens))):
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


WRONG = ByDevice.both(Outcome.WRONG_RESULT)
ASSERT = ByDevice.both(Outcome.DEVICE_ASSERT)

RECORD = BugRecord(
    id="lora_graph_capture",
    title="LoRA kernels never captured in CUDA graphs: replays drop the LoRA delta",
    upstream="https://github.com/vllm-project/vllm/pull/43314",
    symptom="silent wrong output with LoRA and CUDA graphs (76/100 matches in a spec-decode test)",
    root_cause=(
        "the dummy all-(-1) mapping sets no_lora_flag_cpu; the shrink/expand host wrappers "
        "return before launching while capture runs host code once"
    ),
    trigger="CUDA-graph capture after the #43139 dummy mapping, then batches with LoRA",
    fix_parts=(Fix.LORA_CAPTURE_LAUNCH,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "replay_vs_eager",
            replay_vs_eager,
            (
                Expect(
                    frozenset({Fix.LORA_DUMMY_MAPPING}),
                    ASSERT,
                    why="the warm-up dummy run hits lora_dummy_run (#43139) first",
                ),
                Expect(frozenset({Fix.LORA_CAPTURE_LAUNCH}), WRONG),
            ),
        ),
    ),
    history=(
        "A regression caused by the fix of lora_dummy_run (#43139, fix part "
        "lora_dummy_mapping): with both LoRA fix parts off this scenario shows #43139's "
        "device-side assert instead of a wrong result."
    ),
)


if __name__ == "__main__":
    from harness.cli import run_alone

    run_alone(RECORD.id)
