"""Memory every rank of a run reads and writes: one buffer per rank, mapped in every rank.

What a custom all-reduce or an expert-parallel dispatch reads and writes through: each rank
allocates its own buffer, publishes a handle to it, and opens each peer's; a kernel then takes
a table of the buffers' addresses as this process sees them (int64, on the rank's device) and
loads and stores through it, with no collective of torch.distributed in between (upstream:
vLLM's custom all-reduce over cudaIpc handles, DeepEP's NVSHMEM buffers).

- On a GPU: CUDA IPC (torch's sharing of a CUDA storage: cudaIpcGetMemHandle here,
  cudaIpcOpenMemHandle in each peer), with one GPU per rank or ranks sharing one; where a
  peer's buffer lies on another GPU, it is opened on this rank's GPU, which the driver then
  gives access to it (peer access; refused with one line where the GPUs have none).
- On the CPU: a file in the run's private directory, mapped shared (MAP_SHARED) by every rank;
  the interpreter's loads and stores go through each process's own mapping.

Handles travel through torch.distributed's object collectives on the default group (on the
CPU, a barrier: the files' names are known), once, at construction, every rank alike: setup,
outside the runner's traced Collectives. Every rank's buffer is filled before any peer maps it.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from harness.runner.parallel import ParallelConfig


class PeerMemory:
    """`numel` elements of `dtype` per rank, named `name` (unique within a run), filled with
    `fill`. `local` is this rank's buffer, `peers[r]` rank r's as mapped here (`peers[rank]` is
    `local`), `table` their addresses (int64, on `device`: what a kernel takes). `directory`:
    the run's private directory (the CPU's files; `Path(ctx.trace).parent` in a scenario)."""

    def __init__(
        self,
        name: str,
        numel: int,
        dtype: torch.dtype,
        parallel: ParallelConfig,
        device: str,
        directory: str | Path,
        fill: float = 0,
    ) -> None:
        if numel < 1:
            raise ValueError(f"PeerMemory {name!r}: numel must be at least 1, got {numel}")
        self.name, self.parallel, self.device = name, parallel, device
        n, rank = parallel.world_size, parallel.rank
        if device == "cpu":
            files = [Path(directory) / f"peer-{name}-{r}.bin" for r in range(n)]
            self.local = self._map(files[rank], numel, dtype).fill_(fill)
            self._barrier()  # every rank's file made and filled before any peer maps it
            self.peers = [
                self.local if r == rank else self._map(f, numel, dtype) for r, f in enumerate(files)
            ]
        else:
            from torch.multiprocessing.reductions import reduce_tensor

            self.local = torch.full((numel,), fill, dtype=dtype, device=device)
            torch.cuda.synchronize()  # filled before any peer maps it
            handles = self._gather(reduce_tensor(self.local))  # every rank's, a barrier
            self.peers = [
                self.local if r == rank else self._open_cuda(h) for r, h in enumerate(handles)
            ]
        addresses = [p.data_ptr() for p in self.peers]
        self.table = torch.tensor(addresses, dtype=torch.int64).to(device)

    @staticmethod
    def _map(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The file, mapped shared (made at its size by the first to open it)."""
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)

    def _barrier(self) -> None:
        if self.parallel.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _gather(self, handle: object) -> list[object]:
        if self.parallel.world_size == 1:
            return [handle]
        import torch.distributed as dist

        handles: list[object] = [None] * self.parallel.world_size
        dist.all_gather_object(handles, handle)
        return handles

    def _open_cuda(self, handle: tuple) -> torch.Tensor:
        """The peer's buffer, its IPC handle opened on this rank's own GPU (as vLLM's custom
        all-reduce opens its peers'): where the peer's GPU is another, the driver enables this
        GPU's access to it (cudaIpcMemLazyEnablePeerAccess), and the tensor says this rank's
        device, whose kernels and copies reach it. torch's own rebuild opens it on the
        peer's GPU: a kernel of this GPU then faulted reading it (two H200s)."""
        rebuild, args = handle
        own = torch.device(self.device).index
        own = torch.cuda.current_device() if own is None else own
        args = list(args)
        at = list(inspect.signature(rebuild).parameters).index("storage_device")
        there, args[at] = args[at], own
        if there != own and not torch.cuda.can_device_access_peer(own, there):
            raise RuntimeError(
                f"PeerMemory {self.name!r}: GPU {own} cannot access GPU {there}'s memory (no "
                "peer access between them): run the ranks on one GPU"
            )
        return rebuild(*args)
