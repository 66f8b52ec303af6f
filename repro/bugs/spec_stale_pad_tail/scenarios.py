"""Scenarios of spec_stale_pad_tail (vLLM #39773): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelOutput, ModelRunner, RunnerConfig

PROMPTS = ((5, 9, 13, 2), (7, 3, 1), (4, 4, 6, 8))  # 11 tokens: last tokens 3, 6 and 10


def spec_config(ctx: Context) -> RunnerConfig:
    """A runner with a draft prefill and FULL graphs of 4 tokens (4 padded requests)."""
    return RunnerConfig(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.FULL,
        cudagraph_sizes=(4,),
        num_kv_blocks=8,
        max_num_reqs=4,
        max_num_tokens=16,
        max_model_len=16,
        draft_prefill=True,
    )


def checked_step(
    runner: ModelRunner, requests: list[Request], label: str
) -> tuple[ModelOutput, list[str | None]]:
    """One step; its logits and the live requests' draft logits vs the float64 reference
    (the draft model is the identity on the shared LM head: the draft logits are the target's).
    Returns the step's output and the problems found."""
    logits = step_reference(runner, requests)[1]
    out = runner.execute_model(requests)
    draft = runner.speculator.draft_logits[: len(requests)]
    problems = [
        close(f"{label}: logits vs reference", out.logits, logits),
        close(f"{label}: draft logits vs reference", draft, logits),
    ]
    return out, problems


def fewer_requests_after_larger_batch(ctx: Context) -> str:
    """A speculator's draft prefill gathers each request's last hidden state through a
    persistent last_token_indices buffer; FULL graphs of 4 tokens and 4 requests hold it. Step
    1: requests r0, r1 and r2 prefill 11 tokens (over the graph size: eager), so the buffer
    holds 3, 6 and 10. r1 and r2 finish; step 2: r0 decodes one token, replaying the graph of
    4, whose gather reads entries 0-3 of the buffer over 4 hidden states.

    Fixed: prepare pads the entries past the live request with 0 every step: the draft logits
    of both steps match the float64 reference. Buggy: entries 1 and 2 still hold 6 and 10 from
    step 1, past the step's 4 hidden states: the gather's bounds check fails (a device-side
    assert on the GPU, "index out of range in self" on the CPU). The buffer was made at
    start-up (zeros), not by a capture: the stale tail comes from the previous step.
    """
    runner = ModelRunner(spec_config(ctx))
    runner.capture_model()
    first = [Request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    out, problems = checked_step(runner, first, "step 1 (3 requests, eager)")
    for row in (1, 2):
        runner.kv_cache.free(row)
    decode = [Request("r0", (int(out.logits[0].argmax()),), 0, len(PROMPTS[0]))]
    out, found = checked_step(runner, decode, "step 2 (1 request, graph of 4)")
    assert out.desc is not None and out.desc.num_reqs == 4, f"trigger not reached: {out.desc}"
    expect_all(problems + found)
    return "the draft prefill of 3 requests, then of 1 in a graph of 4: as the reference"
