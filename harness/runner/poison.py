"""Poisoned allocations: uninitialized memory that is garbage on purpose, deterministically.

Upstream's buffers are allocated empty and hold allocator leftovers until written; the runner and
the scenarios get the same garbage every run: PyTorch fills new integer tensors with their
maximum and floats with NaN.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Inside: torch.empty (Python and C++) returns poison, not allocator leftovers."""
    # NOTE: set_deterministic_debug_mode, not use_deterministic_algorithms: the latter imports
    # torch._inductor (seconds per child) and the fill only needs the flag.
    previous_mode = torch.get_deterministic_debug_mode()
    previous_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.set_deterministic_debug_mode("warn")
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = previous_fill
        torch.set_deterministic_debug_mode(previous_mode)
