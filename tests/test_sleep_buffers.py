"""Level-2 sleep and the model's buffers (vLLM #16889): what the worker saves, when it restores,
and what a wake leaves without the fix."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model import ModelConfig
from harness.runner.model_runner import runner_config
from harness.runner.worker import Worker

pytestmark = pytest.mark.level2_sleep_state

SCALE = 3.0


def _worker(device, fixes=ALL_FIXES) -> Worker:
    config = runner_config(
        device,
        fixes,
        model=ModelConfig(embed_scale=SCALE),
        cudagraph_mode=CUDAGraphMode.NONE,
        enable_lora=False,
        max_model_len=8,
    )
    return Worker(config)


def _normalizer(worker: Worker) -> list[float]:
    return worker.model_runner.model.normalizer.tolist()


def test_the_normalizer_is_a_buffer_in_the_weights_pool(device) -> None:
    worker = _worker(device)
    model = worker.model_runner.model
    assert model.named_buffers() == {"normalizer": model.normalizer}
    if device == "cpu":  # the arena of the weights tag holds it
        arena = worker.pools.arenas["weights"]
        start = arena.data_ptr()
        assert start <= model.normalizer.data_ptr() < start + arena.numel()


@pytest.mark.parametrize("wakes", [[None], [["weights"], ["kv_cache"]]], ids=["all", "staged"])
def test_level_2_restores_the_buffers(device, wakes) -> None:
    worker = _worker(device)
    worker.sleep(2)
    assert set(worker._sleep_saved_buffers) == {"normalizer"}
    assert worker._sleep_saved_buffers["normalizer"].device.type == "cpu"
    for tags in wakes:
        worker.wake_up(tags)
    assert _normalizer(worker) == [SCALE] and not worker._sleep_saved_buffers


def test_a_kv_cache_first_wake_keeps_the_saved_buffers_for_the_weights(device) -> None:
    worker = _worker(device)
    worker.sleep(2)
    worker.wake_up(["kv_cache"])  # NOTE: the weights pool sleeps: do not read the buffer
    assert worker._sleep_saved_buffers["normalizer"].tolist() == [SCALE]
    worker.wake_up(["weights"])
    assert _normalizer(worker) == [SCALE] and not worker._sleep_saved_buffers


def test_level_1_saves_nothing(device) -> None:
    worker = _worker(device)
    worker.sleep(1)
    assert not worker._sleep_saved_buffers
    worker.wake_up()
    assert _normalizer(worker) == [SCALE]


def test_without_the_fix_the_reload_misses_the_buffer(device) -> None:
    worker = _worker(device, ALL_FIXES - {Fix.SLEEP_SAVED_BUFFERS})
    model = worker.model_runner.model
    embed = model.embed.clone()
    worker.sleep(2)
    assert not worker._sleep_saved_buffers
    worker.wake_up()
    assert torch.equal(model.embed, embed), "the checkpoint's parameters are reloaded"
    assert model.normalizer.isnan().all(), "the buffer holds the woken pool's 0xFF bytes"


def test_the_reference_reads_the_config_not_the_live_buffer(device) -> None:
    worker = _worker(device)
    runner = worker.model_runner
    requests = [Request("r0", (1, 2, 3))]
    runner.kv_cache.reset()
    logits = runner.execute_model(requests, use_cudagraph=False).logits.clone()
    expected = step_reference(runner, requests)[1]
    assert torch.allclose(logits.double().cpu(), expected, rtol=1e-4, atol=1e-3)
    runner.model.normalizer.fill_(float("nan"))
    assert torch.equal(step_reference(runner, requests)[1], expected)
