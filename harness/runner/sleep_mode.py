"""Tagged memory pools with sleep and wake: CuMem on the GPU, an arena emulation on the CPU.

Tags are "weights" and "kv_cache". The contract both implementations keep:
- every tensor allocated under a tag keeps its address across sleep and wake;
- sleep(offload_tags) backs up the offloaded tags to host memory, then discards every tag
  (GPU: unmaps and releases the physical memory, keeping the address range reserved; CPU:
  makes the arena's pages inaccessible): any access to a sleeping tag faults on both devices;
- wake_up(tags) maps new memory at the same addresses (GPU), restores backups, and fills
  whatever was discarded with 0xFF bytes: int pointers read as -1 (0xFFFF...), floats as NaN,
  so a reader of stale contents fails the same way every time.
"""

from __future__ import annotations

import abc
import ctypes
import mmap
from collections.abc import Sequence

import numpy as np
import torch

TAGS = ("weights", "kv_cache")
POISON_BYTE = 0xFF
ALIGN = 256  # bytes; every arena allocation starts on this boundary
GUARD = 1 << 16  # bytes of poison on each side of a CPU arena (a multiple of the page size)


class TaggedPools(abc.ABC):
    """What the runner and worker allocate from; subclasses say where the bytes live."""

    @abc.abstractmethod
    def empty(self, tag: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...

    @abc.abstractmethod
    def sleep(self, offload_tags: Sequence[str] = ()) -> None: ...

    @abc.abstractmethod
    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    def zeros(self, tag: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(tag, shape, dtype).zero_()

    def tensor(self, tag: str, values: list, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(tag, (len(values),), dtype).copy_(torch.tensor(values, dtype=dtype))

    def adopt(self, tag: str, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` that lives in the pool of `tag`."""
        return self.empty(tag, tensor.shape, tensor.dtype).copy_(tensor)


def _check_tags(tags: Sequence[str]) -> None:
    unknown = set(tags) - set(TAGS)
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; tags: {TAGS}")


def _protect(arena: torch.Tensor, accessible: bool) -> None:
    """mprotect the arena's pages: no access at all while its tag sleeps."""
    flags = (mmap.PROT_READ | mmap.PROT_WRITE) if accessible else 0  # 0: PROT_NONE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.mprotect(arena.data_ptr(), arena.numel(), flags) != 0:
        raise OSError(ctypes.get_errno(), "mprotect of a sleep-mode arena failed")


class ArenaPools(TaggedPools):
    """CPU emulation: one anonymous mmap arena per tag; tensors are views into it (stable
    addresses). A sleeping tag's pages are inaccessible (PROT_NONE), so any access faults
    (SIGSEGV) as an access to unmapped CuMem memory does on the GPU."""

    def __init__(self, capacity_bytes: int) -> None:
        size = -(-capacity_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        # NOTE: each arena sits between two GUARD-byte margins of poison that never sleep. An
        # address a little before or past a CuMem range is other mapped memory on the GPU; past
        # a bare mmap it was another arena or nothing, by run (a stale stride of -1 read before
        # the tables, a crash in some runs and garbage in others).
        self.maps = {tag: mmap.mmap(-1, size + 2 * GUARD) for tag in TAGS}  # zeros, aligned
        # NOTE: the arenas' bulk fills and copies are numpy's, not torch's: torch's of this
        # size go parallel and start OpenMP threads, after which a child the process forks
        # (the isolator's) hangs in its first parallel op
        for m in self.maps.values():
            m[:GUARD] = m[GUARD + size :] = bytes([POISON_BYTE]) * GUARD
        whole = {tag: torch.frombuffer(m, dtype=torch.uint8) for tag, m in self.maps.items()}
        self.arenas = {tag: b[GUARD : GUARD + size] for tag, b in whole.items()}
        self.used = dict.fromkeys(TAGS, 0)
        self.backups: dict[str, np.ndarray] = {}
        self.asleep: set[str] = set()

    def empty(self, tag: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        _check_tags([tag])
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        start = -(-self.used[tag] // ALIGN) * ALIGN
        if start + nbytes > self.arenas[tag].numel():
            raise MemoryError(f"arena {tag!r} full: {start + nbytes} > {self.arenas[tag].numel()}")
        self.used[tag] = start + nbytes
        return self.arenas[tag][start : start + nbytes].view(dtype).view(*shape)

    def sleep(self, offload_tags: Sequence[str] = ()) -> None:
        _check_tags(offload_tags)
        for tag in TAGS:
            if tag in offload_tags:  # NOTE: numpy copies here: see __init__
                self.backups[tag] = self.arenas[tag][: self.used[tag]].numpy().copy()
            _protect(self.arenas[tag], accessible=False)  # the emulated release
            self.asleep.add(tag)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = list(TAGS if tags is None else tags)
        _check_tags(tags)
        for tag in [t for t in tags if t in self.asleep]:
            _protect(self.arenas[tag], accessible=True)
            memory = self.arenas[tag].numpy()
            memory.fill(POISON_BYTE)  # new memory: the old contents are gone
            backup = self.backups.pop(tag, None)
            if backup is not None:
                memory[: backup.size] = backup
            self.asleep.discard(tag)


class CuMemPools(TaggedPools):
    """GPU: one torch MemPool per tag over the CuMem allocator of csrc/cumem_allocator.cpp."""

    def __init__(self) -> None:
        from kernels import csrc

        self.ext = csrc.load("cumem_allocator")
        self.allocator = torch.cuda.memory.CUDAPluggableAllocator(
            self.ext.__file__, "repro_cumem_malloc", "repro_cumem_free"
        )
        self.pools = {tag: torch.cuda.MemPool(self.allocator.allocator()) for tag in TAGS}

    def empty(self, tag: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        _check_tags([tag])
        self.ext.set_tag(TAGS.index(tag))
        with torch.cuda.use_mem_pool(self.pools[tag]):
            return torch.empty(*shape, dtype=dtype, device="cuda")

    def sleep(self, offload_tags: Sequence[str] = ()) -> None:
        _check_tags(offload_tags)
        torch.cuda.synchronize()
        for i, tag in enumerate(TAGS):
            self.ext.sleep(i, tag in offload_tags)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = list(TAGS if tags is None else tags)
        _check_tags(tags)
        for tag in tags:
            self.ext.wake(TAGS.index(tag))

    def mapped_bytes(self, tag: str) -> int:
        return self.ext.mapped_bytes(TAGS.index(tag))


def make_pools(device: str, arena_bytes: int = 1 << 24) -> TaggedPools:
    return CuMemPools() if device == "cuda" else ArenaPools(arena_bytes)
