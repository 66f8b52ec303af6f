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

# two steps of new requests of the same lengths (the second step's kernels are the first's);
# each prompt's best next token leads the next by over 20% of its largest logit (A: its second
# best leads the third), so that bfloat16 ranks them as float64 does
STEP_0 = {"A": (12, 13, 7), "B": (11, 7)}
STEP_1 = {"C": (5, 15, 1), "D": (7, 6)}


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
    requests C and D (unrestricted) into the same pinned tensor. Then both steps' tokens are
    read. A warm-up step of the same shapes comes first (every kernel loaded). The copy stream
    runs late (its copies reach the device only at the host's next wait on them, on both
    devices): step 0's upload reads the mask after step 1's host update, as a GPU behind the
    host does.

    Fixed: step 1's update waits for step 0's upload first (upstream: prepare_inputs_event):
    A samples its best allowed token, B, C and D their best. Buggy: step 0 samples under step
    1's rows: A's restriction is gone and it samples its best token, which it is not allowed
    (wrong result, silent, on both devices).
    """
    runner = ModelRunner(async_config(ctx))
    ranks = ranked(runner, STEP_0) | ranked(runner, STEP_1)
    allowed = tuple(ranks["A"][1:4])
    warm_up(runner, ranks["A"][0])
    first = runner.execute_model_async(
        [Request("A", STEP_0["A"], allowed_token_ids=allowed), Request("B", STEP_0["B"])]
    )
    for row in (0, 1):  # A and B finished: their rows take step 1's new requests
        runner.kv_cache.free(row)
    second = runner.execute_model_async([Request(r, p) for r, p in STEP_1.items()])
    expected = [ranks["A"][1], ranks["B"][0]], [ranks["C"][0], ranks["D"][0]]
    expect_all(
        [
            token_problems(
                f"step 0 tokens of A (allowed {allowed}), B", first.get_output(), expected[0]
            ),
            token_problems("step 1 tokens of C, D", second.get_output(), expected[1]),
        ]
    )
    return f"A sampled {expected[0][0]} of its allowed {allowed} while step 1 was prepared"
