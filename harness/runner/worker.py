"""The worker: owns the tagged memory pools and the runner; sleep and wake_up as upstream's.

sleep(1): back up weights to host memory, discard the KV cache. sleep(2): discard both; the
weights are reloaded at wake, and the model's buffers (no checkpoint parameters) are saved to
host memory first and restored when the weights wake (vLLM #16889). wake_up(tags) wakes the
tags (all when None) and, when the kv_cache pool woke, calls the runner's
post_kv_cache_wake_up(). `is_sleeping` stays true until every tag is awake again (upstream: the
executor's sleeping tags). execute_model and execute_dummy_batch are the engine's two ways into
a forward (harness/runner/engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.fixes import Fix
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelOutput, ModelRunner, RunnerConfig
from harness.runner.sleep_mode import TAGS, make_pools


class Worker:
    def __init__(self, config: RunnerConfig) -> None:
        self.pools = make_pools(config.device)
        self.model_runner = ModelRunner(config, self.pools)
        self.fixes = config.fixes
        self.sleep_level = 0
        self.sleeping_tags: set[str] = set()
        self._sleep_saved_buffers: dict[str, torch.Tensor] = {}

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if Fix.RESET_PREFIX_CACHE_ON_SLEEP in self.fixes:
            # fix: reset_prefix_cache_on_sleep -- every level discards what cached blocks hold.
            self.model_runner.kv_cache.reset_prefix_cache()
        if level == 2 and Fix.SLEEP_SAVED_BUFFERS in self.fixes:
            # fix: sleep_saved_buffers -- level 2 keeps no copy of the weights pool, and the
            # reload at wake writes checkpoint parameters only
            buffers = self.model_runner.model.named_buffers()
            self._sleep_saved_buffers = {n: b.cpu().clone() for n, b in buffers.items()}
        self.pools.sleep(offload_tags=("weights",) if level == 1 else ())
        self.sleep_level = level
        self.sleeping_tags = set(TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.pools.wake_up(tags)
        if self.sleep_level == 2 and (tags is None or "weights" in tags):
            self.model_runner.reload_weights()
        if tags is None or "kv_cache" in tags:
            self.model_runner.post_kv_cache_wake_up()
        if Fix.SLEEP_SAVED_BUFFERS in self.fixes and (tags is None or "weights" in tags):
            # fix: sleep_saved_buffers -- restored only where the weights pool is mapped again
            buffers = self.model_runner.model.named_buffers()
            for name, saved in self._sleep_saved_buffers.items():
                buffers[name].copy_(saved)
            self._sleep_saved_buffers = {}
        self.sleeping_tags -= set(TAGS if tags is None else tags)

    def execute_model(self, requests: list[Request]) -> ModelOutput:
        return self.model_runner.execute_model(requests, use_cudagraph=False)

    def execute_dummy_batch(self) -> ModelOutput:
        """What an idle data-parallel rank runs to stay in step with its peers: a one-token
        dummy decode."""
        return self.model_runner.execute_model(dummy_run=True, num_tokens=1, num_reqs=1)
