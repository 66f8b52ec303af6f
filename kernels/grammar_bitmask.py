"""A structured-output grammar's bitmask applied to logits (xgrammar's apply_token_bitmask_inplace;
Model Runner V2's Triton twin, vLLM #32102), with its pure-torch twin.

The bitmask is packed: row r holds ceil(vocab / 32) int32 words, token t allowed when bit t % 32
of word t // 32 is set. Row r of the mask is applied to row r of the logits: every forbidden
token's logit is stored as -inf, an allowed one is never written (a row of all ones, -1 in every
word, leaves its logits row untouched). A row of all zeros forbids every token: its logits are
all -inf, its softmax NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, require_dtype

BLOCK_V = 64  # tokens per program
NEUTRAL = -1  # an int32 word with every bit set: every token of its 32 allowed


def words_per_row(vocab_size: int) -> int:
    return triton.cdiv(vocab_size, 32)


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    vocab_size,
    logits_stride,
    bitmask_stride,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = offs < vocab_size
    words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=inside, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    ptr = logits_ptr + row * logits_stride + offs
    x = tl.load(ptr, mask=inside, other=0.0)
    tl.store(ptr, tl.full(x.shape, float("-inf"), x.dtype), mask=inside & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits [rows, vocab] (rows contiguous) masked by bitmask [rows, words] int32."""
    require_dtype(FLOAT_DTYPES, logits=logits)
    rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or tuple(bitmask.shape) != (rows, words_per_row(vocab)):
        raise ValueError(
            f"bitmask {tuple(bitmask.shape)} {bitmask.dtype}: needs ({rows}, "
            f"{words_per_row(vocab)}) int32 for logits {tuple(logits.shape)}"
        )
    if rows == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    grid = (rows, triton.cdiv(vocab, BLOCK_V))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK_V=BLOCK_V
    )


def pack_allowed(allowed: list[list[int]], vocab_size: int) -> torch.Tensor:
    """[len(allowed), words] int32 on the CPU: each row's allowed token ids as set bits."""
    words = words_per_row(vocab_size)
    bits = torch.zeros(len(allowed), words * 32, dtype=torch.int64)
    for r, tokens in enumerate(allowed):
        bits[r, list(tokens)] = 1
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    packed = (bits.view(len(allowed), words, 32) * weights).sum(-1)
    return (packed - (packed >= 1 << 31).long() * (1 << 32)).to(torch.int32)


def unpack_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool: the tokens each packed row allows."""
    words = bitmask.detach().cpu().to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, dtype=torch.int64)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The kernel's result as a new float64 CPU tensor."""
    allowed = unpack_allowed(bitmask, logits.shape[1])
    return logits.detach().double().cpu().masked_fill(~allowed, float("-inf"))
