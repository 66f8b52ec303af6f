"""Prefix caching in the KV cache (chained block hashes, hits taken from the free lists,
eviction when a cached block is taken again, a reset refused while blocks are held) and the
worker's sleep that resets it: the mechanism of vLLM #22726, fixed and buggy."""

from __future__ import annotations

import pytest

from harness.fixes import ALL_FIXES, Fix
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.kv_cache import KVCache, block_hashes
from harness.runner.model_runner import runner_config
from harness.runner.worker import Worker

pytestmark = pytest.mark.sleep_prefix_cache

PROMPT = list(range(1, 12))  # 11 tokens: two whole blocks of 4, one of 8


def _worker(device, fixes=ALL_FIXES) -> Worker:
    config = runner_config(
        device,
        fixes,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.NONE,
        block_sizes=(4, 8),
        max_model_len=16,
        enable_prefix_caching=True,
    )
    return Worker(config)


def _serve(kv: KVCache, row: int, prompt: list[int]) -> int:
    """Allocate a new request's blocks as generate() does (no forward), then finish it."""
    hit = kv.get_computed_blocks(row, prompt)
    kv.ensure_blocks(row, len(prompt), prompt[hit:])
    kv.free(row)
    return hit


def test_block_hashes_chain_the_prefix() -> None:
    a, b = block_hashes([1, 2, 3, 4, 5, 6], 2), block_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and block_hashes([1, 2, 3, 4, 5], 2) == a[:2]
    assert all(x != y for x, y in zip(a, b, strict=True)), "equal blocks after another prefix"


def test_a_repeated_prompt_hits_whole_blocks_of_every_group(device) -> None:
    kv = _worker(device).model_runner.kv_cache
    assert _serve(kv, 0, PROMPT) == 0
    cached = dict(kv.cached[0]), dict(kv.cached[1])
    assert (len(cached[0]), len(cached[1])) == (2, 1), "the partial last blocks are not cached"
    kv.take_new_block_ids()
    hit = kv.get_computed_blocks(0, PROMPT)
    assert hit == 8 and kv.take_new_block_ids() == [[], []], "hits are not new blocks"
    assert kv.blocks[0] == [list(cached[0].values()), list(cached[1].values())]
    assert not set(kv.blocks[0][0]) & set(kv.free_lists[0]), "hits must leave the free list"
    kv.free(0)
    # the last token is always computed, and a hit is whole blocks of both sizes (8 tokens)
    assert kv.get_computed_blocks(1, PROMPT[:8]) == 0 and kv.get_computed_blocks(3, PROMPT[:9]) == 8
    assert kv.get_computed_blocks(2, [5, *PROMPT[1:]]) == 0, "another first block: no hit"


def test_a_cached_block_leaves_the_cache_when_taken_again(device) -> None:
    kv = _worker(device).model_runner.kv_cache
    _serve(kv, 0, PROMPT)
    kv.free_lists[1][:] = kv.free_lists[1][:1] + list(kv.cached[1].values())  # it is next
    kv.ensure_blocks(1, 1, [60])
    assert not kv.cached[1] and kv.get_computed_blocks(2, PROMPT) == 0


def test_the_reset_is_refused_while_a_request_holds_blocks(device) -> None:
    kv = _worker(device).model_runner.kv_cache
    _serve(kv, 0, PROMPT)
    kv.ensure_blocks(1, 3, [7, 7, 7])
    assert kv.reset_prefix_cache() is False and kv.cached[0]
    kv.free(1)
    assert kv.reset_prefix_cache() is True and not any(kv.cached) and not any(kv.block_hash)


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "buggy"])
def test_sleep_resets_the_prefix_cache(device, level, fixed) -> None:
    worker = _worker(device, ALL_FIXES if fixed else ALL_FIXES - {Fix.RESET_PREFIX_CACHE_ON_SLEEP})
    kv = worker.model_runner.kv_cache
    _serve(kv, 0, PROMPT)
    worker.sleep(level)
    worker.wake_up()
    assert kv.get_computed_blocks(0, PROMPT) == (0 if fixed else 8)
    if not fixed:  # the hit's blocks hold what the wake left: 0xFF, NaN K/V
        assert kv.k_caches[0][kv.blocks[0][0]].isnan().all()
