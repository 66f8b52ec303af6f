"""Scenarios of moe_lora_consumer_grid (vLLM #32277): each function's docstring is its report.

The record (fix parts, expected outcomes) is in the package; see its docstring. The kernel-level
scenarios feed the consumers the reference align outputs, so only the consumers are under test.
"""

from __future__ import annotations

import torch

from harness.oracle import Guarded, expect_all, mismatch
from harness.record import Context
from harness.runner.lora import moe_config
from kernels.fused_moe_lora import (
    ConsumerFixes,
    fused_moe_lora_expand,
    fused_moe_lora_expand_reference,
    fused_moe_lora_shrink,
    fused_moe_lora_shrink_reference,
)
from kernels.moe_lora_align import align_sizes, moe_lora_align_reference

NUM_EXPERTS, BLOCK_SIZE, TOP_K, RANK, HIDDEN, SCALE = 8, 16, 2, 16, 64, 2.0
NUM_TOKENS = 11
SHRINK_PREFILL, EXPAND_PREFILL = -7.0, -5.0  # sentinels: rows no program may write


def consumer_fixes(ctx: Context) -> ConsumerFixes:
    """The consumers' switches, as the runner sets them (harness.runner.lora.moe_config)."""
    return moe_config(ctx.fixes, ctx.device).consumer


def _ints(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=gen).float()


def _problem(ctx: Context, mapping: list[int], max_loras: int, enabled_rows: int):
    """Seeded routing, inputs and adapters; token 0 is always a base-model token."""
    gen = torch.Generator().manual_seed(ctx.seed)
    topk = torch.randint(0, NUM_EXPERTS, (NUM_TOKENS, TOP_K), generator=gen, dtype=torch.int32)
    owners = torch.tensor(mapping, dtype=torch.int32)
    x = _ints(gen, NUM_TOKENS, HIDDEN)
    lora_a = _ints(gen, max_loras, NUM_EXPERTS, RANK, HIDDEN)
    lora_b = _ints(gen, max_loras, NUM_EXPERTS, HIDDEN, RANK)
    enabled = torch.ones(enabled_rows, dtype=torch.int32)
    return topk, owners, x, lora_a, lora_b, enabled


def _aligned(topk, owners, lora_ids, enabled, max_loras, prefill):
    return moe_lora_align_reference(
        topk,
        owners,
        lora_ids,
        enabled,
        prefill,
        num_experts=NUM_EXPERTS,
        block_size=BLOCK_SIZE,
        max_loras=max_loras,
    )


def _consume(ctx, x, lora_a, lora_b, aligned, lora_ids, enabled, shrunk_in):
    """(shrink output, expand output) of the kernels under test, sentinel-prefilled; the expand
    runs on `shrunk_in` (the reference shrink), so each kernel is judged on its own."""
    dev, fixes = ctx.device, consumer_fixes(ctx)
    align = (*(t.to(dev) for t in aligned), lora_ids.to(dev), enabled.to(dev))
    shrunk = torch.full((NUM_TOKENS * TOP_K, RANK), SHRINK_PREFILL, device=dev)
    fused_moe_lora_shrink(
        x.to(dev), lora_a.to(dev), *align, shrunk, top_k=TOP_K, block_size=BLOCK_SIZE, fixes=fixes
    )
    expanded = torch.full((NUM_TOKENS * TOP_K, HIDDEN), EXPAND_PREFILL, device=dev)
    fused_moe_lora_expand(
        shrunk_in.float().to(dev),
        lora_b.to(dev),
        *align,
        expanded,
        scale=SCALE,
        block_size=BLOCK_SIZE,
        fixes=fixes,
    )
    return shrunk, expanded


def _outputs(label: str, outputs, references) -> list[str | None]:
    """Shrink and expand outputs vs their float64 references."""
    return [
        mismatch(f"{label} {what} output", got.double(), want)
        for what, got, want in zip(("shrink", "expand"), outputs, references, strict=True)
    ]


def _references(x, lora_a, lora_b, topk, owners, enabled):
    shrunk = fused_moe_lora_shrink_reference(
        x, lora_a, topk, owners, enabled, torch.full((NUM_TOKENS * TOP_K, RANK), SHRINK_PREFILL)
    )
    prefill = torch.full((NUM_TOKENS * TOP_K, HIDDEN), EXPAND_PREFILL)
    expanded = fused_moe_lora_expand_reference(
        shrunk, lora_b, topk, owners, enabled, prefill, SCALE
    )
    return shrunk, expanded


