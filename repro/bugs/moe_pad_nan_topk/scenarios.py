"""Scenarios of moe_pad_nan_topk (vLLM #39391): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring. The runner
helpers here serve moe_pad_sentinel too.
"""

from __future__ import annotations

import torch

from harness.oracle import close, expect_all, mismatch, step_problems
from harness.record import Context
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model import POISON_ROW, ModelConfig, gate_clamps
from harness.runner.model_runner import ModelOutput, ModelRunner, runner_config
from kernels.moe_permute import moe_finalize, moe_permute_experts, moe_permute_reference
from kernels.topk_gate import topk_gate

# Decode steps replayed by the graph of 4 tokens: 3 requests (one padding row), then 2 (two),
# each (token id, tokens in the cache after the step). Tokens and the seeded context give
# every real token's gate a margin of 10 logits between its first and second expert (float64),
# so bfloat16 routes them as float64 does.
STEPS = (((5, 5), (11, 9), (17, 2)), ((11, 7), (17, 3)))
CONTEXT_SEED = 1


def padded_runner(ctx: Context, mode: CUDAGraphMode, skip_padding: bool) -> ModelRunner:
    """A runner routing by the learned gate, with graphs of 4 tokens only."""
    runner = ModelRunner(
        runner_config(
            ctx.device,
            ctx.fixes,
            model=ModelConfig(learned_gate=True, skip_padding=skip_padding),
            # NOTE: float32 whatever --dtype says: in bfloat16 on an H100 the fixed runner's
            # eager steps diverge from the float64 reference and a replay holds NaN in real
            # rows (2026-11-25, not yet explained; the CPU passes): open, README "Sentinel
            # contracts"
            dtype="float32",
            cudagraph_mode=mode,
            cudagraph_sizes=(4,),
            enable_lora=False,
            max_num_tokens=8,
            max_num_reqs=4,
            max_model_len=16,
        )
    )
    runner.kv_cache.fill_random(CONTEXT_SEED)
    return runner


def padded_decode_steps(ctx: Context, mode: CUDAGraphMode, skip_padding: bool) -> str:
    """Capture, then each step of STEPS replayed (padded to 4 tokens), run eagerly (unpadded)
    and recomputed in float64: replay vs eager vs the reference."""
    runner = padded_runner(ctx, mode, skip_padding)
    runner.capture_model()
    problems, shown = [], []
    for step in STEPS:
        requests = [Request(f"r{row}", (t,), 0, n - 1) for row, (t, n) in enumerate(step)]
        out = runner.execute_model(requests)
        replay = ModelOutput(out.hidden_states.clone(), out.logits.clone(), None, out.desc)
        if out.desc is None or out.desc.num_tokens != 4:
            problems.append(f"{len(step)} requests ran as {out.desc}, not the graph of 4 tokens")
        eager = runner.execute_model(requests, use_cudagraph=False)
        reference = step_reference(runner, requests)
        label = f"{len(step)} tokens padded to 4 ({mode.value})"
        problems += step_problems(label, eager, reference, replay)
        shown.append(str(len(step)))
    expect_all(problems)
    return f"{mode.value} replays of {' and '.join(shown)} tokens padded to 4 == eager ~ reference"


def piecewise_padded_decode(ctx: Context) -> str:
    """A PIECEWISE graph of 4 tokens, then decode steps of 3 and 2 requests: replayed padded to
    4, with 1 and 2 padding rows; replay vs eager vs the dense float64 reference.

    The MoE layer routes by a learned gate (softmax top-2 of 8 experts, kernels/topk_gate) and
    computes its experts over expert-sorted rows (kernels/moe_permute: sort, GEMM, finalize),
    FlashInfer CUTLASS MoE's three steps. The attention between the graph's pieces runs on the
    step's real tokens only, so the padding rows of its output keep what they held: NaN (the
    poison upstream measured in nearly every padded step, vLLM #39593), which reaches the gate.
    Fixed: NaN probabilities are clamped to 0 before the selection, a padding row picks experts
    0 and 1, every pair gets a sorted row, and replay == eager ~ reference. Buggy: each padding
    row picks expert 0 twice (NaN compares false); the sort gives the token one row of expert 0
    and none for its second slot, whose entry the finalize then gathers through: a row 2^31 - 1
    rows past the buffer: an illegal address on the GPU, SIGSEGV in the interpreter, at the
    first replay. (This runner's FULL graphs attend the padding tokens as token 0 of row 0:
    numbers, not NaN; there the bug is silent.)
    """
    return padded_decode_steps(ctx, CUDAGraphMode.PIECEWISE, skip_padding=False)


