"""A Mamba layer's causal depthwise convolution over prefill chunks, with conv states in slots (a
small twin of upstream's _causal_conv1d_fwd_kernel with prefix caching).

Per sequence of the batch: its chunk of tokens (query_start_loc), the slot its initial conv
state is read from (-1: none, a fresh start: zeros) and the slot its final state is written to
(with prefix caching they differ: the initial one may be a cached prefix block shared with other
sequences, the final one is the sequence's own). A conv state is the last WIDTH - 1 inputs,
oldest first. The final state is the chunk's last WIDTH - 1 inputs when the chunk has that many
(the long branch), else the initial state shifted left by the chunk's length with its inputs
after it (the short branch). Upstream stored the short branch's state through the pointer it
had read the initial state from (vLLM #56196): the shared block was overwritten and the own
block never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launch  # noqa: F401  # the interpreter's patches (CPU runs)

WIDTH = 4  # upstream's Mamba conv width
STATE_LEN = WIDTH - 1


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """(outputs [n, dim], final state [dim, STATE_LEN]) of one chunk `x` [n, dim] from `state`
    [dim, STATE_LEN], in float64."""
    x, weight, state = (t.detach().double().cpu() for t in (x, weight, state))
    window = torch.cat([state, x.T], dim=1)  # [dim, STATE_LEN + n]
    out = torch.stack([(window[:, t : t + WIDTH] * weight).sum(1) for t in range(x.shape[0])])
    return out, window[:, -STATE_LEN:]


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, dim] float32, the batch's chunks one after another
    weight: torch.Tensor,  # [dim, WIDTH] float32, the last column weighs the current token
    conv_states: torch.Tensor,  # [num_slots, dim, STATE_LEN] float32, read and written
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    initial_slots: torch.Tensor,  # [num_seqs] int32, -1: a fresh start
    final_slots: torch.Tensor,  # [num_seqs] int32
    out: torch.Tensor,  # [num_tokens, dim] float32, written
    own_block: bool = True,  # conv_state_short_chunk
) -> None:
    dim = x.shape[1]
    assert weight.shape == (dim, WIDTH) and conv_states.shape[1:] == (dim, STATE_LEN)
    assert x.is_contiguous() and out.is_contiguous() and conv_states.is_contiguous()
    assert initial_slots.dtype == final_slots.dtype == query_start_loc.dtype == torch.int32
    num_seqs = final_slots.shape[0]
    _causal_conv1d_kernel[(num_seqs,)](
        x,
        weight,
        conv_states,
        query_start_loc,
        initial_slots,
        final_slots,
        out,
        dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        OWN_BLOCK=own_block,
    )


@triton.jit
def _store_state(states, slot, dim, feats, mask, col0, col1, col2):
    """Slot `slot`'s conv state (dim rows of 3 columns) := the three columns."""
    base = states + slot.to(tl.int64) * dim * 3 + feats * 3
    tl.store(base + 0, col0, mask=mask)
    tl.store(base + 1, col1, mask=mask)
    tl.store(base + 2, col2, mask=mask)


@triton.jit(do_not_specialize=["dim"])
def _causal_conv1d_kernel(
    x,
    weight,
    states,
    query_start_loc,
    initial_slots,
    final_slots,
    out,
    dim,
    BLOCK_D: tl.constexpr,
    OWN_BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    start = tl.load(query_start_loc + seq).to(tl.int64)
    seqlen = tl.load(query_start_loc + seq + 1).to(tl.int64) - start
    feats = tl.arange(0, BLOCK_D)
    mask = feats < dim
    initial = tl.load(initial_slots + seq)
    final = tl.load(final_slots + seq)
    # the slot the initial state is read from: a fresh start names its own (nothing is read)
    source = tl.where(initial >= 0, initial, final)
    src = states + source.to(tl.int64) * dim * 3 + feats * 3
    has_init = mask & (feats * 0 + initial >= 0)  # a vector mask (the interpreter's need)
    col0 = tl.load(src + 0, mask=has_init, other=0.0)
    col1 = tl.load(src + 1, mask=has_init, other=0.0)
    col2 = tl.load(src + 2, mask=has_init, other=0.0)
    w0 = tl.load(weight + feats * 4 + 0, mask=mask, other=0.0)
    w1 = tl.load(weight + feats * 4 + 1, mask=mask, other=0.0)
    w2 = tl.load(weight + feats * 4 + 2, mask=mask, other=0.0)
    w3 = tl.load(weight + feats * 4 + 3, mask=mask, other=0.0)
    for t in range(seqlen):
        xt = tl.load(x + (start + t) * dim + feats, mask=mask, other=0.0)
        acc = col0 * w0 + col1 * w1 + col2 * w2 + xt * w3
        tl.store(out + (start + t) * dim + feats, acc, mask=mask)
        col0, col1, col2 = col1, col2, xt
    # the columns now hold the final state: the chunk's last 3 inputs, or (a chunk shorter than
    # 3) the initial state shifted left with the chunk's inputs after it
    if seqlen >= 3:  # the long branch: to the sequence's own slot
        _store_state(states, final, dim, feats, mask, col0, col1, col2)
    else:  # the short branch
        if OWN_BLOCK:
            # fix: conv_state_short_chunk -- the sequence's own slot, not the one read from
            _store_state(states, final, dim, feats, mask, col0, col1, col2)
        else:
            # NOTE: the initial state's slot, a shared prefix block with prefix caching
            _store_state(states, source, dim, feats, mask, col0, col1, col2)
