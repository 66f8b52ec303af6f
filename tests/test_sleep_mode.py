"""Tagged pools: same addresses across sleep and wake, backups restored, discarded contents
poisoned; on the GPU the physical memory is really released (free memory rises)."""

from __future__ import annotations

import mmap

import pytest
import torch

from harness.fixes import ALL_FIXES
from harness.isolate import Job
from harness.outcome import Outcome
from harness.runner.sleep_mode import ArenaPools, make_pools


def _fill(pools, device):
    w = pools.tensor("weights", list(range(10)), torch.int64)
    kv = pools.empty("kv_cache", (4, 3), torch.float32).fill_(2.5)
    ptrs = pools.empty("kv_cache", (2,), torch.int64).copy_(torch.tensor([w.data_ptr(), 7]))
    return w, kv, ptrs


def test_sleep_level_one_keeps_weights_poisons_kv_cache(device) -> None:
    pools = make_pools(device)
    w, kv, ptrs = _fill(pools, device)
    addresses = [t.data_ptr() for t in (w, kv, ptrs)]
    pools.sleep(offload_tags=("weights",))
    pools.wake_up()
    assert [t.data_ptr() for t in (w, kv, ptrs)] == addresses
    assert w.tolist() == list(range(10))
    assert kv.isnan().all(), kv
    assert ptrs.tolist() == [-1, -1], "discarded int64 must read 0xFFFF..., a wild pointer"


def test_wake_by_tag(device) -> None:
    pools = make_pools(device)
    w, kv, _ = _fill(pools, device)
    pools.sleep(offload_tags=("weights",))
    pools.wake_up(["weights"])
    assert w.tolist() == list(range(10))
    pools.wake_up(["kv_cache"])
    assert kv.isnan().all()


def test_unknown_tag_is_an_error(device) -> None:
    pools = make_pools(device)
    with pytest.raises(ValueError, match="unknown memory tags"):
        pools.empty("activations", (2,), torch.float32)
    with pytest.raises(ValueError, match="unknown memory tags"):
        pools.sleep(offload_tags=("weight",))


def test_arena_full_is_a_clear_error() -> None:
    pools = ArenaPools(capacity_bytes=1024)  # rounded up to whole pages
    pools.empty("weights", (128,), torch.float32)
    with pytest.raises(MemoryError, match="arena 'weights' full"):
        pools.empty("weights", (mmap.PAGESIZE // 4,), torch.float32)


@pytest.mark.gpu
def test_cumem_sleep_really_frees_memory() -> None:
    """Free device memory rises by the pool's size at sleep. The GPU is shared with other test
    workers whose allocations move the figure, so up to three sleep/wake cycles are measured;
    a pool that never releases its memory fails every one."""
    size = 1 << 30
    pools = make_pools("cuda")
    kv = pools.empty("kv_cache", (size,), torch.uint8)
    mapped, freed = pools.mapped_bytes("kv_cache"), []
    for _ in range(3):
        kv.fill_(1)
        torch.cuda.synchronize()
        free_awake, _ = torch.cuda.mem_get_info()
        pools.sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        assert pools.mapped_bytes("kv_cache") == 0
        freed.append(free_asleep - free_awake)
        pools.wake_up()
        assert pools.mapped_bytes("kv_cache") == mapped and (kv == 255).all()
        if freed[-1] >= size * 3 // 4:
            break
    print(f"freed at sleep (MiB): {[f >> 20 for f in freed]}; kv_cache mapped {mapped >> 20} MiB")
    assert max(freed) >= size * 3 // 4, f"freed {[f >> 20 for f in freed]} MiB of {size >> 20}"


@pytest.mark.block_table_wake
@pytest.mark.parametrize("name", ["reads_a_sleeping_pool", "writes_a_sleeping_pool"])
def test_any_access_to_a_sleeping_tag_faults(device, isolator, name) -> None:
    """As on the GPU, so on the CPU: a sleeping tag is not memory (illegal_address)."""
    result = isolator.run(Job("test", name, f"tests.children:{name}", ALL_FIXES, device, 120))
    assert result.outcome == Outcome.ILLEGAL_ADDRESS, result.evidence


def test_an_arena_has_poison_either_side_that_never_sleeps() -> None:
    """A kernel that strays a little before or past a CuMem range reads other mapped memory on
    the GPU; before or past a bare mmap it read another arena or nothing, by run (a stale
    stride of -1 read before the tables: wrong_result or SIGSEGV). Each CPU arena sits between
    margins of poison, mapped while it sleeps."""
    from harness.runner.sleep_mode import GUARD, POISON_BYTE

    pools = ArenaPools(capacity_bytes=1024)
    first = pools.empty("kv_cache", (4,), torch.int32).fill_(7)
    whole = torch.frombuffer(pools.maps["kv_cache"], dtype=torch.uint8)
    assert first.data_ptr() - whole.data_ptr() == GUARD
    pools.sleep()
    margins = (whole[:GUARD], whole[GUARD + mmap.PAGESIZE :])
    assert all(bool(m.eq(POISON_BYTE).all()) and m.numel() == GUARD for m in margins)
    pools.wake_up()
    assert first.tolist() == [-1] * 4, "discarded: poison, as before"


FORK_AFTER_A_WAKE = """
import os, signal, torch
from harness.runner.sleep_mode import ArenaPools
pools = ArenaPools(capacity_bytes=1 << 24)
pools.empty("weights", (1 << 22,), torch.float32)[:8].fill_(1.0)  # 16 MB: the whole arena
pools.sleep(offload_tags=("weights",))
pools.wake_up()
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    torch.zeros(1 << 10).add_(1)
    torch.ones(1 << 20).mul_(3)  # large enough for torch's parallel path
    os._exit(0)
print(os.waitpid(pid, 0)[1])
"""


def test_a_process_that_slept_and_woke_an_arena_can_still_fork() -> None:
    """The arenas' fills and copies are numpy's: torch's of that size start OpenMP threads,
    and a child forked after them hangs in its first parallel op."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_A_WAKE], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stdout + done.stderr
