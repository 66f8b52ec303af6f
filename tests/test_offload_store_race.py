"""A CPU tier of the KV cache and its stores (vLLM #46278): the late compute stream of the stream
model, what the tier holds after a step fixed and buggy, its hits and loads."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.oracle import close
from harness.reference import recomputed_logits
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.streams import Streams

pytestmark = pytest.mark.offload_store_race

BUGGY = ALL_FIXES - {Fix.OFFLOAD_STORE_WAIT_COMPUTE}
VARIANTS = pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
OLD, NEW = 1, 2
PROMPT = tuple(range(3, 12))  # 9 tokens: two whole blocks of 4


def _late_main_store(device: str, wait: bool) -> list[int]:
    """A main-stream write, then a copy of its target on the copy stream (after the main
    stream's event when `wait`); the main stream runs late."""
    streams = Streams(device, delay=True, late="main")
    src = torch.full((3,), OLD, device=device)
    dst = streams.pinned(torch.zeros(3, dtype=src.dtype))
    streams.on_main(None, src.fill_, NEW)
    copied = streams.copy_after(streams.record_main() if wait else None, dst, src)
    streams.record_main().synchronize()  # the host waits for the main stream's output
    copied.synchronize()
    return dst.tolist()


@pytest.mark.parametrize("dev", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_late_main_stream_loses_to_a_copy_that_waits_for_nothing(dev) -> None:
    assert _late_main_store(dev, wait=False) == [OLD] * 3
    assert _late_main_store(dev, wait=True) == [NEW] * 3


def test_late_takes_copy_or_main() -> None:
    with pytest.raises(ValueError, match="late"):
        Streams("cpu", True, late="host")


def _runner(device, fixes, **flat) -> ModelRunner:
    config = runner_config(
        device,
        fixes,
        **{
            "block_sizes": (4, 4),
            "cpu_offload_blocks": 8,
            "stream_delay": True,
            "cudagraph_mode": CUDAGraphMode.NONE,
            "enable_lora": False,
            "max_model_len": 16,
            **flat,
        },
    )
    return ModelRunner(config)


def _store(runner: ModelRunner, prompt=PROMPT) -> None:
    """`prompt` prefilled in row 0; the host waits for its stores; the row is freed."""
    runner.execute_model([Request("a", prompt)], use_cudagraph=False)
    runner.offload.finish_stores()
    runner.kv_cache.free(0)


def test_the_tier_needs_one_block_size(device) -> None:
    with pytest.raises(ValueError, match="one block size"):
        _runner(device, ALL_FIXES, block_sizes=(4, 16))


@VARIANTS
def test_the_tier_holds_the_blocks_the_step_wrote_or_what_they_held(device, fixes) -> None:
    runner = _runner(device, fixes)
    kv, tier = runner.kv_cache, runner.offload
    runner.execute_model([Request("a", PROMPT)], use_cudagraph=False)
    tier.finish_stores()
    hashes = tier.hashes(PROMPT)
    assert len(hashes) == 2 and set(tier.cached) == set(hashes)
    for g in range(2):
        host = [tier.cached[h] for h in hashes]
        device_k = kv.k_caches[g][kv.blocks[0][g][:2]]
        assert device_k.abs().sum() > 0, "the step wrote its blocks"
        held = tier.k[g][host].to(device_k.device)
        if fixes == ALL_FIXES:
            assert torch.equal(held, device_k)
        else:
            assert not held.any(), "the store ran before the writes: a fresh block's zeros"


@VARIANTS
def test_without_the_delay_the_host_order_wins_on_the_cpu(device, fixes) -> None:
    """The compute stream on time: the forward ran when the stores are issued."""
    if device == "cuda":
        pytest.skip("on a GPU without the delay the race is real: either order")
    runner = _runner(device, fixes, stream_delay=False)
    _store(runner)
    tier = runner.offload
    assert tier.k[0][tier.cached[tier.hashes(PROMPT)[0]]].abs().sum() > 0


def test_a_hit_loads_whole_blocks_and_never_the_last_token(device) -> None:
    runner = _runner(device, ALL_FIXES)
    _store(runner)
    tier, kv = runner.offload, runner.kv_cache
    assert tier.get_computed_blocks(0, PROMPT[:8]) == 4, "the last token is computed"
    kv.free(0)
    assert tier.get_computed_blocks(0, (*PROMPT[:8], 40)) == 8
    assert [len(ids) for ids in kv.blocks[0]] == [2, 2]
    kv.free(0)
    assert tier.get_computed_blocks(0, (PROMPT[0] + 1, *PROMPT[1:])) == 0, "another prefix"


@VARIANTS
def test_a_hit_on_stored_blocks(device, fixes) -> None:
    """The prompt's two blocks stored, then a request sharing them computes from token 8."""
    runner = _runner(device, fixes)
    _store(runner)
    shared = (*PROMPT[:8], 40, 41)
    n = runner.offload.get_computed_blocks(0, shared)
    out = runner.execute_model([Request("c", shared[n:], 0, n)], use_cudagraph=False)
    problem = close("logits", out.logits, recomputed_logits(runner, [list(shared)]))
    assert n == 8 and (problem is None) == (fixes == ALL_FIXES), problem


@VARIANTS
def test_deferred_stores_after_the_host_waited_pass_either_way(device, fixes) -> None:
    """Stores deferred to the next step's start (#31341): the host waited for the step's
    output, so the writes are done; they reach the tier only with that step."""
    runner = _runner(device, fixes, offload_store_next_step=True)
    tier = runner.offload
    logits = runner.execute_model([Request("a", PROMPT)], use_cudagraph=False).logits
    tier.finish_stores()
    assert not tier.cached, "deferred: nothing issued yet"
    token = int(logits.argmax(-1)[0])
    runner.execute_model([Request("a", (token,), 0, len(PROMPT))], use_cudagraph=False)
    tier.finish_stores()
    block = runner.kv_cache.blocks[0][0][0]
    held = tier.k[0][tier.cached[tier.hashes(PROMPT)[0]]]
    assert torch.equal(
        held.to(runner.kv_cache.k_caches[0].device), runner.kv_cache.k_caches[0][block]
    )


@VARIANTS
def test_deferred_stores_with_the_host_a_step_ahead(device, fixes) -> None:
    """Async scheduling's overlap: the next step starts (and issues the deferred stores)
    before the host waited for the step that writes the blocks: only the fix's wait orders
    the copy after the writes."""
    runner = _runner(device, fixes, offload_store_next_step=True, offload_host_ahead=True)
    tier, kv = runner.offload, runner.kv_cache
    runner.execute_model([Request("a", PROMPT)], use_cudagraph=False)
    assert tier.last is not None, "the host went on without waiting"
    runner.execute_model([Request("a", (0,), 0, len(PROMPT))], use_cudagraph=False)
    tier.synchronize()
    tier.finish_stores()
    block = kv.blocks[0][0][0]
    held = tier.k[0][tier.cached[tier.hashes(PROMPT)[0]]].to(kv.k_caches[0].device)
    assert kv.k_caches[0][block].abs().sum() > 0
    assert torch.equal(held, kv.k_caches[0][block]) == (fixes == ALL_FIXES)


def test_a_launcher_with_a_queue_hands_its_launches_over(device) -> None:
    """What the CPU tier's steps rely on: launches bound to their tensors' storages, run when
    the queue runs them."""
    from harness.runner.cudagraph import Launcher

    launch, queued = Launcher(), []
    x = torch.zeros(3, device=device)
    launch.queue = queued.append
    launch(x.fill_, 1.0)
    assert x.tolist() == [0.0] * 3 and len(queued) == 1
    launch.queue = None
    queued[0]()
    assert x.tolist() == [1.0] * 3
