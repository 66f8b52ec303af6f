"""Scenarios of moe_align_grid (vLLM #40131): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.oracle import Guarded, close, expect_all, mismatch
from harness.record import Context
from harness.runner.lora import moe_config
from harness.runner.poison import poisoned_allocations
from kernels.fused_moe_lora import fused_moe_lora_shrink, fused_moe_lora_shrink_reference
from kernels.moe_lora_align import (
    align_sizes,
    canonical_sorted_ids,
    moe_lora_align_block_size,
    moe_lora_align_reference,
    processed_lora_ids,
)

SENTINELS = (-2, -7, -13)  # prefill of sorted_token_ids, expert_ids, num_tokens_post_pad
NUM_EXPERTS, BLOCK_SIZE, TOP_K = 8, 16, 2
SMALL_TOKENS, LARGE_TOKENS = 7, 613  # numel 14 (small-batch kernel), 1226 (align + sort)
# NOTE: rank * hidden * 4 bytes = 2**17 per expert, so a poisoned expert id (INT32_MAX) puts the
# weight pointer ~2**48 bytes away: past every mapping on the GPU, non-canonical on the host.
RANK, HIDDEN = 16, 2048


@dataclass(frozen=True, slots=True)
class Batch:
    """Inputs of one align call."""

    topk_ids: torch.Tensor  # [num_tokens, TOP_K]
    token_lora_mapping: torch.Tensor  # [num_tokens]
    lora_ids: torch.Tensor  # [max_loras + 1]
    adapter_enabled: torch.Tensor  # [>= max_loras + 1]
    max_loras: int
    num_experts: int = NUM_EXPERTS

    @property
    def sizes(self) -> tuple[int, int]:
        return align_sizes(self.topk_ids.numel(), self.num_experts, BLOCK_SIZE)


def make_batch(
    ctx: Context,
    num_tokens: int,
    lora_ids: list[int],
    max_loras: int,
    adapter_enabled: torch.Tensor | None = None,
    num_experts: int = NUM_EXPERTS,
    top_k: int = TOP_K,
) -> Batch:
    """Seeded batch whose tokens cover every id of `lora_ids` (-1 = base model); with the
    default sizes a token may pick an expert twice, otherwise (upstream's test) never."""
    gen = torch.Generator().manual_seed(ctx.seed)
    if (num_experts, top_k) == (NUM_EXPERTS, TOP_K):
        topk = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    else:
        picks = [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
        topk = torch.stack(picks).to(torch.int32)
    owners = torch.tensor(lora_ids, dtype=torch.int32)
    mapping = owners[torch.randint(0, len(lora_ids), (num_tokens,), generator=gen)]
    mapping[: len(lora_ids)] = owners
    if adapter_enabled is None:
        adapter_enabled = torch.ones(max_loras + 1, dtype=torch.int32)
    dev = ctx.device
    return Batch(
        topk.to(dev),
        mapping.to(dev),
        owners.to(dev),
        adapter_enabled.to(dev),
        max_loras,
        num_experts,
    )


def sentinel_outputs(batch: Batch, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    padded, m_blocks = batch.sizes
    shapes = ((batch.max_loras, padded), (batch.max_loras, m_blocks), (batch.max_loras,))
    return tuple(
        torch.full(s, v, dtype=torch.int32, device=device)
        for s, v in zip(shapes, SENTINELS, strict=True)
    )


def run_align(ctx: Context, batch: Batch, outputs, twin: bool = False, **workspaces) -> None:
    """The align kernels under test: the GPU runs the CUDA C++ kernels of csrc/, the CPU their
    Triton twin (interpreter), as does `twin` on every device (the runner's switches)."""
    moe = moe_config(ctx.fixes, ctx.device, twin=twin)
    moe_lora_align_block_size(
        batch.topk_ids,
        batch.token_lora_mapping,
        batch.lora_ids,
        batch.adapter_enabled,
        *outputs,
        num_experts=batch.num_experts,
        block_size=BLOCK_SIZE,
        max_loras=batch.max_loras,
        fixes=moe.fixes,
        backend=moe.backend,
        **workspaces,
    )


def align_problems(label: str, batch: Batch, outputs, prefill) -> list[str | None]:
    """Compare all three outputs with the reference (expert segments order-free)."""
    expected = moe_lora_align_reference(
        batch.topk_ids,
        batch.token_lora_mapping,
        batch.lora_ids,
        batch.adapter_enabled,
        prefill,
        num_experts=batch.num_experts,
        block_size=BLOCK_SIZE,
        max_loras=batch.max_loras,
    )
    rows = processed_lora_ids(batch.lora_ids.cpu(), batch.adapter_enabled.cpu(), batch.max_loras)
    sorted_ids = canonical_sorted_ids(outputs[0], outputs[1], rows, BLOCK_SIZE)
    return [
        mismatch(f"{label} sorted_token_ids", sorted_ids, expected[0]),
        mismatch(f"{label} expert_ids", outputs[1], expected[1]),
        mismatch(f"{label} num_tokens_post_pad", outputs[2], expected[2]),
    ]


def last_slot_rows(ctx: Context, twin: bool = False) -> str:
    """Mixed base + LoRA batch, max_loras = active LoRA count (1 and 2), both kernel paths.

    Outputs are prefilled with sentinels (-2, -7, -13). Fixed: every active LoRA's rows equal the
    reference (padded counts block-aligned, every pair in a block routed to its expert).
    Buggy (grid of max_loras slots): the last LoRA's rows keep their sentinels: wrong result.
    """
    problems = []
    for max_loras in (1, 2):
        for path, num_tokens in (("small", SMALL_TOKENS), ("large", LARGE_TOKENS)):
            batch = make_batch(ctx, num_tokens, [-1, *range(max_loras)], max_loras)
            outputs = sentinel_outputs(batch, ctx.device)
            prefill = tuple(t.clone() for t in outputs)
            run_align(ctx, batch, outputs, twin)
            label = f"max_loras={max_loras} {path} path:"
            problems += align_problems(label, batch, outputs, prefill)
    expect_all(problems)
    return "4 batches (max_loras 1 and 2, small and large path): every LoRA row matches"


def upstream_sizes(ctx: Context) -> str:
    """The align kernels at upstream's test sizes: 100 tokens, top-k 6 (distinct experts per
    token), 64 experts (the small path's largest expert count), block size 16; max_loras 2 and
    32, every slot active, with the base model's -1 among the ids (upstream's own test maps
    every token to a real id, so a grid one short drops nothing there).

    Sentinel-prefilled outputs vs the reference. Fixed: every row matches. Buggy: the last
    LoRA's rows keep their sentinels: wrong result, at 64 experts as at 8.
    """
    problems = []
    for max_loras in (2, 32):
        ids = [-1, *range(max_loras)]
        batch = make_batch(ctx, 100, ids, max_loras, num_experts=64, top_k=6)
        outputs = sentinel_outputs(batch, ctx.device)
        prefill = tuple(t.clone() for t in outputs)
        run_align(ctx, batch, outputs)
        problems += align_problems(
            f"max_loras={max_loras}, 600 pairs, 64 experts:", batch, outputs, prefill
        )
    expect_all(problems)
    return "600 pairs over 64 experts, max_loras 2 and 32: every LoRA row matches"


def consumer_poisoned(ctx: Context) -> str:
    """End to end: align outputs allocated uninitialized (poisoned), then the fused consumer.

    Fixed: the MoE-LoRA shrink equals the dense float64 reference exactly (small-integer data).
    Buggy: the last LoRA's num_tokens_post_pad and expert_ids are poison (INT32_MAX), so the
    consumer loads weights from a wild address: illegal address on the GPU; on the CPU the
    interpreter's wild read kills the child with SIGSEGV.
    """
    max_loras = 2
    batch = make_batch(ctx, SMALL_TOKENS, [-1, 0, 1], max_loras)
    padded, m_blocks = batch.sizes
    gen = torch.Generator().manual_seed(ctx.seed + 1)
    x = torch.randint(-2, 3, (SMALL_TOKENS, HIDDEN), generator=gen).float().to(ctx.device)
    lora_a = torch.randint(-2, 3, (max_loras, NUM_EXPERTS, RANK, HIDDEN), generator=gen)
    lora_a = lora_a.float().to(ctx.device)
    with poisoned_allocations():
        outputs = (
            torch.empty(max_loras, padded, dtype=torch.int32, device=ctx.device),
            torch.empty(max_loras, m_blocks, dtype=torch.int32, device=ctx.device),
            torch.empty(max_loras, dtype=torch.int32, device=ctx.device),
        )
    run_align(ctx, batch, outputs)
    out = torch.full((SMALL_TOKENS * TOP_K, RANK), -7.0, device=ctx.device)
    prefill = out.clone()
    fused_moe_lora_shrink(
        x,
        lora_a,
        *outputs,
        batch.lora_ids,
        batch.adapter_enabled,
        out,
        top_k=TOP_K,
        block_size=BLOCK_SIZE,
    )
    expected = fused_moe_lora_shrink_reference(
        x, lora_a, batch.topk_ids, batch.token_lora_mapping, batch.adapter_enabled, prefill
    )
    expect_all([mismatch("fused MoE-LoRA shrink output", out.double(), expected)])
    return f"shrink of {SMALL_TOKENS * TOP_K} pairs equals the dense reference"


def oob_lora_id(ctx: Context, twin: bool = False) -> str:
    """Forged LoRA ids at and past the limit: lora_ids = [0, 1] and [0, 5] with max_loras = 1,
    on both kernel paths.

    Every buffer the kernels touch sits in front of canary rows that do not look like valid
    data: adapter_enabled reads 1 there, and the token-mask canary reads "every pair is this
    slot's", so a kernel that reads a forged id's rows acts on them. Fixed: the guard skips the
    forged slot in all three kernels, lora 0's rows match, every canary is intact. Without the
    guard (and with the grid fix, which launches the stray slot): the forged rows land on the
    canaries.
    """
    max_loras, rows = 1, 8
    enabled = torch.ones(rows, dtype=torch.int32)
    problems = []
    for forged in (max_loras, 5):
        for path, num_tokens in (("small", SMALL_TOKENS), ("large", LARGE_TOKENS)):
            label = f"forged id {forged}, {path} path:"
            batch = make_batch(ctx, num_tokens, [0, forged], max_loras, adapter_enabled=enabled)
            problems += _forged_rows(ctx, batch, rows, label, twin)
    expect_all(problems)
    return "ids 1 and 5 skipped on both paths; lora 0 rows match; canaries intact"


def _forged_rows(ctx: Context, batch: Batch, rows: int, label: str, twin: bool) -> list[str | None]:
    padded, m_blocks = batch.sizes
    numel, dev = batch.topk_ids.numel(), ctx.device
    guarded = {
        "sorted_token_ids": Guarded.make(1, (padded,), rows - 1, -2, -2, torch.int32, dev),
        "expert_ids": Guarded.make(1, (m_blocks,), rows - 1, -7, -7, torch.int32, dev),
        "num_tokens_post_pad": Guarded.make(1, (), rows - 1, -13, -13, torch.int32, dev),
        "token_mask": Guarded.make(1, (numel,), rows - 1, 0, 1, torch.int32, dev),
        "cumsum": Guarded.make(1, (NUM_EXPERTS + 1,), rows - 1, 0, 0, torch.int32, dev),
    }
    outputs = tuple(guarded[name].view for name in list(guarded)[:3])
    prefill = tuple(t.clone() for t in outputs)
    workspaces = {"token_mask": guarded["token_mask"].view, "cumsum": guarded["cumsum"].view}
    run_align(ctx, batch, outputs, twin, **workspaces)
    problems = align_problems(label, batch, outputs, prefill)
    return problems + [g.trampled(f"{label} {name}") for name, g in guarded.items()]


def disabled_adapter(ctx: Context, twin: bool = False) -> str:
    """A disabled adapter on the large path (numel 1226 >= 1024), token mask poisoned, and on
    the small path.

    lora_ids = [-1, 0, 1], lora 0 disabled. The align kernel skips the disabled slot, so its
    token-mask row is never written (poison, read as true). Fixed: lora 0's rows keep their
    sentinels, lora 1's match. Without the sort kernel's adapter check the disabled slot's rows
    are written; without the grid fix lora 1's rows are missing: wrong result either way. The
    small path's own adapter check is not a fix part of this bug: a regression of it is caught
    here too.
    """
    max_loras = 2
    enabled = torch.tensor([0, 1, 1], dtype=torch.int32)
    problems = []
    for path, num_tokens in (("large", LARGE_TOKENS), ("small", SMALL_TOKENS)):
        batch = make_batch(ctx, num_tokens, [-1, 0, 1], max_loras, adapter_enabled=enabled)
        outputs = sentinel_outputs(batch, ctx.device)
        prefill = tuple(t.clone() for t in outputs)
        with poisoned_allocations():  # the launcher's token_mask workspace is torch.empty
            run_align(ctx, batch, outputs, twin)
        problems += align_problems(f"{path} path, lora 0 disabled:", batch, outputs, prefill)
    expect_all(problems)
    return "disabled lora 0 rows untouched; lora 1 rows match (both paths)"


def triton_twin(ctx: Context) -> str:
    """last_slot_rows, oob_lora_id and disabled_adapter on the Triton twin of the align
    kernels, whatever the device. On the GPU every other kernel-level scenario runs the CUDA
    C++ kernels, yet the twin is code under test there too (the kernel an engine without csrc/
    runs; the marker suite tests it on the GPU): a regression of the twin flips this scenario
    on both devices. On the CPU it repeats what the three run already."""
    for scenario in (last_slot_rows, oob_lora_id, disabled_adapter):
        scenario(ctx, twin=True)
    return "the Triton twin: every LoRA row matches, forged ids skipped, disabled rows untouched"


def runner_mixed_batch(ctx: Context) -> str:
    """Through the miniature runner: its MoE layer's expert LoRA aligns with the kernels under
    test (CUDA C++ on the GPU, the Triton twin on the CPU) into buffers allocated empty, as
    upstream's punica wrapper does. Two adapters loaded (max_loras = 2 = the active count), one
    mixed batch of base-model and both adapters' requests.

    Fixed: hidden states and logits equal the dense float64 reference (to float32 rounding).
    Buggy: the align grid stops one slot short, the last adapter's rows stay poison, and the
    fused shrink loads expert weights from a wild address: illegal address on the GPU; on the
    CPU the interpreter's wild read kills the child with SIGSEGV.
    """
    # NOTE: imported here, not above: the kernel-level scenarios must stay testable (and
    # bisectable) when a part of the runner they do not use is broken.
    from harness.reference import step_reference
    from harness.runner.cudagraph import CUDAGraphMode
    from harness.runner.input_batch import Request
    from harness.runner.model_runner import ModelRunner, runner_config

    runner = ModelRunner(
        runner_config(ctx.device, ctx.fixes, dtype=ctx.dtype, cudagraph_mode=CUDAGraphMode.NONE)
    )
    runner.add_lora(1, seed=ctx.seed + 11)
    runner.add_lora(2, seed=ctx.seed + 12)
    requests = [Request("a", (2, 4, 6), 0), Request("b", (8, 9), 1), Request("c", (10, 12, 14), 2)]
    out = runner.execute_model(requests)
    hidden, logits = step_reference(runner, requests)
    expect_all(
        [
            close("runner hidden states vs reference", out.hidden_states, hidden),
            close("runner logits vs reference", out.logits, logits),
        ]
    )
    return f"mixed batch of {len(requests)} requests (base, adapter 1, adapter 2) as reference"


def runner_adapter_states(ctx: Context) -> str:
    """Through the runner, eagerly, max_loras = 3 = the active count, adapters in every state:
    1 and 3 enabled, 2 loaded without expert weights (adapter_enabled 0: the align kernels
    skip it and the consumer must too), base-model requests; then adapter 1 evicted and 4
    loaded into its slot, and a second batch of other lengths (moe_lora_consumer_grid runs
    the same batches from FULL graphs).

    Each batch vs the dense float64 reference. Fixed: all match. Buggy: the align grid stops
    one slot short, adapter 3's rows stay poison and the fused shrink loads expert weights
    from a wild address: illegal address (CPU: the interpreter's wild read, SIGSEGV).
    """
    from repro.bugs.moe_lora_consumer_grid.scenarios import adapter_states_batches

    return adapter_states_batches(ctx, "NONE")
