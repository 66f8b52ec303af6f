"""Scenarios of async_pinned_race (vLLM #24527, #25279): each function's docstring is its bug
report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import expect_all, mismatch
from harness.record import Context
from harness.reference import recomputed_logits
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, RunnerConfig, runner_config

# three steps of new requests of the same lengths (each step's kernels are the first's); each
# prompt's best next token leads the next by over 20% of its largest logit (A: its second best
# leads the third too; D: by 9%), so that bfloat16 ranks them as float64 does
STEP_0 = {"A": (12, 13, 7), "B": (11, 7)}
STEP_1 = {"C": (5, 15, 1), "D": (7, 6)}
STEP_2 = {"E": (6, 4, 11), "F": (4, 11)}


def async_config(ctx: Context) -> RunnerConfig:
    """An eager runner (no LoRA, no graphs) with async scheduling's sampling, its copy stream
    delayed: the order a race loses."""
    return runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.NONE,
        max_num_reqs=4,
        max_num_tokens=16,
        max_model_len=8,
        num_kv_blocks=8,
        async_output=True,
        stream_delay=True,
    )


def ranked(runner: ModelRunner, prompts: dict[str, tuple[int, ...]]) -> dict[str, list[int]]:
    """Each prompt's next tokens, best first, by the float64 reference (computed before the
    steps: on a GPU reading the weights back synchronizes the main stream)."""
    logits = recomputed_logits(runner, [list(p) for p in prompts.values()])
    rows = zip(prompts, logits, strict=True)
    return {rid: row.argsort(descending=True).tolist() for rid, row in rows}


def warm_up(runner: ModelRunner, best_of_a: int) -> None:
    """One async step of the racing steps' shapes, read back, then its rows freed: every
    kernel, stream and event is loaded before the race (with a spin kernel as the delay, a
    process's first step on an H100 blocked its host past it; the delay is now the host's and
    holds either way). Its first request
    may sample only A's best token: a device mask left from it (an upload not waited for)
    lets A sample the one token its own restriction forbids."""
    out = runner.execute_model_async(
        [Request("w0", STEP_0["A"], allowed_token_ids=(best_of_a,)), Request("w1", STEP_0["B"])]
    )
    out.get_output()
    for row in (0, 1):
        runner.kv_cache.free(row)


def token_problems(what: str, tokens: list[int], expected: list[int]) -> str | None:
    return mismatch(what, torch.tensor(tokens), torch.tensor(expected))


def restricted_step_then_next_update(ctx: Context) -> str:
    """Async scheduling (upstream: `--async-scheduling`, vLLM #23569): step 0 prefills A, with
    allowed_token_ids (the model's 2nd to 4th ranked tokens), and B; its allowed-token-ids mask
    is a reused pinned host tensor (upstream: the input batch's CPU tensors) uploaded on the
    copy stream, and the step returns before the device has sampled. A and B finish (one token
    each); step 1's host work, while step 0 is still in flight, writes the mask rows of its new
    requests C (unrestricted) and D (allowed its 2nd to 4th ranked tokens: a second restricted
    step in flight, uploading the same tensor) into the same pinned tensor. C and D finish;
    step 2's host work, steps 0 and 1 both in flight (three steps in flight), writes the rows
    of E and F (unrestricted). Then the three steps' tokens are read. A warm-up step of the
    same shapes comes first (every kernel loaded). The copy stream runs late (its copies reach
    the device only at the host's next wait on them, on both devices): each upload reads the
    mask after the next steps' host updates, as a GPU behind the host does.

    Fixed: each step's update waits for the last upload first (upstream:
    prepare_inputs_event): A and D sample their best allowed token, B, C, E and F their best.
    Buggy: steps 0 and 1 sample under step 2's rows: A's and D's restrictions are gone and
    each samples its best token, which it is not allowed (wrong result, silent, on both
    devices).
    """
    runner = ModelRunner(async_config(ctx))
    ranks = ranked(runner, STEP_0) | ranked(runner, STEP_1) | ranked(runner, STEP_2)
    allowed = {rid: tuple(ranks[rid][1:4]) for rid in ("A", "D")}
    warm_up(runner, ranks["A"][0])
    steps = []
    for prompts in (STEP_0, STEP_1, STEP_2):  # each step's requests finish (one token each)
        for row in range(len(prompts)):  # the last step's rows take this step's new requests
            runner.kv_cache.free(row)
        requests = [Request(r, p, allowed_token_ids=allowed.get(r)) for r, p in prompts.items()]
        steps.append(runner.execute_model_async(requests))
    expected = (
        [ranks["A"][1], ranks["B"][0]],
        [ranks["C"][0], ranks["D"][1]],
        [ranks["E"][0], ranks["F"][0]],
    )
    what = (
        f"step 0 tokens of A (allowed {allowed['A']}), B",
        f"step 1 tokens of C, D (allowed {allowed['D']})",
        "step 2 tokens of E, F",
    )
    expect_all(
        [
            token_problems(w, out.get_output(), e)
            for w, out, e in zip(what, steps, expected, strict=True)
        ]
    )
    return (
        f"A sampled {expected[0][0]} of its allowed {allowed['A']}, D {expected[1][1]} of "
        f"{allowed['D']}, with three steps in flight"
    )
