"""The tensor-parallel ranks' custom all-reduce (upstream: vLLM's CustomAllReduce), over peer
memory (peer_memory.py) and the Triton kernel of kernels/custom_allreduce.py.

What each rank keeps:
- its signal words (a PeerMemory: every rank writes its flags into every peer's);
- a registered buffer (a PeerMemory, its peers' addresses known from the start): an eager call
  copies its input there and the kernel reads every rank's through row 0 of the rank-data table;
- the graph inputs' arena (a PeerMemory; upstream: the CUDA-graph pool, whose allocations a peer
  can map only once their IPC handles are exchanged): `alloc` hands a captured producer its
  output there, and the captured all-reduce reads its input where it lies;
- the rank-data table: int64 [1 + max_graph_inputs, world]. A captured call cannot know where
  its peers' inputs lie (each is in the peer's graph pool), so it takes the next row of the
  table (upstream: d_rank_data_base_ + graph_unreg_buffers_.size()) and records its input's
  offset; the rows hold -1 (an address nothing maps: a load through it faults, on either
  device) until `register_graph_buffers`, at the end of the capture window (`capture()`),
  exchanges the offsets between the ranks (an object collective, outside any graph) and fills
  each row with the addresses of every rank's input of that call.
So a graph replayed inside the window, before registration, loads through -1 (vLLM #28334).

The round each call's flags carry comes from the host (`self.round`, advanced after each call:
frozen into a graph at capture) or, with the fix part of vLLM #46913, from a counter in device
memory the kernel advances (kernels/custom_allreduce.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.runner.cudagraph import Launcher
from harness.runner.parallel import ParallelConfig
from harness.runner.peer_memory import PeerMemory
from kernels.custom_allreduce import (
    BREACHES,
    DONE,
    EXPIRED,
    SIGNAL_WORDS,
    SPINNING,
    custom_allreduce,
)

UNREGISTERED = -1  # a rank-data row before registration: an address no process maps


class CustomAllReduce:
    """Sum-all-reduce of float32 tensors of up to `max_numel` elements across every rank (a
    tensor-parallel world), eager or captured in a graph (up to `max_graph_inputs` captured
    calls)."""

    def __init__(
        self,
        parallel: ParallelConfig,
        device: str,
        directory: str | Path,
        launcher: Launcher,
        fixes: Variant = ALL_FIXES,
        max_numel: int = 256,
        max_graph_inputs: int = 16,
        name: str = "car",
        lag_rank: int | None = None,  # a forced order: this rank reads after its peers
    ) -> None:
        if parallel.world_size != parallel.tensor_parallel_size:
            raise ValueError("CustomAllReduce: a world of tensor-parallel ranks only")
        self.parallel, self.device, self.launch, self.fixes = parallel, device, launcher, fixes
        self.rank, self.max_numel = parallel.rank, max_numel
        self.lag = lag_rank == parallel.rank  # the kernel's hold (kernels/custom_allreduce.py)
        args = (parallel, device, directory)
        self.signal = PeerMemory(f"{name}-signal", SIGNAL_WORDS, torch.int32, *args)
        self.buffer = PeerMemory(f"{name}-buffer", max_numel, torch.float32, *args)
        self.graph_inputs = PeerMemory(
            f"{name}-graph", max_graph_inputs * max_numel, torch.float32, *args
        )
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)  # the device's round
        self.round = 1  # the host's round: the next call's
        self.rank_data = torch.full(
            (1 + max_graph_inputs, parallel.world_size), UNREGISTERED, dtype=torch.int64
        ).to(device)
        self.rank_data[0].copy_(self.buffer.table)  # the registered buffers: known at once
        self.in_window = False  # inside capture(): captured calls take rank-data rows
        self.graph_offsets: list[int] = []  # per captured call: its input's offset in the arena
        self.registered = 0  # captured calls whose rows are filled
        self._arena_used = 0

    # -- graph inputs -------------------------------------------------------------------------

    def alloc(self, numel: int) -> torch.Tensor:
        """Where a producer writes what it then all-reduces: while a graph is captured, new
        memory of the graph inputs' arena (upstream: the graph pool); else a plain tensor."""
        if not self.launch.capturing:
            return torch.empty(numel, dtype=torch.float32, device=self.device)
        start, self._arena_used = self._arena_used, self._arena_used + numel
        if self._arena_used > self.graph_inputs.local.numel():
            raise RuntimeError("CustomAllReduce: the graph inputs' arena is full")
        return self.graph_inputs.local[start : start + numel]

    def _arena_offset(self, inp: torch.Tensor) -> int:
        base = self.graph_inputs.local
        offset = (inp.data_ptr() - base.data_ptr()) // base.element_size()
        if not 0 <= offset <= base.numel() - inp.numel():
            raise ValueError("a captured all-reduce's input must come from alloc() in capture")
        return offset

    # -- the all-reduce -----------------------------------------------------------------------

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = the sum of every rank's `inp` (float32, contiguous, one shape on every rank)."""
        n = inp.numel()
        if n > self.max_numel or out.numel() != n:
            raise ValueError(f"CustomAllReduce: {n} elements into {out.numel()} (max {n})")
        if self.launch.capturing:
            if not self.in_window:  # upstream: capture only inside the communicator's capture()
                raise RuntimeError("CustomAllReduce: a graph captured outside capture()")
            self.graph_offsets.append(self._arena_offset(inp))
            ptrs = self.rank_data[len(self.graph_offsets)]  # filled at registration
        else:
            self.launch(self.buffer.local[:n].copy_, inp.reshape(-1))
            ptrs = self.rank_data[0]
        # fix: allreduce_device_round -- the kernel takes its round from the device's counter
        device_round = Fix.ALLREDUCE_DEVICE_ROUND in self.fixes
        self.launch(
            custom_allreduce,
            ptrs,
            self.signal.table,
            self.counter,
            out.view(-1),
            self.round,
            self.rank,
            device_round=device_round,
            lag=self.lag,
        )
        self.round += 1  # host code: runs once when captured
        return out

    # -- the capture window -------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """The capture window (upstream: CustomAllReduce.capture inside graph_capture): graphs
        captured inside take rank-data rows; at its end every rank registers them."""
        self.in_window = True
        try:
            yield
        finally:
            self.in_window = False
            self.register_graph_buffers()

    def register_graph_buffers(self) -> None:
        """Exchange every captured call's input offset between the ranks and fill its row with
        the address of each rank's input (upstream: IPC handles and offsets, all-gathered)."""
        mine = self.graph_offsets[self.registered :]
        every = [mine]
        if self.parallel.world_size > 1:
            import torch.distributed as dist

            every = [None] * self.parallel.world_size
            dist.all_gather_object(every, mine)
        if any(len(o) != len(mine) for o in every):
            raise RuntimeError(f"ranks captured {[len(o) for o in every]} all-reduces")
        item = self.graph_inputs.local.element_size()
        bases = [p.data_ptr() for p in self.graph_inputs.peers]
        for i in range(len(mine)):
            row = [base + offsets[i] * item for base, offsets in zip(bases, every, strict=True)]
            self.rank_data[1 + self.registered + i].copy_(torch.tensor(row, dtype=torch.int64))
        self.registered += len(mine)

    # -- what a rank's host reads of a peer's progress ----------------------------------------

    def progress(self, rank: int) -> tuple[int, int]:
        """Rank `rank`'s kernel calls completed, and the last call that waited for a peer's
        flag, start or end (read from its signal words; on a GPU, a read of the peer's
        memory)."""
        words = self.signal.peers[rank]
        return int(words[DONE].item()), int(words[SPINNING].item())

    def expired(self) -> int:
        """This rank's waits that ran out of spins (0 on every correct run)."""
        return int(self.signal.local[EXPIRED].item())

    def breaches(self) -> int:
        """This rank's calls in which a peer completed the call before this rank had read its
        input (0 on every correct run: the end barrier holds each rank until every peer read)."""
        return int(self.signal.local[BREACHES].item())
