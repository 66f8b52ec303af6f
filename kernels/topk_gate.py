"""Softmax top-k routing of a learned MoE gate (vLLM's topk_softmax), with its pure-torch twin.

Per token row of gating logits [num_tokens, num_experts]: the softmax over the experts, then
top_k picks, each an argmax written as upstream's kernel writes it, an explicit compare loop:
expert 0 is the first candidate, a later expert replaces the candidate only when its probability
compares greater (ties go to the lowest index), and a picked expert is out (-inf) for the next
picks. Every step is an IEEE compare, select or arithmetic op, so the interpreter and a GPU
order NaN alike: a compare with NaN is false. No tl.max: its NaN handling differs between them
(the GPU's max returns the other operand); the row max is the same compare loop.

A row of NaN logits (a padding row of a graph replay: vLLM #39391, issues #39244, #37758) has
NaN probabilities: nothing compares greater than the first candidate, so every pick is expert 0,
and again expert 0 once it is out (NaN > -inf is false too): duplicate ids. The fix clamps NaN
and Inf probabilities to 0 before the selection; the ties then go to the lowest indices: expert
0, 1, ..., distinct.

Padding rows may also be marked (vLLM #46428, #48979: VLLM_MOE_SKIP_PADDING): given the number
of real tokens as a device scalar (a graph replay reads the live step's), rows at or past it get
expert -1 and weight 0, for consumers to skip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, require_dtype

BLOCK_T = 64
MAX_EXPERTS = 64  # the picked experts of a row are bits of one int64
PADDING_ID = -1  # the expert id of a padding row (vLLM #46428)


def topk_gate_reference(
    logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    num_actual_tokens: int | None = None,
    clamp_nonfinite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [num_tokens, top_k] int32, weights [num_tokens, top_k] float32): the kernel's
    compare loop in float32 torch ops, on the CPU."""
    x = logits.detach().float().cpu()
    rows, experts = x.shape
    m = x[:, 0].clone()
    for e in range(1, experts):
        m = torch.where(x[:, e] > m, x[:, e], m)
    s = torch.zeros(rows)
    for e in range(experts):
        s = s + torch.exp(x[:, e] - m)
    taken = torch.zeros(rows, experts, dtype=torch.bool)
    ids = torch.empty(rows, top_k, dtype=torch.int32)
    weights = torch.empty(rows, top_k)
    for k in range(top_k):
        best, pick = torch.full((rows,), float("-inf")), torch.zeros(rows, dtype=torch.int32)
        for e in range(experts):
            p = torch.exp(x[:, e] - m) / s
            if clamp_nonfinite:
                p = torch.where(p.abs() < float("inf"), p, 0.0)
            p = torch.where(taken[:, e], float("-inf"), p)
            better = (p > best) | (e == 0)
            best, pick = torch.where(better, p, best), torch.where(better, e, pick)
        taken[torch.arange(rows), pick.long()] = True
        ids[:, k], weights[:, k] = pick, best
    if num_actual_tokens is not None:
        ids[num_actual_tokens:], weights[num_actual_tokens:] = PADDING_ID, 0.0
    return ids, weights


def topk_gate(
    logits: torch.Tensor,  # [num_tokens, num_experts] FLOAT_DTYPES
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32, written
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32, written
    num_actual_tokens: torch.Tensor | None = None,  # [1] int32: later rows are padding
    *,
    clamp_nonfinite: bool = True,
) -> None:
    num_tokens, experts = logits.shape
    top_k = topk_ids.shape[1]
    require_dtype(FLOAT_DTYPES, logits=logits)
    require_dtype((torch.int32,), topk_ids=topk_ids)
    require_dtype((torch.float32,), topk_weights=topk_weights)
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k), (
        topk_ids.shape,
        topk_weights.shape,
        logits.shape,
    )
    assert logits.is_contiguous() and topk_ids.is_contiguous() and topk_weights.is_contiguous()
    if not 0 < top_k <= experts <= MAX_EXPERTS:
        raise ValueError(
            f"top_k = {top_k} of {experts} experts: this kernel serves 1 <= top_k <= experts "
            f"<= {MAX_EXPERTS}"
        )
    padded = num_actual_tokens is not None
    _topk_gate_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        logits,
        topk_ids,
        topk_weights,
        num_actual_tokens if padded else topk_ids,  # (not read without padding)
        num_tokens,
        NUM_EXPERTS=experts,
        TOP_K=top_k,
        HAS_PADDING=padded,
        CLAMP_NONFINITE=clamp_nonfinite,
        BLOCK_T=BLOCK_T,
    )


@triton.jit
def _logit(row_ptr, e, live):
    return tl.load(row_ptr + e, mask=live, other=0.0).to(tl.float32)


@triton.jit
def _topk_gate_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    num_actual_ptr,
    num_tokens,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    CLAMP_NONFINITE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < num_tokens
    row_ptr = logits_ptr + rows.to(tl.int64) * NUM_EXPERTS
    m = _logit(row_ptr, 0, live)
    for e in range(1, NUM_EXPERTS):
        v = _logit(row_ptr, e, live)
        m = tl.where(v > m, v, m)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    for e in range(0, NUM_EXPERTS):
        s += tl.exp(_logit(row_ptr, e, live) - m)
    taken = tl.zeros([BLOCK_T], dtype=tl.int64)  # bit e: expert e picked
    for k in tl.static_range(TOP_K):
        best = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
        pick = tl.zeros([BLOCK_T], dtype=tl.int32)
        for e in range(0, NUM_EXPERTS):
            p = tl.exp(_logit(row_ptr, e, live) - m) / s
            if CLAMP_NONFINITE:  # fix: moe_gate_nan_clamp -- NaN compares false: every pick is 0.
                p = tl.where(tl.abs(p) < float("inf"), p, 0.0)
            p = tl.where(((taken >> e) & 1) != 0, float("-inf"), p)  # picked already
            better = (p > best) | (e == 0)
            best = tl.where(better, p, best)
            pick = tl.where(better, e, pick)
        taken = taken | (tl.full([BLOCK_T], 1, dtype=tl.int64) << pick.to(tl.int64))
        weight = best
        if HAS_PADDING:
            padding = rows >= tl.load(num_actual_ptr)
            pick = tl.where(padding, -1, pick)
            weight = tl.where(padding, 0.0, weight)
        tl.store(ids_ptr + rows * TOP_K + k, pick, mask=live)
        tl.store(weights_ptr + rows * TOP_K + k, weight, mask=live)
