"""The sentinel sweep: every "not a real row" value the runner writes, fed to every consumer
that reads it, and the guard that makes that consumer honour it.

A sentinel means "not real" to the component that wrote it and may mean something else to a
consumer another team owns (issue 23: -1 as a slot, an expert id, a LoRA slot, a placeholder
token; NaN or 0 in padding rows). Each Contract names the sentinel, its producer, one consumer,
the consumer's guard, and a probe: the consumer run on inputs that carry the sentinel, in
memory banded with other sentinels, so that reading a sentinel as data shows in the output
(a NaN, a changed band) or faults, the same way on the CPU and on the GPU. A probe returns the
contract's problems; none: honoured.

The guard is either text (edits that remove it; tests/test_sentinels.py applies them to a copy
of the tree and runs this module there: the contract must then be broken) or a registered
bug's fix part (the probe runs with the part off). `python -m repro.sentinels [NAME ...]
[--device cpu|cuda] [--without-part]` runs contracts in this process: exit 0 every contract
honoured, 1 one broken, 2 usage, 125 the sweep itself could not run.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from harness.fixes import ALL_FIXES, Fix

Problems = list[str | None]
BAND = float("nan")  # memory next to a consumer's inputs: read as data, it shows
UNWRITTEN = -12345.0  # output memory a consumer must leave alone


@dataclass(frozen=True, slots=True)
class Contract:
    name: str
    sentinel: str
    producer: str
    consumer: str
    guard: str  # what honours the sentinel, in words
    probe: Callable[[str, frozenset[Fix]], Problems]  # (device, fixes) -> problems
    edits: tuple[tuple[str, str, str], ...] = ()  # (file, old, new): the guard removed
    part: Fix | None = None  # or: the guard is this fix part (a registered bug's)
    bug: str | None = None  # the registered bug whose marker guards the contract


def _banded(values, band: float = BAND):
    """`values` as a view into storage that holds `band` on both sides, one copy of `values`'
    size each: an index one row (or one adapter) out of range reads the band."""
    import torch

    flat = values.reshape(-1)
    storage = torch.full((3 * flat.numel(),), band, dtype=values.dtype, device=values.device)
    storage[flat.numel() : 2 * flat.numel()].copy_(flat)
    return storage[flat.numel() : 2 * flat.numel()].view(values.shape)


def _cache_write_probe(device: str, fixes: frozenset[Fix]) -> Problems:
    """reshape_and_cache on slots [5, -1, 9, -1]: the two -1 tokens write nothing."""
    import torch

    from harness.oracle import mismatch
    from kernels.paged_attention import reshape_and_cache, reshape_and_cache_reference

    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(4, 2, 4, generator=gen) for _ in range(2))
    slots = torch.tensor([5, -1, 9, -1])
    caches = [torch.full((3, 4, 2, 4), UNWRITTEN) for _ in range(2)]
    want = [c.clone() for c in caches]
    reshape_and_cache_reference(key, value, *want, slots)
    got = [c.to(device) for c in caches]
    reshape_and_cache(key.to(device), value.to(device), *got, slots.to(device))
    return [mismatch(f"{n} cache", g, w) for n, g, w in zip("kv", got, want, strict=True)]


def _lora_probe(device: str, fixes: frozenset[Fix]) -> Problems:
    """Shrink, then expand, of tokens on slots [0, -1, 1, -1] (two base-model tokens): the
    base tokens' buffer rows stay unwritten and their outputs unchanged; the weights sit
    between NaN bands (a program of slot -1 reads the band)."""
    import torch

    from harness.oracle import close, mismatch
    from harness.runner.lora import LoRAKernelMeta
    from kernels.lora_ops import (
        lora_expand,
        lora_expand_reference,
        lora_shrink,
        lora_shrink_reference,
    )

    gen = torch.Generator().manual_seed(0)
    slots, hidden, rank, out_dim = [0, -1, 1, -1], 8, 4, 8
    meta = LoRAKernelMeta(len(slots), 2, device)
    meta.prepare_tensors(slots)
    x = torch.randn(len(slots), hidden, generator=gen)
    lora_a = torch.randn(1, 2, rank, hidden, generator=gen)
    lora_b = torch.randn(1, 2, out_dim, rank, generator=gen)
    y = torch.randn(len(slots), out_dim, generator=gen)
    buffer = torch.full((1, len(slots), rank), UNWRITTEN, device=device)
    lora_shrink(x.to(device), _banded(lora_a.to(device)), buffer, meta.kernel_meta(), 1.0)
    shrunk = lora_shrink_reference(x, lora_a, slots, 1.0)
    base = [t for t, s in enumerate(slots) if s == -1]
    real = [t for t, s in enumerate(slots) if s != -1]
    problems = [
        mismatch(
            "shrink: base tokens' buffer rows",
            buffer[:, base],
            torch.full_like(buffer[:, base], UNWRITTEN),
        ),
        close("shrink: LoRA tokens' buffer rows", buffer[:, real], shrunk[:, real]),
    ]
    out = y.clone().to(device)
    lora_expand(buffer, _banded(lora_b.to(device)), out, meta.kernel_meta())
    expanded = lora_expand_reference(y, buffer.cpu().double(), lora_b, slots)
    problems.append(mismatch("expand: base tokens' outputs", out[base], y[base]))
    problems.append(close("expand: LoRA tokens' outputs", out[real], expanded[real]))
    return problems


def _embedding_offset_probe(device: str, fixes: frozenset[Fix]) -> Problems:
    """The LoRA embedding's gather of base-model tokens (slot -1): their offsets keep the
    gather inside the stacked LoRA-A table."""
    import torch

    from harness.runner.lora import LoRAMapping, convert_mapping
    from harness.runner.model import _embed

    vocab, hidden, rank = 16, 4, 2
    mapping = LoRAMapping((0, 7, 7, 0), (7,))
    _, offsets, _ = convert_mapping(mapping, [None, 7], vocab)
    input_ids = torch.tensor([3, 0, 15, 15], device=device)
    weight = torch.randn(vocab, hidden, device=device)
    lora_a_2d = torch.randn(2 * vocab, rank, device=device)
    h = torch.empty(4, hidden, device=device)
    a_rows = torch.empty(1, 4, rank, device=device)
    problems = [None if min(offsets) >= 0 else f"negative embedding offsets {offsets}"]
    _embed(input_ids, torch.tensor(offsets, device=device), weight, lora_a_2d, h, a_rows)
    torch.cuda.synchronize() if device == "cuda" else None
    return problems


def _pad_slot_probe(device: str, fixes: frozenset[Fix]) -> Problems:
    """A step of 6 tokens, then a step of 2 tokens padded to 6 (a graph's size): the four
    padding tokens' slots are -1, not the 6-token step's slots left in the buffer."""
    from harness.runner.cudagraph import CUDAGraphMode
    from harness.runner.input_batch import Request
    from harness.runner.model_runner import ModelRunner, runner_config

    runner = ModelRunner(
        runner_config(
            device, fixes, enable_lora=False, cudagraph_mode=CUDAGraphMode.NONE, max_model_len=32
        )
    )
    first = [Request("a", (1, 2, 3, 4), 0), Request("b", (5, 6), 0)]
    runner.execute_model(first)
    later = [Request("a", (7,), 0, 4), Request("b", (8,), 0, 2)]
    batch = runner.input_buffers.prepare(later, 6, 2)
    slots = runner.kv_cache.metadata(batch).slot_mappings.cpu()
    pad = slots[:, 2:]
    stale = (pad != -1).nonzero().tolist()
    return [f"padding tokens' slots {pad.tolist()} (not -1 at {stale})" if stale else None]


def _cache_only_probe(device: str, fixes: frozenset[Fix]) -> Problems:
    """The cache-only layer's write of a step of 2 real tokens, one of them at the pool's last
    slot, then of a padded step (slots [2, -1]): the last slot keeps the real token's state.
    (One slot per write: duplicate indices in one torch write land in no defined order.)"""
    import torch

    from harness.oracle import mismatch
    from harness.runner.block_table import run_now
    from harness.runner.extract_hidden_states import CacheOnlyLayer
    from harness.runner.sleep_mode import make_pools

    layer = CacheOnlyLayer(2, 4, 8, torch.float32, make_pools(device), fixes)
    layer.kv_cache.fill_(UNWRITTEN)
    states = torch.arange(32, dtype=torch.float32, device=device).view(4, 8)
    layer.forward(states[:2], torch.tensor([7, 1], device=device), run_now)  # 7: the last slot
    layer.forward(states[2:], torch.tensor([2, -1], device=device), run_now)
    return [
        mismatch("the last slot (a real token's)", layer.extract([7]), states[:1]),
        mismatch("slot 2", layer.extract([2]), states[2:3]),
    ]


def _draft_tail_probe(device: str, fixes: frozenset[Fix]) -> Problems:
    """The draft prefill's last_token_indices after a step of 3 requests (10 tokens), then a
    step of 1 request (1 token) padded to 4 rows: every index the 4-row gather reads is a row
    of this step's hidden states."""
    import torch

    from harness.runner.block_table import run_now
    from harness.runner.input_batch import InputBuffers, Request
    from harness.runner.speculator import DraftPrefill

    buffers = InputBuffers(16, 4, device)
    draft = DraftPrefill(4, torch.ones(5, 8, device=device), device, fixes)
    large = [Request("a", (1, 2, 3, 4)), Request("b", (5, 6, 7)), Request("c", (8, 9, 10))]
    draft.prepare(buffers.prepare(large, 10, 3))
    draft.prepare(buffers.prepare([Request("a", (11,), 0, 4)], 4, 4))
    rows = draft.last_token_indices.cpu().tolist()
    problems = [None if max(rows) < 4 else f"the padded gather reads rows {rows} of 4"]
    draft.forward(torch.zeros(4, 8, device=device), 4, run_now)
    torch.cuda.synchronize() if device == "cuda" else None
    return problems


def _gate_nan_probe(device: str, fixes: frozenset[Fix]) -> Problems:
    """The learned gate's top-k of 2 real rows and 2 NaN rows (a PIECEWISE replay's padding
    rows): every row gets top_k distinct experts in range, as the expert sort assumes."""
    import torch

    from harness.runner.model import gate_clamps
    from kernels.topk_gate import topk_gate

    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(device)
    logits[2:] = float("nan")
    ids = torch.empty(4, 2, dtype=torch.int32, device=device)
    weights = torch.empty(4, 2, dtype=torch.float32, device=device)
    topk_gate(logits, ids, weights, clamp_nonfinite=gate_clamps(fixes))
    rows = ids.cpu().tolist()
    bad = [
        r
        for r, pair in enumerate(rows)
        if len(set(pair)) != 2 or not 0 <= min(pair) <= max(pair) < 8
    ]
    return [
        f"rows {bad} route to {[rows[r] for r in bad]}: not 2 distinct experts" if bad else None
    ]


def _finalize_padding_probe(device: str, fixes: frozenset[Fix]) -> Problems:
    """Top-k with 2 real tokens of 4 (rows 2, 3 get expert -1, weight 0), the expert sort (no
    row for -1: those pairs' entries of unpermuted_rows keep int32 max), then the finalize:
    the real tokens' outputs match the reference, the padding rows are 0."""
    import torch

    from harness.oracle import close
    from harness.runner.model import finalize_skips
    from kernels.moe_permute import moe_finalize, moe_permute_experts, moe_permute_reference
    from kernels.topk_gate import topk_gate

    gen = torch.Generator().manual_seed(0)
    h, experts = torch.randn(4, 16, generator=gen), torch.randn(8, 16, 16, generator=gen)
    logits = h @ torch.randn(8, 16, generator=gen).T
    ids = torch.empty(4, 2, dtype=torch.int32, device=device)
    weights = torch.empty(4, 2, dtype=torch.float32, device=device)
    real = torch.tensor([2], dtype=torch.int32, device=device)
    topk_gate(logits.to(device), ids, weights, real)
    permuted = torch.full((8, 16), UNWRITTEN, device=device)
    rows = torch.full((8,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=device)
    moe_permute_experts(h.to(device), experts.to(device), ids, permuted, rows)
    out = torch.full((4, 16), UNWRITTEN, device=device)
    moe_finalize(permuted, rows, ids, weights, out, 8, skip_invalid=finalize_skips(fixes))
    want = moe_permute_reference(h, experts, ids.cpu(), weights.cpu())
    return [close("the tokens' MoE outputs (padding rows 0)", out, want)]


def _placeholder_probe(device: str, fixes: frozenset[Fix]) -> Problems:
    """The worker's inputs for a request that decoded (its input the placeholder of the token
    the step before sampled), missed a step, and prefills its host tokens again: no -1 left."""
    import torch

    from harness.runner.async_inputs import PLACEHOLDER, LastStep, ScheduledRequest, TokenRows

    rows = TokenRows(fixes, device)
    rows.prepare([ScheduledRequest("r", 0, (3, 1, 2))], None)
    last = LastStep(
        torch.tensor([[7]], device=device), torch.zeros(1, dtype=torch.long, device=device)
    )
    rows.prepare([ScheduledRequest("r", 3, (PLACEHOLDER,))], last)
    rows.prepare([], None)
    requests, _ = rows.prepare([ScheduledRequest("r", 0, (3, 1, 2, 7, 9))], None)
    ids = list(requests[0].token_ids)
    return [
        f"a resumed request's input ids {ids} carry {PLACEHOLDER}" if PLACEHOLDER in ids else None
    ]


KV_CACHE, LORA_OPS, LORA = (
    "harness/runner/kv_cache.py",
    "kernels/lora_ops.py",
    "harness/runner/lora.py",
)
CONTRACTS = (
    Contract(
        "cache_write_skips_pad_slot",
        "slot -1 (padding token)",
        "KVCache.metadata (harness/runner/kv_cache.py): every padding token's slot",
        "reshape_and_cache (kernels/paged_attention.py)",
        "the store mask is empty for slot < 0",
        _cache_write_probe,
        edits=(
            (
                "kernels/paged_attention.py",
                "keep = cols[None, :] < tl.where(slot >= 0, WIDTH, 0)[:, None]",
                "keep = cols[None, :] < tl.where(ts < num_tokens, WIDTH, 0)[:, None]",
            ),
        ),
    ),
    Contract(
        "pad_tokens_get_slot_minus_one",
        "slot -1 (padding token)",
        "KVCache.metadata: fills the step's slot mappings with -1 before the real tokens' slots",
        "every KV write of the step (reshape_and_cache, a cache-only layer's write)",
        "the fill, each step: a smaller step after a larger one must not keep its slots",
        _pad_slot_probe,
        edits=(
            (KV_CACHE, "        run(torch.Tensor.fill_, tables.slot_mappings[:, :t], -1)\n", ""),
        ),
    ),
    Contract(
        "lora_kernels_skip_base_tokens",
        "LoRA slot -1 (base-model and padding tokens)",
        "convert_mapping (harness/runner/lora.py): id 0 -> slot -1; LoRAKernelMeta: -1 sorts first",
        "lora_shrink and lora_expand (kernels/lora_ops.py)",
        "a program of slot -1 has no valid rows and returns",
        _lora_probe,
        edits=(
            (LORA_OPS, "valid = offs < tl.where(lora_id == -1, 0, count)", "valid = offs < count"),
            (
                LORA_OPS,
                "    if lora_id == -1:\n        return\n    s = tl.program_id(1).to(tl.int64)\n"
                "    w = w_ptr + (s * max_loras + lora_id) * RANK * HIDDEN",
                "    s = tl.program_id(1).to(tl.int64)\n"
                "    w = w_ptr + (s * max_loras + lora_id) * RANK * HIDDEN",
            ),
            (
                LORA_OPS,
                "    if lora_id == -1:\n        return\n    s = tl.program_id(1).to(tl.int64)\n"
                "    w = w_ptr + (s * max_loras + lora_id) * width * RANK",
                "    s = tl.program_id(1).to(tl.int64)\n"
                "    w = w_ptr + (s * max_loras + lora_id) * width * RANK",
            ),
        ),
    ),
    Contract(
        "embedding_offset_of_no_lora",
        "LoRA slot -1 (base-model and padding tokens)",
        "convert_mapping (harness/runner/lora.py): the embedding offset of each token",
        "the LoRA embedding's gather (harness/runner/model.py _embed)",
        "slot -1 gets offset 0 (max(slot, 0) * vocab_size)",
        _embedding_offset_probe,
        edits=((LORA, "offsets = [max(s, 0) * vocab_size", "offsets = [s * vocab_size"),),
    ),
    Contract(
        "cache_only_write_skips_pad_slot",
        "slot -1 (padding token)",
        "KVCache.metadata (group 0's slot mapping)",
        "the cache-only layer's write (harness/runner/extract_hidden_states.py)",
        "the write goes through reshape_and_cache, which skips slot < 0 (not torch indexing)",
        _cache_only_probe,
        part=Fix.CACHE_ONLY_SKIP_PAD_SLOTS,
        bug="pad_slot_negative_index",
    ),
    Contract(
        "draft_gather_pads_its_tail",
        "padded last_token_indices (row 0)",
        "DraftPrefill.prepare (harness/runner/speculator.py): the entries past the live requests",
        "the draft prefill's gather of a padded (graph) batch",
        "the tail is written every step (0, a real row), not left from a larger step",
        _draft_tail_probe,
        part=Fix.SPEC_PAD_LAST_TOKEN_INDICES,
        bug="spec_stale_pad_tail",
    ),
    Contract(
        "gate_topk_clamps_nan_rows",
        "NaN padding rows (a PIECEWISE replay's attention output past the real tokens)",
        "the attention of a graph replay (harness/runner/model.py: num_actual_tokens)",
        "the learned gate's top-k (kernels/topk_gate.py)",
        "NaN/Inf probabilities clamp to 0 before the selection: distinct experts",
        _gate_nan_probe,
        part=Fix.MOE_GATE_NAN_CLAMP,
        bug="moe_pad_nan_topk",
    ),
    Contract(
        "finalize_skips_padding_experts",
        "expert -1, weight 0 (padding rows)",
        "the learned gate's top-k, past the step's real-token count (kernels/topk_gate.py)",
        "the MoE finalize (kernels/moe_permute.py), after a sort that gives -1 no row",
        "ids outside [0, num_experts) are skipped before the pair's row lookup",
        _finalize_padding_probe,
        part=Fix.MOE_PAD_SENTINEL_GUARD,
        bug="moe_pad_sentinel",
    ),
    Contract(
        "placeholder_filled_before_embedding",
        "token id -1 (a placeholder of a sampled token still on the device)",
        "TokenRows.prepare (harness/runner/async_inputs.py): the row of every sampled token",
        "the embedding's gather (harness/runner/model.py), through the step's input ids",
        "a request with no previous-step row takes the host's tokens",
        _placeholder_probe,
        part=Fix.ASYNC_PLACEHOLDER_HOST_FILL,
        bug="async_placeholder_leak",
    ),
)
NAMES = {c.name: c for c in CONTRACTS}


def run(contract: Contract, device: str, without_part: bool = False) -> Problems:
    """The contract's problems on `device` (its fix part off with `without_part`); a
    consumer that raises breaks it too."""
    fixes = ALL_FIXES - {contract.part} if without_part and contract.part else ALL_FIXES
    try:
        return [p for p in contract.probe(device, frozenset(fixes)) if p]
    except Exception as e:  # a fault or an index error is the consumer's answer
        return [f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.sentinels", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"contracts (default: all): {', '.join(NAMES)}")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--without-part", action="store_true", help="turn each contract's fix part off"
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in NAMES]
    if unknown:
        print(f"unknown contract {', '.join(unknown)}; known: {', '.join(NAMES)}", file=sys.stderr)
        return 2
    from harness import device as devices

    devices.activate(args.device)
    try:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            print("repro.sentinels: cannot test: no CUDA device", file=sys.stderr)
            return 125
        broken = 0
        for contract in [NAMES[n] for n in args.names] or CONTRACTS:
            problems = run(contract, args.device, args.without_part)
            broken += bool(problems)
            print(f"{contract.name}: {'BROKEN' if problems else 'honoured'}")
            for p in problems:
                print(f"  {p}")
        return 1 if broken else 0
    except Exception:  # the sweep itself failed: cannot test
        traceback.print_exc()
        return 125


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
