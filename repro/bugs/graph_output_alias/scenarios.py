"""Scenarios of graph_output_alias (vLLM #53520): each function's docstring is its bug report.

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

PROMPTS = ((5, 9, 13, 2, 7), (7, 3, 1))  # 8 tokens: the capture size
LONG_PROMPT = (4, 4, 6, 8, 1, 2, 3, 5, 9, 11)  # with two decodes, 12 tokens: eager


def _runner(ctx: Context, mode: CUDAGraphMode, prompt_logprobs: bool = True) -> ModelRunner:
    """Graphs of 8 tokens (4 padded requests) in `mode`, a padded drafter with graphs of its
    own in the same pool, prompt logprobs read after each step (or, off, none)."""
    config = runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=mode,
        cudagraph_sizes=(8,),
        num_kv_blocks=8,
        max_num_reqs=4,
        max_num_tokens=16,
        max_model_len=16,
        draft_prefill=True,
        draft_graphs=True,
        prompt_logprobs=prompt_logprobs,
    )
    runner = ModelRunner(config)
    runner.capture_model()
    return runner


def _step(runner: ModelRunner, requests: list[Request], label: str):
    """One step; its hidden states, logits, prompt logprobs and the draft logits (the draft
    model is the identity on the shared LM head) vs the float64 reference."""
    out = runner.execute_model(requests)
    hidden, logits = step_reference(runner, requests)
    head = runner.model.head.detach().double().cpu()
    label = f"{label} ({out.desc.cg_mode.value} {out.desc.num_tokens})" if out.desc else label
    draft = runner.speculator.draft_logits[: len(requests)]
    problems = [
        close(f"{label}: hidden states vs reference", out.hidden_states, hidden),
        close(f"{label}: logits vs reference", out.logits, logits),
        close(f"{label}: draft logits vs reference", draft, logits),
    ]
    if runner.config.prompt_logprobs:
        prompt = torch.log_softmax(hidden @ head.T, -1)
        problems.append(
            close(f"{label}: prompt logprobs vs reference", out.prompt_logprobs, prompt)
        )
    return out, problems


def _replayed_steps(runner: ModelRunner, note: str) -> tuple[list[int], list]:
    """The prefill of PROMPTS (8 tokens, the graph's size: padded by requests only), then a
    decode of both (2 tokens padded to 8); the tokens the decode sampled and the problems."""
    first = [Request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    out, problems = _step(runner, first, f"prefill of 8 tokens{note}")
    tokens = out.logits.argmax(-1).tolist()
    decode = [
        Request(f"r{i}", (t,), 0, len(p))
        for i, (p, t) in enumerate(zip(PROMPTS, tokens, strict=True))
    ]
    out, found = _step(runner, decode, f"decode of 2 requests{note}")
    return out.logits.argmax(-1).tolist(), problems + found


def _serve(ctx: Context, mode: CUDAGraphMode) -> str:
    runner = _runner(ctx, mode)
    tokens, problems = _replayed_steps(runner, "")
    longer = [
        *(
            Request(f"r{i}", (t,), 0, len(p) + 1)
            for i, (p, t) in enumerate(zip(PROMPTS, tokens, strict=True))
        ),
        Request("r2", LONG_PROMPT),
    ]
    _, found = _step(runner, longer, "12 tokens, past the capture size: eager")
    problems += found
    # prompt logprobs off (no step asks for them): the hidden states the step returns are
    # still the target's, whatever reads them
    _, found = _replayed_steps(_runner(ctx, mode, prompt_logprobs=False), ", prompt logprobs off")
    problems += found
    expect_all(problems)
    return (
        "prefill and decode replayed, then an eager step; prefill and decode replayed with "
        "prompt logprobs off: every output as the reference"
    )


def piecewise_prefill_then_drafter(ctx: Context) -> str:
    """Speculative decoding with a padded drafter (upstream: MTP/EAGLE-style, vLLM issue
    #53488) and prompt logprobs: the target replays a PIECEWISE graph of 8 tokens, the sampler
    takes its logits, the drafter replays its own graph, captured after the target's into the
    same pool (its outputs laid where the target's are: upstream keeps graph outputs as weak
    references), and the step's bookkeeping then computes prompt logprobs from the target's
    hidden states. Steps: a prefill of two prompts (8 tokens, the capture size), a decode of
    both (padded to 8), then a step of 12 tokens, past the capture size: eager. Then a second
    runner with prompt logprobs off replays the same prefill and decode: the hidden states the
    step returns must be the target's whether or not prompt logprobs read them.

    Fixed: the target's hidden states are copied out of the pool before the drafter replays:
    every step's hidden states, logits, prompt logprobs and draft logits match the float64
    reference. Buggy: the drafter's replay overwrites them: the replayed steps' hidden states
    and prompt logprobs are the drafter's numbers (wrong result, silent, on both devices), with
    prompt logprobs off too (the hidden states); the logits (sampled first) and the eager step
    stay right, the boundary the issue measured.
    """
    return _serve(ctx, CUDAGraphMode.PIECEWISE)


def full_graph_then_drafter(ctx: Context) -> str:
    """The same steps with FULL graphs of 8 tokens for the target (the drafter's graphs too):
    the pool is shared whatever the mode; prompt logprobs on, then off (a second runner).

    Fixed: every step as the reference. Buggy: the replayed steps' hidden states and prompt
    logprobs are the drafter's outputs (wrong result, silent, on both devices).
    """
    return _serve(ctx, CUDAGraphMode.FULL)
