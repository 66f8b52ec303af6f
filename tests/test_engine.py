"""The engine core's pause and wake (vLLM #44483): is_sleeping until every tag is awake, no
resume after a partial wake, and no dummy batch of an idle data-parallel rank while asleep.

Runs that would touch sleeping memory happen in children (tests/test_regressions.py); here a
worker that records its dummy batches instead of running them shows where the loop would."""

from __future__ import annotations

import pytest

from harness.fixes import ALL_FIXES, Fix
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.engine import EngineCore, EngineStep
from harness.runner.model_runner import RunnerConfig, runner_config
from harness.runner.worker import Worker

pytestmark = pytest.mark.partial_wake_forward

BUGGY = ALL_FIXES - {Fix.FULLY_AWAKE_GATE}


def _config(device, fixes) -> RunnerConfig:
    return runner_config(
        device, fixes, cudagraph_mode=CUDAGraphMode.NONE, enable_lora=False, max_model_len=8
    )


class RecordingWorker(Worker):
    """A worker whose dummy batch records whether the worker slept, and runs nothing."""

    def __init__(self, config: RunnerConfig) -> None:
        super().__init__(config)
        self.dummy_batches: list[bool] = []  # is_sleeping at each

    def execute_dummy_batch(self):
        self.dummy_batches.append(self.is_sleeping)


@pytest.mark.parametrize("order", [["weights", "kv_cache"], ["kv_cache", "weights"]])
def test_is_sleeping_until_every_tag_wakes(device, order) -> None:
    worker = Worker(_config(device, ALL_FIXES))
    assert not worker.is_sleeping
    worker.sleep(1)
    worker.wake_up([order[0]])
    assert worker.is_sleeping and worker.sleeping_tags == {order[1]}
    worker.wake_up([order[1]])
    assert not worker.is_sleeping


def test_a_partial_wake_keeps_the_request_waiting(device) -> None:
    engine = EngineCore(Worker(_config(device, ALL_FIXES)))
    engine.sleep(1)
    engine.wake_up(["weights"])
    engine.add_request([1, 2, 3])
    assert engine.paused and engine.step() is None and engine.waiting == [(1, 2, 3)]
    engine.wake_up(["kv_cache"])
    ran = engine.step()
    assert not engine.paused and isinstance(ran, EngineStep)
    assert [q.token_ids for q in ran.requests] == [(1, 2, 3)] and not engine.waiting


def test_without_the_fix_a_partial_wake_resumes(device) -> None:
    engine = EngineCore(Worker(_config(device, BUGGY)))
    engine.sleep(1)
    engine.wake_up(["weights"])  # NOTE: the KV cache sleeps: do not step with a request here
    assert not engine.paused and engine.worker.is_sleeping


def test_sleep_level_0_pauses_only(device) -> None:
    engine = EngineCore(Worker(_config(device, ALL_FIXES)))
    engine.sleep(0)
    assert engine.paused and not engine.worker.is_sleeping
    engine.wake_up()
    assert not engine.paused


@pytest.mark.parametrize(("fixes", "expected"), [(ALL_FIXES, []), (BUGGY, [True, True, True])])
def test_an_idle_dp_rank_runs_no_dummy_batch_while_asleep(device, fixes, expected) -> None:
    worker = RecordingWorker(_config(device, fixes))
    engine = EngineCore(worker, idle_dp_rank=True)
    engine.step()
    engine.sleep(1)  # its consensus iteration runs before the memory is released
    assert worker.dummy_batches == [False, False]
    engine.wake_up(["weights"])
    engine.step()
    engine.step()
    engine.sleep(0)  # paused again while asleep: the consensus kicks the loop
    assert worker.dummy_batches[2:] == expected
    engine.wake_up(["kv_cache"])
    engine.step()
    assert worker.dummy_batches[-1] is False and len(worker.dummy_batches) == len(expected) + 3