def last_slot_pairs(ctx: Context) -> str:
    """Shrink and expand on a mixed base + LoRA batch, max_loras = the active LoRA count (1, 2
    and 3; with 3, slot 1 disabled: adapter_enabled 0, its align rows stale but plausible:
    every pair, expert 0, all blocks), lora_ids = [-1, 0, ...]; align outputs from the
    reference, outputs prefilled with sentinels (-7, -5). A disabled slot's pairs keep them.

    Fixed: both outputs equal the dense float64 reference exactly (small-integer data). Buggy
    (max_loras programs on the LoRA axis): the last LoRA's program never runs, so its pairs
    keep the sentinels in the shrink output and in the expand output: wrong result.
    """
    problems = []
    for max_loras, disabled in ((1, None), (2, None), (3, 1)):
        mapping = [-1, *[(t % (max_loras + 1)) - 1 for t in range(1, NUM_TOKENS)]]
        topk, owners, x, lora_a, lora_b, enabled = _problem(ctx, mapping, max_loras, max_loras + 1)
        lora_ids = torch.tensor([-1, *range(max_loras)], dtype=torch.int32)
        padded, m_blocks = align_sizes(topk.numel(), NUM_EXPERTS, BLOCK_SIZE)
        prefill = (
            torch.full((max_loras, padded), -2, dtype=torch.int32),
            torch.full((max_loras, m_blocks), -3, dtype=torch.int32),
            torch.full((max_loras,), -4, dtype=torch.int32),
        )
        if disabled is not None:  # its align rows: stale but plausible (an earlier step's)
            enabled[disabled] = 0
            prefill[0][disabled] = torch.arange(padded) % topk.numel()
            prefill[1][disabled], prefill[2][disabled] = 0, padded
        aligned = _aligned(topk, owners, lora_ids, enabled, max_loras, prefill)
        shrunk_ref, expanded_ref = _references(x, lora_a, lora_b, topk, owners, enabled)
        shrunk, expanded = _consume(ctx, x, lora_a, lora_b, aligned, lora_ids, enabled, shrunk_ref)
        problems += _outputs(
            f"max_loras={max_loras}, lora_ids={lora_ids.tolist()}:",
            (shrunk, expanded),
            (shrunk_ref, expanded_ref),
        )
    expect_all(problems)
    return "max_loras 1, 2, 3 (one disabled): every pair shrunk and expanded as the reference"


def stray_lora_id(ctx: Context) -> str:
    """Stray LoRA ids at and past the limit: lora_ids = [0, 1] and [0, 5] with max_loras = 1.

    Every buffer the kernels index by LoRA id sits in front of canary rows that look like valid
    data: adapter_enabled reads 1, num_tokens_post_pad one block, expert_ids expert 0,
    sorted_token_ids pair 0 (a base-model token's pair, which no program may write), and the
    weights read ones. Fixed: the id bound returns, lora 0's pairs match, pair 0 keeps its
    sentinel in both outputs. Without the bound (and with the grid fix, which launches the
    stray slot): the stray program computes pair 0 from the canary rows: wrong result.
    """
    max_loras, rows = 1, 8
    mapping = [-1, *[(t % 2) - 1 for t in range(1, NUM_TOKENS)]]  # base and lora 0
    problems = []
    for stray in (max_loras, 5):
        topk, owners, x, lora_a, lora_b, enabled = _problem(ctx, mapping, max_loras, rows)
        lora_ids = torch.tensor([0, stray], dtype=torch.int32)
        padded, m_blocks = align_sizes(topk.numel(), NUM_EXPERTS, BLOCK_SIZE)
        guarded = (
            Guarded.make(1, (padded,), rows - 1, -2, 0, torch.int32, ctx.device),
            Guarded.make(1, (m_blocks,), rows - 1, -3, 0, torch.int32, ctx.device),
            Guarded.make(1, (), rows - 1, -4, BLOCK_SIZE, torch.int32, ctx.device),
        )
        aligned = _aligned(topk, owners, lora_ids, enabled, max_loras, [g.view for g in guarded])
        for g, a in zip(guarded, aligned, strict=True):
            g.view.copy_(a)
        weights = [_padded(w, rows, ctx.device) for w in (lora_a, lora_b)]
        shrunk_ref, expanded_ref = _references(x, lora_a, lora_b, topk, owners, enabled)
        views = [g.view for g in guarded]
        inputs = (x, weights[0].view, weights[1].view, views, lora_ids, enabled, shrunk_ref)
        shrunk, expanded = _consume(ctx, *inputs)
        problems += _outputs(f"stray id {stray}:", (shrunk, expanded), (shrunk_ref, expanded_ref))
    expect_all(problems)
    return "stray ids 1 and 5 skipped by both kernels; lora 0's pairs match; pair 0 untouched"


def _padded(weights: torch.Tensor, rows: int, device: str) -> Guarded:
    """`weights` [max_loras, ...] in front of canary rows of ones (rows in all), on `device`
    (NOTE: never copied there after: a copy of the view leaves the canaries behind)."""
    real = weights.shape[0]
    g = Guarded.make(real, weights.shape[1:], rows - real, 0.0, 1.0, torch.float32, device)
    g.view.copy_(weights)
    return g