# The gate logits of 5 tokens: 3 real, then 2 padding rows of a replay (NaN).
REAL_LOGITS = (
    (3.0, -1.0, 0.0, 2.0, 1.0, -2.0, 0.5, 4.0),
    (0.0, 5.0, 1.0, -3.0, 2.0, 0.0, 1.5, 0.0),
    (0.0,) * 8,  # every expert ties: experts 0 and 1
)
NUM_TOKENS, TOP_K = 5, 2


def gate_and_experts(
    ctx: Context,
    logits: torch.Tensor,
    num_actual: int | None,
    clamp: bool,
    skip_invalid: bool = True,
):
    """The MoE layer's kernels on `logits` ([tokens, 8]; rows at or past `num_actual` marked
    padding), hidden states [tokens, 16] and seeded experts: (topk ids, topk weights, finalized
    output, its float64 reference)."""
    gen = torch.Generator().manual_seed(ctx.seed)
    tokens, experts = logits.shape
    h = torch.randint(-2, 3, (tokens, 16), generator=gen).float().to(ctx.device)
    weights = torch.randint(-2, 3, (experts, 16, 16), generator=gen).float().to(ctx.device)
    ids = torch.empty(tokens, TOP_K, dtype=torch.int32, device=ctx.device)
    routing = torch.empty(tokens, TOP_K, device=ctx.device)
    actual = None
    if num_actual is not None:
        actual = torch.tensor([num_actual], dtype=torch.int32, device=ctx.device)
    topk_gate(logits.to(ctx.device), ids, routing, actual, clamp_nonfinite=clamp)
    rows = torch.full((tokens * TOP_K,), POISON_ROW, dtype=torch.int32, device=ctx.device)
    permuted = torch.empty(tokens * TOP_K, 16, device=ctx.device)
    moe_permute_experts(h, weights, ids, permuted, rows)
    out = torch.full((tokens, 16), -7.0, device=ctx.device)
    moe_finalize(permuted, rows, ids, routing, out, experts, skip_invalid=skip_invalid)
    return ids.cpu(), routing.cpu(), out.cpu(), moe_permute_reference(h, weights, ids, routing)


def nan_padding_rows(ctx: Context) -> str:
    """Kernel level: gate logits of 5 tokens whose last 2 are NaN (the padding rows of a graph
    replay), top-2 of 8 experts, the sort, the GEMM and the finalize.

    Fixed: the NaN probabilities are clamped to 0: the padding rows pick experts 0 and 1 with
    weight 0; every row's ids are distinct and the real tokens' outputs equal the float64
    reference. Buggy: the padding rows pick expert 0 twice; their second pairs get no sorted
    row and the finalize gathers through the entry's poison: an illegal address (GPU), SIGSEGV
    (interpreter).
    """
    clamp = gate_clamps(ctx.fixes)  # the runner's own switch
    nan = torch.full((NUM_TOKENS - len(REAL_LOGITS), 8), float("nan"))
    logits = torch.cat([torch.tensor(REAL_LOGITS), nan])
    ids, routing, out, reference = gate_and_experts(ctx, logits, None, clamp)
    rows = enumerate(ids.tolist())
    problems = [f"row {t}: experts {row} not distinct" for t, row in rows if len(set(row)) < TOP_K]
    problems.append(close("real rows vs reference", out[:3], reference[:3]))
    problems.append(mismatch("padding rows' weights", routing[3:], torch.zeros(2, TOP_K)))
    expect_all(problems)
    return f"NaN rows pick {ids[3:].tolist()}: distinct; real rows as the reference"
