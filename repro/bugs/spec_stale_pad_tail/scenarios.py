"""Scenarios of spec_stale_pad_tail (vLLM #39773): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelOutput, ModelRunner, RunnerConfig, runner_config

PROMPTS = ((5, 9, 13, 2), (7, 3, 1), (4, 4, 6, 8))  # 11 tokens: last tokens 3, 6 and 10


def spec_config(ctx: Context) -> RunnerConfig:
    """A runner with a draft prefill and FULL graphs of 4 tokens (4 padded requests)."""
    return runner_config(
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
    4, whose gather reads entries 0-3 of the buffer over 4 hidden states. The graph pads that
    step by tokens (1 live of 4) and by requests (1 live of 4). Then the same after a step that
    fills the graph's tokens exactly, padded by requests alone: step 3, r0 decodes while r3 and
    r4 prefill 3 and 4 tokens (8 tokens, eager: the buffer holds 0, 3 and 7); r3 and r4
    finish; step 4: r0 decodes and r5 prefills 3 tokens (4 tokens, 2 requests, the graph of 4:
    no padding token at all, 2 padded requests).

    Fixed: prepare pads the entries past the live requests with 0 every step, however the step
    is padded: the draft logits of every step match the float64 reference. Buggy: entries 1 and
    2 still hold 6 and 10 from step 1, past step 2's 4 hidden states: the gather's bounds check
    fails (a device-side assert on the GPU, "index out of range in self" on the CPU). The
    buffer was made at start-up (zeros), not by a capture: the stale tail comes from the
    previous step. A padding that holds only when the step also has padding tokens fails step
    4 the same way: its hidden states end at its last live token, no padding row behind it.

    Between steps 1 and 2 the runner makes a dummy run of 1 token (an idle DP rank's step, a
    warm-up: eager, no KV writes): its draft prefill gathers entry 0 of the buffer, which the
    dummy's preparation sets to 0. A runner that skips preparing dummy batches ("their drafts
    are discarded") leaves step 1's index 3 there, past the dummy's one hidden state: the same
    bounds check fails, in the dummy run.
    """
    runner = ModelRunner(spec_config(ctx))
    runner.capture_model()
    first = [Request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    out, problems = checked_step(runner, first, "step 1 (3 requests, eager)")
    # a dummy run (an idle DP rank's step, a warm-up) of 1 token after step 1's 11: its eager
    # draft prefill gathers entry 0, which must be the dummy's own last token
    runner.execute_model(dummy_run=True, num_tokens=1, num_reqs=1)
    for row in (1, 2):
        runner.kv_cache.free(row)
    decode = [Request("r0", (int(out.logits[0].argmax()),), 0, len(PROMPTS[0]))]
    out, found = checked_step(runner, decode, "step 2 (1 request, graph of 4)")
    assert out.desc is not None and out.desc.num_reqs == 4, f"trigger not reached: {out.desc}"
    problems += found
    # padded by requests alone: a larger step, then one that fills the graph's 4 tokens
    done = len(PROMPTS[0]) + 1
    larger = [Request("r0", (int(out.logits[0].argmax()),), 0, done)]
    larger += [Request(f"r{3 + i}", p) for i, p in enumerate(PROMPTS[1:])]
    out, found = checked_step(runner, larger, "step 3 (3 requests, eager)")
    problems += found
    for row in (1, 2):
        runner.kv_cache.free(row)
    full = [Request("r0", (int(out.logits[0].argmax()),), 0, done + 1), Request("r5", PROMPTS[1])]
    out, found = checked_step(runner, full, "step 4 (2 requests, 4 tokens, graph of 4)")
    assert out.desc is not None and out.desc.num_tokens == 4, f"trigger not reached: {out.desc}"
    expect_all(problems + found)
    return (
        "the draft prefill of 3 requests, then of 1 in a graph of 4; of 3, then of 2 filling "
        "the graph's 4 tokens: as the reference"
    )
