"""Post-load derived tensors across weight reloads (vLLM #48251): where they live, what a reload
does to them fixed and buggy, and what a graph captured before the reload replays."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.oracle import close
from harness.reference import step_reference
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model import ModelConfig
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.post_load import derive
from harness.runner.worker import Worker

pytestmark = pytest.mark.reload_derived_rebind

BUGGY = ALL_FIXES - {Fix.RELOAD_DERIVED_IN_PLACE}
VARIANTS = pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
PROMPTS = ([1, 2, 3], [7])


def _worker(device, fixes=ALL_FIXES, derived=True, mode=CUDAGraphMode.FULL) -> Worker:
    config = runner_config(
        device,
        fixes,
        model=ModelConfig(derived_weights=derived),
        cudagraph_mode=mode,
        cudagraph_sizes=(4,),
        enable_lora=False,
        max_model_len=8,
    )
    return Worker(config)


def _logits(runner: ModelRunner, graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' logits (a replay of the graph of 4, or eager) and their reference."""
    requests = [Request(f"r{i}", tuple(p)) for i, p in enumerate(PROMPTS)]
    out = runner.execute_model(requests, use_cudagraph=graph)
    assert (out.desc is not None) == graph
    logits = out.logits.clone()
    for row in range(len(requests)):
        runner.kv_cache.free(row)
    return logits, step_reference(runner, requests)[1]


def test_the_derived_tensors_live_in_the_weights_pool(device) -> None:
    worker = _worker(device)
    model = worker.model_runner.model
    expected = derive(model.head, model.embed)
    assert set(model.derived.tensors) == {"head_t", "embed_f32"}
    for name, t in model.derived.tensors.items():
        assert torch.equal(t, expected[name]), name
    assert model.derived.tensors["embed_f32"].dtype == torch.float32
    if device == "cpu":  # the arena of the weights tag holds them
        arena = worker.pools.arenas["weights"]
        start = arena.data_ptr()
        for t in model.derived.tensors.values():
            assert start <= t.data_ptr() < start + arena.numel()


@VARIANTS
def test_a_new_checkpoint_reaches_the_derived_tensors_in_place_or_rebound(device, fixes) -> None:
    """Both variants derive the new values; only the fix keeps their storage."""
    runner = _worker(device, fixes).model_runner
    model = runner.model
    before = {n: (t, t.data_ptr()) for n, t in model.derived.tensors.items()}
    runner.reload_weights(seed=1)
    assert model.checkpoint_seed == 1
    expected = derive(model.head, model.embed)
    for name, t in model.derived.tensors.items():
        assert torch.equal(t, expected[name]), f"{name}: the live tensor holds the new values"
        old, ptr = before[name]
        assert (t.data_ptr() == ptr) == (fixes == ALL_FIXES), name
        assert torch.equal(old, expected[name]) == (fixes == ALL_FIXES), name


def test_a_later_reload_writes_the_new_checkpoint_again(device) -> None:
    """A level-2 wake after an update reloads the update, not the first load's weights."""
    worker = _worker(device)
    model = worker.model_runner.model
    worker.model_runner.reload_weights(seed=1)
    head = model.head.clone()
    worker.sleep(2)
    worker.wake_up()
    assert torch.equal(model.head, head)


@VARIANTS
def test_eager_steps_read_the_reloaded_weights_either_way(device, fixes) -> None:
    runner = _worker(device, fixes, mode=CUDAGraphMode.NONE).model_runner
    runner.reload_weights(seed=1)
    logits, reference = _logits(runner, graph=False)
    assert close("eager logits", logits, reference) is None


@VARIANTS
def test_a_reload_of_the_same_values_hides_it_from_the_graph(device, fixes) -> None:
    runner = _worker(device, fixes).model_runner
    runner.capture_model()
    runner.reload_weights()
    logits, reference = _logits(runner, graph=True)
    assert close("graph logits", logits, reference) is None


@VARIANTS
def test_a_graph_captured_before_a_new_checkpoint(device, fixes) -> None:
    """Fixed: the replay reads the update. Buggy: the load's LM head and embedding table with
    the update's other weights."""
    runner = _worker(device, fixes).model_runner
    runner.capture_model()
    before, _ = _logits(runner, graph=True)
    runner.reload_weights(seed=1)
    logits, reference = _logits(runner, graph=True)
    if fixes == ALL_FIXES:
        assert close("graph logits", logits, reference) is None
    else:
        # the other parameters are reloaded in place: only the derived two are the load's
        assert close("graph logits", logits, reference) is not None
        assert not torch.equal(logits, before)


@VARIANTS
def test_a_level_2_wake_under_the_graph(device, fixes) -> None:
    """Fixed: the wake's reload writes the derived tensors in place. Buggy: the graph reads
    the woken pool's 0xFF bytes, NaN."""
    worker = _worker(device, fixes)
    runner = worker.model_runner
    runner.capture_model()
    worker.sleep(2)
    worker.wake_up()
    logits, reference = _logits(runner, graph=True)
    if fixes == ALL_FIXES:
        assert close("graph logits", logits, reference) is None
    else:
        assert logits.isnan().all()


def test_without_derived_weights_the_forward_reads_the_parameters(device) -> None:
    runner = _worker(device, derived=False).model_runner
    assert runner.model.derived is None
    runner.reload_weights(seed=1)  # no post-load processing to run
    logits, reference = _logits(runner, graph=False)
    assert close("eager logits", logits, reference) is None
