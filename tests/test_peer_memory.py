"""PeerMemory (harness/runner/peer_memory.py): each rank's buffer, mapped in every rank. Two
ranks forked from the test, joined over gloo: each sees its peer's fill, a write into a peer's
buffer is seen by its owner, and the table holds the addresses of the mappings (on the GPU, a
rank's kernels read through it: the custom all-reduce's tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.runner.parallel import ParallelConfig
from harness.runner.peer_memory import PeerMemory
from tests import procs

pytestmark = pytest.mark.distributed


def _rank(rank: int, directory: str) -> None:
    import torch.distributed as dist

    parallel = ParallelConfig(world_size=2, rank=rank, data_parallel_size=2)
    memory = PeerMemory("t", 4, torch.int32, parallel, "cpu", directory, fill=10 + rank)
    peer = 1 - rank
    assert memory.peers[rank] is memory.local
    assert memory.peers[peer].tolist() == [10 + peer] * 4  # the peer's fill, seen here
    assert memory.table.tolist() == [p.data_ptr() for p in memory.peers]
    memory.peers[peer][rank] = 100 + rank  # write into the peer's buffer
    dist.barrier()
    assert memory.local[peer].item() == 100 + peer  # the peer's write, in my own buffer


def test_two_ranks_share_their_buffers(tmp_path: Path) -> None:
    procs.forked_ranks(_rank, tmp_path)
    assert sorted(f.name for f in tmp_path.glob("peer-*")) == ["peer-t-0.bin", "peer-t-1.bin"]


def test_an_empty_buffer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="numel must be at least 1"):
        PeerMemory("t", 0, torch.int32, ParallelConfig(), "cpu", tmp_path)
