"""The worker's sleep/wake contract and where it calls post_kv_cache_wake_up."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.worker import Worker

pytestmark = pytest.mark.block_table_wake  # the wake path of vLLM #40648


def _worker(device, fixes=ALL_FIXES) -> Worker:
    return Worker(runner_config(device, fixes, enable_lora=False, max_model_len=32))


@pytest.mark.block_table_graph_wake
@pytest.mark.parametrize("in_place", [True, False], ids=["refreshed", "rebuilt"])
def test_layout_tensors_rewritten_only_when_kv_cache_wakes(device, in_place) -> None:
    fixes = ALL_FIXES if in_place else ALL_FIXES - {Fix.BLOCK_TABLE_REFRESH_IN_PLACE}
    worker = _worker(device, fixes)
    tables = worker.model_runner.kv_cache.block_tables
    old = tables.block_table_ptrs
    worker.sleep(1)
    worker.wake_up(["weights"])  # NOTE: kv_cache memory is unmapped now (GPU): do not read it
    assert tables.block_table_ptrs is old, "rebuilt before kv_cache woke"
    worker.wake_up(["kv_cache"])
    assert (tables.block_table_ptrs is old) == in_place
    assert tables.block_table_ptrs.tolist() == [t.data_ptr() for t in tables.block_tables]


def test_without_the_fix_the_layout_tensors_stay_garbage(device) -> None:
    worker = _worker(device, ALL_FIXES - {Fix.BLOCK_TABLE_REINIT_ON_WAKE})
    worker.sleep(1)
    worker.wake_up()
    assert (worker.model_runner.kv_cache.block_tables.block_table_ptrs.cpu() == -1).all()


@pytest.mark.parametrize("level", [1, 2])
def test_weights_survive_sleep(device, level) -> None:
    worker = _worker(device)
    before = worker.model_runner.model.embed.clone()
    worker.sleep(level)
    worker.wake_up()
    assert torch.equal(worker.model_runner.model.embed, before)


def test_bad_sleep_level(device) -> None:
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        _worker(device).sleep(3)


def test_the_runner_lives_in_the_workers_pools(device) -> None:
    worker = _worker(device)
    runner = worker.model_runner
    assert runner.pools is worker.pools
    assert ModelRunner(runner_config(device)).pools is not worker.pools
