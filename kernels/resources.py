"""Every Triton kernel compiled ahead of time for a GPU target, without a GPU, at the largest and
boundary shapes of its dispatch domain: a launch that would not compile, or that needs more
shared memory than the target has, fails here (in the CPU CI), not at run time on a GPU.

Triton's compiler runs on any machine: the launchers are called with CPU tensors of the right
dtypes and shapes while `KernelInterface.__getitem__` records each launch instead of running
it; each recorded launch is compiled with `triton.compile` for the target and its
`metadata.shared` compared with the target's limit. Run it without TRITON_INTERPRET (the
kernels must be JIT functions, not the interpreter's):

    python -m kernels.resources [--arch 90]     # a line per launch; exit 1 on a violation
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch

# the opt-in shared memory per block of each target (bytes)
SHARED_LIMIT = {90: 232448, 80: 166912}
DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[tuple[object, tuple, dict]]]:
    """Inside: `kernel[grid](*args, **kwargs)` records (kernel, args, kwargs), runs nothing."""
    from triton.runtime.jit import KernelInterface

    launches: list[tuple[object, tuple, dict]] = []
    original = KernelInterface.__getitem__
    KernelInterface.__getitem__ = lambda self, grid: (
        lambda *args, **kwargs: launches.append((self, args, kwargs))
    )
    try:
        yield launches
    finally:
        KernelInterface.__getitem__ = original


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_launch(kernel, args: tuple, kwargs: dict, arch: int):
    """The compiled kernel of one recorded launch, for sm_`arch`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bound = dict(zip(kernel.arg_names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in kernel.arg_names})
    signature, constexprs = {}, {}
    for i, param in enumerate(kernel.params):
        value = bound.get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", value
        else:
            signature[param.name] = _arg_type(value)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _empty(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def _i32(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.int32)


def _align(num_tokens: int, top_k: int, num_experts: int, max_loras: int) -> None:
    from kernels.moe_lora_align import align_sizes, moe_lora_align_block_size

    padded, m_blocks = align_sizes(num_tokens * top_k, num_experts, 16)
    moe_lora_align_block_size(
        _i32(num_tokens, top_k),
        _i32(num_tokens),
        _i32(max_loras + 1),
        _i32(max_loras + 1),
        _i32(max_loras, padded),
        _i32(max_loras, m_blocks),
        _i32(max_loras),
        num_experts=num_experts,
        block_size=16,
        max_loras=max_loras,
    )


def _fused_moe_lora(
    hidden: int, rank: int, block_size: int, dtype: torch.dtype = torch.float32
) -> None:
    from kernels.fused_moe_lora import fused_moe_lora_expand, fused_moe_lora_shrink
    from kernels.moe_lora_align import align_sizes

    num_tokens, top_k, experts, max_loras = 256, 6, 64, 32
    padded, m_blocks = align_sizes(num_tokens * top_k, experts, block_size)
    align = (
        _i32(max_loras, padded),
        _i32(max_loras, m_blocks),
        _i32(max_loras),
        _i32(max_loras + 1),
        _i32(max_loras + 1),
    )
    shrunk = _empty(num_tokens * top_k, rank, dtype=dtype)  # upstream's: the output's dtype
    fused_moe_lora_shrink(
        _empty(num_tokens, hidden, dtype=dtype),
        _empty(max_loras, experts, rank, hidden, dtype=dtype),
        *align,
        shrunk,
        top_k=top_k,
        block_size=block_size,
    )
    fused_moe_lora_expand(
        shrunk,
        _empty(max_loras, experts, hidden, rank, dtype=dtype),
        *align,
        _empty(num_tokens * top_k, hidden, dtype=dtype),
        scale=1.0,
        block_size=block_size,
    )


def _lora(hidden: int, rank: int, dtype: torch.dtype = torch.float32) -> None:
    from kernels.lora_ops import KernelMeta, lora_expand, lora_shrink

    num_tokens, max_loras, slices = 512, 32, 2
    meta = KernelMeta(
        _i32(num_tokens),
        _i32(num_tokens),
        _i32(max_loras + 1),
        _i32(max_loras + 1),
        _i32(max_loras + 2),
        torch.tensor([False]),
        torch.tensor([max_loras], dtype=torch.int32),
    )
    buffer = _empty(slices, num_tokens, rank)  # float32, as upstream's
    lora_a = _empty(slices, max_loras, rank, hidden, dtype=dtype)
    lora_shrink(_empty(num_tokens, hidden, dtype=dtype), lora_a, buffer, meta, 1.0)
    lora_b = _empty(slices, max_loras, hidden, rank, dtype=dtype)
    lora_expand(buffer, lora_b, _empty(num_tokens, slices * hidden, dtype=dtype), meta)


def _attention(
    heads: int,
    head_dim: int,
    max_model_len: int,
    num_parts: int,
    dtype: torch.dtype = torch.float32,
    fp8_cache: bool = False,
    kv_heads: int | None = None,
    page_loads: bool = False,  # the hybrid runner's kernels: page-loading decode, block zeroing
) -> None:
    from kernels.paged_attention import (
        FP8_KV_CACHE,
        paged_attention,
        reshape_and_cache,
        zero_kv_blocks,
    )
    from kernels.split_kv_attention import combine_splits, plan_schedule, split_kv_attention

    num_tokens, num_reqs, block_size, blocks = 256, 64, 16, 64  # (the cache's length: no shape)
    q = _empty(num_tokens, heads, head_dim, dtype=dtype)
    cache_dtype = FP8_KV_CACHE if fp8_cache else dtype
    kv_heads = kv_heads or heads
    k_cache = _empty(blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    scales = dict(k_scale=_empty(1), v_scale=_empty(1)) if fp8_cache else {}
    table = _i32(num_reqs, max_model_len // block_size)
    slots = torch.empty(num_tokens, dtype=torch.int64)
    kv = q[:, :kv_heads].contiguous()
    reshape_and_cache(kv, kv, k_cache, k_cache, slots, **scales)
    positions = torch.empty(num_tokens, dtype=torch.int64)
    out = _empty(num_tokens, heads, head_dim, dtype=dtype)
    paged_attention(
        q, k_cache, k_cache, table, _i32(num_tokens), positions, out, 1.0, max_model_len, **scales
    )
    meta, decode_q = _i32(num_parts, 4), _empty(num_reqs, heads, head_dim, dtype=dtype)
    plan_schedule(_i32(num_reqs), meta, _i32(num_reqs))
    partial_out = _empty(num_parts, num_reqs, heads, head_dim)
    partial_lse = _empty(num_parts, num_reqs, heads)
    split_kv_attention(
        decode_q,
        k_cache,
        k_cache,
        table,
        _i32(num_reqs),
        meta,
        partial_out,
        partial_lse,
        1.0,
        max_model_len,
        **scales,
        page_loads=page_loads,
    )
    if page_loads:
        zero_kv_blocks(k_cache, torch.empty(blocks, dtype=torch.int64))
    combine_splits(partial_out, partial_lse, meta, _empty(num_reqs, heads, head_dim, dtype=dtype))


def _block_tables(num_reqs: int, max_num_blocks: int, max_query_len: int) -> None:
    from kernels.block_table import compute_slot_mappings, gather_block_tables

    i64 = lambda *s: torch.empty(*s, dtype=torch.int64)
    groups = 2
    gather_block_tables(
        _i32(num_reqs),
        i64(groups),
        i64(groups),
        i64(groups),
        _i32(groups, num_reqs),
        max_num_blocks,
    )
    compute_slot_mappings(
        _i32(num_reqs + 1),
        i64(num_reqs * max_query_len),
        i64(groups),
        i64(groups),
        _i32(groups),
        i64(groups, num_reqs * max_query_len),
        max_query_len,
    )


def _moe_gate(num_tokens: int, experts: int, top_k: int, hidden: int, dtype=torch.float32):
    """The learned gate's top-k (padding marked) and the expert-sorted MoE that consumes it."""
    from kernels.moe_permute import moe_finalize, moe_permute_experts
    from kernels.topk_gate import topk_gate

    ids, weights = _i32(num_tokens, top_k), _empty(num_tokens, top_k)
    topk_gate(_empty(num_tokens, experts, dtype=dtype), ids, weights, _i32(1))
    rows, permuted = _i32(num_tokens * top_k), _empty(num_tokens * top_k, hidden, dtype=dtype)
    moe_permute_experts(
        _empty(num_tokens, hidden, dtype=dtype),
        _empty(experts, hidden, hidden, dtype=dtype),
        ids,
        permuted,
        rows,
    )
    moe_finalize(permuted, rows, ids, weights, _empty(num_tokens, hidden, dtype=dtype), experts)


def _ep(hidden: int, ep: int, experts_per_rank: int, rows: int) -> None:
    """The expert-parallel dispatch into peers' receive rows, and the experts on them."""
    from kernels.ep_dispatch import ep_dispatch, ep_expert_combine

    table = torch.empty(ep, dtype=torch.int64)
    x, experts = _empty(rows, hidden), _i32(rows)
    ep_dispatch(x, experts, _i32(1), table, table, rows, 0, experts_per_rank)
    weights = _empty(experts_per_rank, hidden, hidden)
    ep_expert_combine(weights, table, table, table, rows, 0)


def _custom_allreduce(world: int, numel: int, **switches: bool) -> None:
    """The custom all-reduce: every rank's input read through an address table, flags in the
    ranks' signal words (a round from the device's counter, or the host's argument)."""
    from kernels.custom_allreduce import custom_allreduce

    i64 = lambda *s: torch.empty(*s, dtype=torch.int64)
    custom_allreduce(i64(world), i64(world), _i32(1), _empty(numel), 7, world - 1, **switches)


def _causal_conv1d(num_seqs: int, dim: int, num_slots: int, own_block: bool = True) -> None:
    """A Mamba layer's causal conv over the batch's chunks, conv states in slots."""
    from kernels.causal_conv1d import STATE_LEN, WIDTH, causal_conv1d

    x, seqs = _empty(8 * num_seqs, dim), _i32(num_seqs)
    states = _empty(num_slots, dim, STATE_LEN)
    causal_conv1d(x, _empty(dim, WIDTH), states, _i32(num_seqs + 1), seqs, seqs, x, own_block)


def _grammar_bitmask(rows: int, vocab: int, dtype: torch.dtype = torch.float32) -> None:
    """A structured-output grammar's packed bitmask applied to the logits."""
    from kernels.grammar_bitmask import apply_token_bitmask, words_per_row

    apply_token_bitmask(_empty(rows, vocab, dtype=dtype), _i32(rows, words_per_row(vocab)))


# (label, launcher calls): the largest sizes of each domain and each path's boundaries
SHAPES: list[tuple[str, Callable[[], None]]] = [
    ("align small path, 1020 pairs, 64 experts, 32 loras", lambda: _align(170, 6, 64, 32)),
    ("align small path, upstream 600 pairs, 64 experts", lambda: _align(100, 6, 64, 2)),
    ("align large path, 1024 pairs, 65 experts", lambda: _align(256, 4, 65, 32)),
    ("align large path, 81920 tokens x 6, 512 experts", lambda: _align(81920, 6, 512, 32)),
    ("fused moe lora, hidden 4096, rank 64, block 64", lambda: _fused_moe_lora(4096, 64, 64)),
    ("fused moe lora, hidden 4096, rank 16, block 16", lambda: _fused_moe_lora(4096, 16, 16)),
    # ranks below tl.dot's 16: the rank's block padded to 16
    ("fused moe lora, hidden 4096, rank 8, block 64", lambda: _fused_moe_lora(4096, 8, 64)),
    ("fused moe lora, hidden 4096, rank 4, block 16", lambda: _fused_moe_lora(4096, 4, 16)),
    # upstream's dtypes: 16-bit tiles loaded, converted, multiplied in float32 (bf16 stands for
    # fp16 too: the same tile bytes; compiling both doubled the check's time for no new limit)
    (
        "fused moe lora, hidden 4096, rank 64, block 64, bf16",
        lambda: _fused_moe_lora(4096, 64, 64, torch.bfloat16),
    ),
    ("lora shrink/expand, hidden 4096, rank 64", lambda: _lora(4096, 64)),
    ("lora shrink/expand, hidden 4096, rank 8", lambda: _lora(4096, 8)),
    ("lora shrink/expand, hidden 4096, rank 64, bf16", lambda: _lora(4096, 64, torch.bfloat16)),
    ("attention, 8 heads x 128, 8192 tokens, 16 parts", lambda: _attention(8, 128, 8192, 16)),
    ("attention, 32 heads x 128, 32768 tokens, 64 parts", lambda: _attention(32, 128, 32768, 64)),
    # upstream's head sizes: 80 (and 96, 112: the same padded block of 128) and 192 get blocks
    # padded to a power of two (the cache write's width too)
    ("attention, 32 heads x 80, 8192 tokens, 16 parts", lambda: _attention(32, 80, 8192, 16)),
    ("attention, 64 heads x 192, 8192 tokens, 16 parts", lambda: _attention(64, 192, 8192, 16)),
    ("attention, 16 heads x 256, 32768 tokens, 64 parts", lambda: _attention(16, 256, 32768, 64)),
    (
        "attention, 32 heads x 128, 32768 tokens, 64 parts, bf16",
        lambda: _attention(32, 128, 32768, 64, torch.bfloat16),
    ),
    (
        "attention loading whole pages, and block zeroing, 32 heads x 128, 32768 tokens, bf16",
        lambda: _attention(32, 128, 32768, 64, torch.bfloat16, page_loads=True),
    ),
    # grouped KV heads and FlashMLA's part counts (no power of two: padded, masked): Llama-3-70B's
    # 64 heads on 8; upstream's MLA test, 128 heads on one latent head of 576, 66 parts
    (
        "attention, 64 heads on 8 KV heads x 128, 32768 tokens, 132 parts, bf16",
        lambda: _attention(64, 128, 32768, 132, torch.bfloat16, kv_heads=8),
    ),
    (
        "attention, 128 heads on 1 KV head x 576, 16384 tokens, 66 parts, bf16",
        lambda: _attention(128, 576, 16384, 66, torch.bfloat16, kv_heads=1),
    ),
    ("block tables, 1024 requests, 2048 blocks", lambda: _block_tables(1024, 2048, 512)),
    # the gate's top-k up to 64 experts (its picks are bits of an int64); the runner's shape
    ("moe gate, 8192 tokens, 64 experts, top-4, hidden 4096", lambda: _moe_gate(8192, 64, 4, 4096)),
    (
        "moe gate, 32 tokens, 8 experts, top-2, hidden 32, bf16",
        lambda: _moe_gate(32, 8, 2, 32, torch.bfloat16),
    ),
    # the expert-parallel layer's shape (ep_graph_bucket_local), and a wider one on 8 ranks
    ("ep dispatch and experts, hidden 16, 2 ranks x 2 experts", lambda: _ep(16, 2, 2, 8)),
    ("ep dispatch and experts, hidden 128, 8 ranks x 4 experts", lambda: _ep(128, 8, 4, 256)),
    # the runner's TP all-reduce (128 elements) and the kernel's largest world
    ("custom all-reduce, 2 ranks, 128 elements", lambda: _custom_allreduce(2, 128)),
    ("custom all-reduce, 2 ranks, the lagging rank", lambda: _custom_allreduce(2, 128, lag=True)),
    # the Mamba engine's conv (4 channels) and a model's width of channels, both short stores
    ("causal conv1d, 4 channels, 32 slots", lambda: _causal_conv1d(2, 4, 32)),
    (
        "causal conv1d, 8192 channels, 1024 slots, short store to the read slot",
        lambda: _causal_conv1d(256, 8192, 1024, own_block=False),
    ),
    (
        "custom all-reduce, 8 ranks, 4096 elements, host round",
        lambda: _custom_allreduce(8, 4096, device_round=False),
    ),
    # the grammar bitmask over a Llama-3 vocabulary (a last word partly past it), bf16 logits
    ("grammar bitmask, 256 rows, vocab 128256", lambda: _grammar_bitmask(256, 128256)),
    (
        "grammar bitmask, 8 rows, vocab 151669, bf16",
        lambda: _grammar_bitmask(8, 151669, torch.bfloat16),
    ),
]

# The fp8 (e4m3) KV cache: Triton has fp8e4nv from sm_89 on only; for sm_80 it refuses the type
# ("type fp8e4nv not supported in this architecture. The supported fp8 dtypes are ('fp8e4b15',
# 'fp8e5')"), so these launches are compiled for sm_90 and skipped for sm_80
FP8_SHAPES: list[tuple[str, Callable[[], None]]] = [
    (
        "attention, 32 heads x 128, 32768 tokens, 64 parts, bf16, fp8 cache",
        lambda: _attention(32, 128, 32768, 64, torch.bfloat16, fp8_cache=True),
    ),
]


def check(arch: int, out=sys.stdout) -> list[str]:
    """Compile every launch of every shape for sm_`arch`; the violations (empty: all fit)."""
    from kernels.paged_attention import FP8_MIN_ARCH

    limit, problems, shapes = SHARED_LIMIT[arch], [], SHAPES
    if arch >= FP8_MIN_ARCH:
        shapes = SHAPES + FP8_SHAPES
    else:
        print(f"fp8 cache: {len(FP8_SHAPES)} shapes skipped, no fp8e4nv before sm_89", file=out)
    for label, call in shapes:
        with recorded_launches() as launches:
            try:
                call()
            except Exception as error:  # a launcher's own refusal is a violation too
                problems.append(f"{label}: the launcher refused: {error}")
                continue
        for kernel, args, kwargs in launches:
            name, start = getattr(kernel, "__name__", str(kernel)), time.perf_counter()
            try:
                shared = compile_launch(kernel, args, kwargs, arch).metadata.shared
            except Exception as error:
                problems.append(f"{label}: {name} does not compile: {str(error)[:300]}")
                print(f"{label:66} {name:32} FAILS TO COMPILE", file=out)
                continue
            verdict = "ok" if shared <= limit else f"OVER the {limit} limit"
            seconds = time.perf_counter() - start
            print(
                f"{label:66} {name:32} {shared:7} B shared  {verdict}  ({seconds:.1f}s)", file=out
            )
            if shared > limit:
                problems.append(f"{label}: {name} needs {shared} bytes of shared memory")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernels.resources", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT))
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "unset TRITON_INTERPRET: the kernels must be compiled, not interpreted", file=sys.stderr
        )
        return 2
    problems = check(args.arch)
    for problem in problems:
        print(f"VIOLATION {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