def runner_mixed_batch(ctx: Context) -> str:
    """Through the miniature runner's MoE layer: two adapters loaded (max_loras = 2 = the
    active count), one mixed batch of base-model and both adapters' requests, run eagerly and
    replayed from a FULL graph.

    Each of eager and replay vs the dense float64 reference (hidden states of every token,
    logits of every request), and replay vs eager. Fixed: all match (to float32 rounding).
    Buggy: the fused shrink and expand never run the last adapter's program, so its tokens
    lack their expert LoRA delta: wrong result, eager and replayed.
    """
    from harness.oracle import step_problems
    from harness.reference import step_reference
    from harness.runner.cudagraph import CUDAGraphMode
    from harness.runner.input_batch import Request
    from harness.runner.model_runner import ModelRunner, runner_config

    config = runner_config(
        ctx.device, ctx.fixes, dtype=ctx.dtype, cudagraph_mode=CUDAGraphMode.FULL
    )
    runner = ModelRunner(config)
    runner.add_lora(1, seed=ctx.seed + 11)
    runner.add_lora(2, seed=ctx.seed + 12)
    runner.capture_model()
    requests = [Request("a", (2, 4, 6), 0), Request("b", (8, 9), 1), Request("c", (10, 12), 2)]
    out = runner.execute_model(requests)
    replay = type(out)(out.hidden_states.clone(), out.logits.clone(), None, out.desc)
    eager = runner.execute_model(requests, use_cudagraph=False)
    reference = step_reference(runner, requests)
    graph = f"FULL {replay.desc.num_tokens}" if replay.desc else "no graph"
    problems = step_problems(f"mixed batch ({graph})", eager, reference, replay)
    if replay.desc is None:
        problems.append("no captured graph served the batch: the replay went unchecked")
    expect_all(problems)
    return f"mixed batch of {len(requests)} requests (base, adapter 1, adapter 2), {graph}"


def runner_adapter_states(ctx: Context) -> str:
    """Through the runner's MoE layer, FULL graphs, max_loras = 3 = the active count, adapters
    in every state: 1 and 3 enabled, 2 loaded without expert weights (disabled for the
    experts: adapter_enabled 0, its align rows left unwritten), base-model requests (absent);
    a mixed batch; then adapter 1 evicted and 4 loaded into its slot, and a second batch of
    other lengths on the same graph.

    Each batch replayed and run eagerly, each vs the dense float64 reference, replay vs eager.
    Fixed: all match. Buggy: the consumer never runs the last slot's program (adapter 3): its
    tokens lack their expert delta: wrong result. A consumer that ignores adapter_enabled
    reads adapter 2's unwritten (poisoned) align rows: illegal address; one that ignores the
    eviction keeps adapter 1's weights: wrong result.
    """
    return adapter_states_batches(ctx, "FULL")


def adapter_states_batches(ctx: Context, mode: str) -> str:
    """The batches of runner_adapter_states under graph mode `mode` (a CUDAGraphMode name;
    the runner is imported here: kernel-level scenarios must not need it)."""
    from harness.oracle import step_problems
    from harness.reference import step_reference
    from harness.runner.cudagraph import CUDAGraphMode
    from harness.runner.input_batch import Request
    from harness.runner.model import ModelConfig
    from harness.runner.model_runner import ModelRunner, runner_config

    config = runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        model=ModelConfig(max_loras=3),
        cudagraph_mode=CUDAGraphMode[mode],
        cudagraph_sizes=(8, 16),
    )
    runner = ModelRunner(config)
    runner.add_lora(1, seed=ctx.seed + 11)
    runner.add_lora(2, seed=ctx.seed + 12, experts=False)
    runner.add_lora(3, seed=ctx.seed + 13)
    runner.capture_model()
    steps = (
        ("adapters 1, 2 (no experts), 3 and base", (2, 4, 6), 1, (8, 9), (10, 12)),
        ("adapter 1 evicted, 4 in its slot", (5,), 4, (7, 3, 1), (11, 13, 15, 2)),
    )
    problems, graphs = [], []
    for step, (label, base, first, second, third) in enumerate(steps):
        if step == 1:
            runner.remove_lora(1)
            runner.add_lora(4, seed=ctx.seed + 14)
        requests = [
            Request("a", base, 0),
            Request("b", second, first),
            Request("c", third, 2),
            Request("d", (9, 1, 6), 3),
        ]
        out = runner.execute_model(requests)
        replay = type(out)(out.hidden_states.clone(), out.logits.clone(), None, out.desc)
        eager = runner.execute_model(requests, use_cudagraph=False)
        graph = f"{mode} {replay.desc.num_tokens}" if replay.desc else "eager"
        graphs.append(graph)
        reference = step_reference(runner, requests)
        problems += step_problems(f"{label} ({graph})", eager, reference, replay)
        if mode != "NONE" and replay.desc is None:
            problems.append(f"{label}: no captured graph served the batch")
    expect_all(problems)
    return f"{len(steps)} batches ({', '.join(graphs)}): enabled, disabled, absent, evicted"
