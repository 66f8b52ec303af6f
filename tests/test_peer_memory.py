"""PeerMemory (harness/runner/peer_memory.py): each rank's buffer, mapped in every rank. Two
ranks forked from the test, joined over gloo: each sees its peer's fill, a write into a peer's
buffer is seen by its owner, and the table holds the addresses of the mappings (on the GPU, a
rank's kernels read through it: the custom all-reduce's tests)."""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch

from harness.runner.parallel import ParallelConfig
from harness.runner.peer_memory import PeerMemory

pytestmark = pytest.mark.distributed


def _rank(rank: int, directory: str, errors) -> None:
    import torch.distributed as dist

    try:
        store = dist.FileStore(str(Path(directory) / "store"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        parallel = ParallelConfig(world_size=2, rank=rank, data_parallel_size=2)
        memory = PeerMemory("t", 4, torch.int32, parallel, "cpu", directory, fill=10 + rank)
        peer = 1 - rank
        assert memory.peers[rank] is memory.local
        assert memory.peers[peer].tolist() == [10 + peer] * 4  # the peer's fill, seen here
        assert memory.table.tolist() == [p.data_ptr() for p in memory.peers]
        memory.peers[peer][rank] = 100 + rank  # write into the peer's buffer
        dist.barrier()
        assert memory.local[peer].item() == 100 + peer  # the peer's write, in my own buffer
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_two_ranks_share_their_buffers(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    procs = [context.Process(target=_rank, args=(r, str(tmp_path), errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank did not finish in 60 s"
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(f.name for f in tmp_path.glob("peer-*")) == ["peer-t-0.bin", "peer-t-1.bin"]


def test_an_empty_buffer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="numel must be at least 1"):
        PeerMemory("t", 0, torch.int32, ParallelConfig(), "cpu", tmp_path)
