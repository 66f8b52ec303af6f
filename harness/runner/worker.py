"""The worker: owns the tagged memory pools and the runner; sleep and wake_up as upstream's.

sleep(1): back up weights to host memory, discard the KV cache. sleep(2): discard both; the
weights are reloaded at wake. wake_up(tags) wakes the tags (all when None) and, when the
kv_cache pool woke, calls the runner's post_kv_cache_wake_up().
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.fixes import Fix
from harness.runner.model_runner import ModelRunner, RunnerConfig
from harness.runner.sleep_mode import make_pools


class Worker:
    def __init__(self, config: RunnerConfig) -> None:
        self.pools = make_pools(config.device)
        self.model_runner = ModelRunner(config, self.pools)
        self.sleep_level = 0

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if Fix.RESET_PREFIX_CACHE_ON_SLEEP in self.model_runner.fixes:
            # fix: reset_prefix_cache_on_sleep -- every level discards what cached blocks hold.
            self.model_runner.kv_cache.reset_prefix_cache()
        self.pools.sleep(offload_tags=("weights",) if level == 1 else ())
        self.sleep_level = level

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.pools.wake_up(tags)
        if self.sleep_level == 2 and (tags is None or "weights" in tags):
            self.model_runner.reload_weights()
        if tags is None or "kv_cache" in tags:
            self.model_runner.post_kv_cache_wake_up()
