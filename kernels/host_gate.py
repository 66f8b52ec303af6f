"""A copy stream's gate: a one-thread kernel that spins until the host opens it.

`wait_for_host(flag, generation)`, enqueued on a stream, holds that stream until the host
writes `generation` or more into `flag` (a pinned host tensor of one int32, which the GPU reads
through its mapping: a volatile load per poll), or until `max_polls` polls ran out: a bound, so
that a host that waits for the held stream itself (a synchronizing copy behind it) is let go,
late, rather than never. The harness's stream model holds each copy behind one, so that the
host's write or an allocator's reuse certainly comes before it (harness/runner/streams.py).
GPU only: the CPU's stream model defers the copies themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_POLLS = 2_000_000  # at about 1 us a poll of host memory: a few seconds at most


def wait_for_host(flag: torch.Tensor, generation: int, max_polls: int = MAX_POLLS) -> None:
    assert flag.dtype == torch.int32 and flag.numel() == 1 and flag.is_pinned(), flag
    _wait_for_host_kernel[(1,)](flag, generation, max_polls, num_warps=1)


@triton.jit
def _wait_for_host_kernel(flag_ptr, generation, max_polls):
    polls = 0
    while (tl.load(flag_ptr, volatile=True) < generation) & (polls < max_polls):
        polls += 1
