"""A one-shot custom all-reduce over peer buffers, as vLLM's custom all-reduce (one stage).

Each rank's kernel sums every rank's input, read through an int64 address table (`ptrs`: one
address per rank, the row of the communicator's rank-data table for this call), and writes the
sum to its own output. A barrier at the start (every rank's input is ready) and at the end
(every peer has read this rank's input, so it may be overwritten) goes through each rank's
signal words, mapped in every rank (harness/runner/peer_memory.py: `signals` is the address of
each rank's words):

    START + r  rank r's round, written by rank r when its input is ready (the start flag)
    END + r    rank r's round, written by rank r when it has read every input (the end flag)
    CALLS      calls entered by this rank's kernel
    SPINNING   the call that last had to wait for a peer's flag, start or end (written before
               it spins)
    DONE       calls this rank's kernel completed
    EXPIRED    calls whose wait ran out of spins (a bound, never reached by a correct run)
    END_SPIN   the call that last had to wait for a peer's end flag (written before it spins)
    BREACHES   calls in which, once this rank had read every input, a peer had already
               completed that call: the peer left its end barrier before this rank read its
               input, which it may then overwrite (never in a correct run)

A lagging rank (`lag`: one rank, a scenario's forced order) holds between its start barrier
and its reads until every peer has either completed the call or spins at its end barrier
waiting for this rank (END_SPIN): so an end barrier that lets a rank through early is seen as a
breach on every run, not only when the lagging rank's reads happen to come late (a bounded
wait, as every other).

A rank waits until each peer's flag equals the call's round. Where the round comes from:
- the host (`host_round`, a scalar argument the host advances after each call): a CUDA graph
  bakes the value captured, so every replay waits for the value the previous replay left in the
  flag (upstream: quick-reduce's flag color, vLLM #46913, ROCm/aiter #3928);
- this rank's round counter in device memory (`counter`), advanced by the kernel itself at each
  call, replays included (DEVICE_ROUND; upstream: the custom all-reduce's per-block flag).

Each wait spins at most MAX_SPIN loads: a fixed run never hangs (a run that reaches the bound
counts it in EXPIRED, which its caller checks). Peers' words and inputs are read with volatile
loads, each wait ending on an acquire read of its flag; flags are written with release atomics
at system scope (peers in other processes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launch  # noqa: F401  # the interpreter's patches (CPU runs)

START, END, CALLS, SPINNING, DONE, EXPIRED, END_SPIN, BREACHES = 0, 8, 16, 17, 18, 19, 20, 21
SIGNAL_WORDS = 22  # int32 words per rank (START and END rows: up to 8 ranks)
MAX_RANKS = 8
# loads per wait: far past any fixed run's wait (on a GPU, a local volatile load takes about a
# microsecond: a minute of spinning, past a peer's first compile or a time slice of a shared GPU)
MAX_SPIN = 1 << 26
# the same offsets, as the kernels see them
_START, _END, _CALLS = tl.constexpr(START), tl.constexpr(END), tl.constexpr(CALLS)
_SPINNING, _DONE, _EXPIRED = tl.constexpr(SPINNING), tl.constexpr(DONE), tl.constexpr(EXPIRED)
_END_SPIN, _BREACHES = tl.constexpr(END_SPIN), tl.constexpr(BREACHES)


def custom_allreduce(
    ptrs: torch.Tensor,  # [world] int64: each rank's input address (a rank-data row)
    signals: torch.Tensor,  # [world] int64: each rank's signal words (int32)
    counter: torch.Tensor,  # [1] int32: this rank's round counter (device_round)
    out: torch.Tensor,  # [n] float32, written: the sum of every rank's input
    host_round: int,  # the host's round (not device_round)
    rank: int,
    device_round: bool = True,  # allreduce_device_round
    max_spin: int = MAX_SPIN,
    lag: bool = False,  # this rank reads only once every peer is done or at its end barrier
) -> None:
    world, n = ptrs.shape[0], out.numel()
    assert ptrs.dtype == signals.dtype == torch.int64 and signals.shape[0] == world
    assert counter.dtype == torch.int32 and out.dtype == torch.float32 and out.is_contiguous()
    if not 1 <= world <= MAX_RANKS or not 0 <= rank < world:
        raise ValueError(f"custom_allreduce: rank {rank} of {world}; at most {MAX_RANKS} ranks")
    _custom_allreduce_kernel[(1,)](
        ptrs,
        signals,
        counter,
        out,
        host_round,
        n,
        RANK=rank,
        WORLD=world,
        BLOCK=max(16, triton.next_power_of_2(n)),
        DEVICE_ROUND=device_round,
        MAX_SPIN=max_spin,
        LAG=lag,
    )


@triton.jit
def _signal(signals, rank):
    """Rank `rank`'s signal words, as an int32 pointer."""
    return tl.load(signals + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def _wait(flag, value, own, call, MAX_SPIN: tl.constexpr, AT_END: tl.constexpr = False):
    """Spin until *flag == value (at most MAX_SPIN loads), first publishing in this rank's
    SPINNING word (and END_SPIN, at the end barrier) that call `call` waits (a peer's host, or
    a lagging peer, may order itself on it)."""
    seen = tl.load(flag, volatile=True)
    if seen != value:
        tl.atomic_xchg(own + _SPINNING, call, sem="release", scope="sys")
        if AT_END:
            tl.atomic_xchg(own + _END_SPIN, call, sem="release", scope="sys")
    spins = 0
    while (seen != value) & (spins < MAX_SPIN):
        seen = tl.load(flag, volatile=True)
        spins += 1
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")  # the peer's writes before it
    if seen != value:
        tl.atomic_add(own + _EXPIRED, 1, sem="relaxed", scope="sys")


@triton.jit
def _hold(peer, call, own, MAX_SPIN: tl.constexpr):
    """Spin until the peer (its signal words) completed call `call` or spins at its end
    barrier in it (at most MAX_SPIN loads; EXPIRED counts a hold that ran out)."""
    ready = (tl.load(peer + _DONE, volatile=True) >= call) | (
        tl.load(peer + _END_SPIN, volatile=True) >= call
    )
    spins = 0
    while (ready == 0) & (spins < MAX_SPIN):
        ready = (tl.load(peer + _DONE, volatile=True) >= call) | (
            tl.load(peer + _END_SPIN, volatile=True) >= call
        )
        spins += 1
    if ready == 0:
        tl.atomic_add(own + _EXPIRED, 1, sem="relaxed", scope="sys")


@triton.jit(do_not_specialize=["host_round", "n"])
def _custom_allreduce_kernel(
    ptrs,
    signals,
    counter,
    out,
    host_round,
    n,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    DEVICE_ROUND: tl.constexpr,
    MAX_SPIN: tl.constexpr,
    LAG: tl.constexpr,
):
    own = _signal(signals, RANK)
    call = tl.atomic_add(own + _CALLS, 1, sem="relaxed", scope="sys") + 1
    if DEVICE_ROUND:
        # fix: allreduce_device_round -- the round lives on the device, advanced at each call
        # (a replay included), so a flag left by the last call never matches this one's
        rnd = tl.load(counter) + 1
        tl.store(counter, rnd)
    else:
        rnd = host_round  # NOTE: in a graph, the value captured, at every replay
    # start: this rank's input is ready; wait until every peer's is
    for r in tl.static_range(WORLD):
        tl.atomic_xchg(_signal(signals, r) + _START + RANK, rnd, sem="release", scope="sys")
    for r in tl.static_range(WORLD):
        _wait(own + _START + r, rnd, own, call, MAX_SPIN)
    if LAG:  # a forced order: every peer done with this call or spinning at its end barrier
        for r in tl.static_range(WORLD):
            if r != RANK:
                _hold(_signal(signals, r), call, own, MAX_SPIN)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):  # in rank order on every rank: the same sums
        src = tl.load(ptrs + r).to(tl.pointer_type(tl.float32))
        acc += tl.load(src + offs, mask=mask, other=0.0, volatile=True)
    for r in tl.static_range(WORLD):  # a peer that completed this call before these reads
        if tl.load(_signal(signals, r) + _DONE, volatile=True) >= call:  # (never this rank)
            tl.atomic_add(own + _BREACHES, 1, sem="relaxed", scope="sys")
    # end: every input read here; wait until every peer has read this rank's
    for r in tl.static_range(WORLD):
        tl.atomic_xchg(_signal(signals, r) + _END + RANK, rnd, sem="release", scope="sys")
    for r in tl.static_range(WORLD):
        _wait(own + _END + r, rnd, own, call, MAX_SPIN, True)
    tl.store(out + offs, acc, mask=mask)
    tl.atomic_add(own + _DONE, 1, sem="release", scope="sys")
