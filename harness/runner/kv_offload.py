"""A CPU tier of the KV cache (upstream: SimpleCPUOffloadConnector, vllm/v1/simple_kv_offload):
host blocks (pinned on a GPU) keyed by block hash, filled from the device's blocks once a step
computed them and read back for a new request whose prefix the device no longer holds.

Every step's device work goes on the compute stream (streams.py's main stream: the runner's
launches are handed to it while the step's forward runs); the connector's copies on a side
stream (the copy stream). A store (device -> host) of the full blocks a step wrote is issued in
that step, once its forward is launched (upstream: get_finished), or with `store_next_step` at
the start of the next step (vLLM #31341's deferral); the host then waits for the step's output,
or with `host_ahead` (async scheduling's overlap) goes on and waits at the next step's start,
after its deferred stores are issued. The fix part of vLLM #46278 makes the side stream wait
for a compute-done event recorded after the step's KV writes; without it only the host's order
(the scheduler's word that the tokens are computed) stands between the writes and the copy,
and with RunnerConfig.scheduler.stream_delay the compute stream runs late (the device behind
the host), so the store copies what the blocks held before. A store's block becomes a hit once
its copy has finished (the host waits for pending stores before a lookup). A load (host ->
device) waits for the compute stream's earlier work and the step's forward waits for it.
NOTE: one block size for every KV-cache group: a block index names the same tokens in each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from harness.fixes import Fix, Variant
from harness.runner.cudagraph import Launcher
from harness.runner.kv_cache import KVCache, block_hashes
from harness.runner.streams import Event, Streams

# (group, device block, host block, block hash) of one store
Store = tuple[int, int, int, int]


class CPUOffloadConnector:
    def __init__(
        self,
        kv: KVCache,
        num_cpu_blocks: int,
        device: str,
        fixes: Variant,
        launch: Launcher,
        delay: bool = False,
        store_next_step: bool = False,
        host_ahead: bool = False,
    ) -> None:
        if len(set(kv.block_sizes)) != 1:
            raise ValueError(f"the CPU tier needs one block size, got {kv.block_sizes}")
        self.kv, self.fixes, self.launch = kv, fixes, launch
        self.store_next_step, self.host_ahead = store_next_step, host_ahead
        self.last: Event | None = None  # after the last step's launches
        self.size = kv.block_sizes[0]
        self.streams = Streams(device, delay, late="main")
        # NOTE: NaN until a store writes them: a load of a block never stored shows
        shape = lambda c: (num_cpu_blocks, *c.shape[1:])
        host = lambda c: self.streams.pinned(torch.full(shape(c), torch.nan, dtype=c.dtype))
        self.k = [host(c) for c in kv.k_caches]
        self.v = [host(c) for c in kv.v_caches]
        self.free_blocks = list(range(num_cpu_blocks))[::-1]  # allocation pops the end
        self.cached: dict[int, int] = {}  # block hash (every group's) -> host block
        self.pending: list[tuple[list[Store], Event]] = []  # issued, not known finished
        self.deferred: list[Store] = []  # store_next_step: the last step's, not issued
        self.known: set[int] = set()  # hashes stored or being stored
        self.tokens: dict[int, list[int]] = {}  # row -> its token ids from position 0
        self.loads: Event | None = None  # this step's loads: its forward waits for them

    # -- the scheduler's side -----------------------------------------------------------------

    def get_computed_blocks(self, row: int, token_ids: Sequence[int]) -> int:
        """A new request in row `row`: the device's prefix-cache hit (KVCache), then the
        following whole blocks the CPU tier holds, loaded into new device blocks; returns the
        tokens computed (never the last one)."""
        self.finish_stores()
        kv, n = self.kv, self.kv.get_computed_blocks(row, token_ids)
        owned = kv.blocks.setdefault(row, [[] for _ in kv.block_sizes])
        hashes = block_hashes(token_ids[: len(token_ids) - 1], self.size)
        for h in hashes[n // self.size :]:
            if h not in self.cached:
                break
            for g in range(len(kv.block_sizes)):
                block = kv._take(g)
                owned[g].append(block)
                for host, caches in ((self.k[g], kv.k_caches), (self.v[g], kv.v_caches)):
                    self.loads = self.streams.h2d(caches[g][block], host[self.cached[h]])
            n += self.size
        kv.tokens[row] = self.tokens[row] = list(token_ids[:n])
        return n

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The block hash of each whole block of `token_ids` (the tier's keys)."""
        return block_hashes(token_ids, self.size)

    def finish_stores(self) -> None:
        """The host waits for the stores issued so far; their blocks become hits."""
        for stores, event in self.pending:
            event.synchronize()
            for _, _, host, h in stores:
                self.cached[h] = host
        self.pending = []

    # -- the worker's side --------------------------------------------------------------------

    def start_step(self) -> None:
        """A step starts (before its inputs are prepared): the last step's deferred stores are
        issued, then the host waits for the last step if it has not (`host_ahead`: the
        runner's persistent buffers are that step's until then)."""
        self._issue(self.deferred)
        self.deferred = []
        if self.last is not None:
            self.last.synchronize()
            self.last = None

    def execute(self, forward: Callable[[], object], requests: Sequence) -> object:
        """The step: `forward`, its host code now and its launches on the compute stream after
        this step's loads; the stores of the blocks it fills (or deferred); then the host
        waits for its output, or with `host_ahead` goes on (async scheduling's overlap: the
        next step's start, or `synchronize`, waits). Returns `forward`'s output."""
        if self.loads is not None:
            self.streams.wait(self.streams.main, self.loads)
            self.loads = None
        self.launch.queue = self.streams.main.submit
        try:
            out = forward()
        finally:
            self.launch.queue = None
        stores = self._full_blocks(requests)
        if self.store_next_step:
            self.deferred = stores
        else:
            self._issue(stores)
        self.last = self.streams.record_main()
        if not self.host_ahead:  # the host waits for the step's output
            self.last.synchronize()
            self.last = None
        return out

    def synchronize(self) -> None:
        """The host waits for every step launched."""
        self.streams.record_main().synchronize()

    def _full_blocks(self, requests: Sequence) -> list[Store]:
        """The stores of every full block the step's requests hold that the tier lacks."""
        kv, stores = self.kv, []
        for row, q in enumerate(requests):
            tokens = self.tokens.get(row, [])[: q.num_computed_tokens] + list(q.token_ids)
            self.tokens[row] = tokens
            for i, h in enumerate(block_hashes(tokens, self.size)):
                if h in self.known or not self.free_blocks:
                    continue
                self.known.add(h)
                host = self.free_blocks.pop()
                stores += [(g, kv.blocks[row][g][i], host, h) for g in range(len(kv.block_sizes))]
        return stores

    def _issue(self, stores: list[Store]) -> None:
        """Device -> host copies of `stores` on the side stream."""
        if not stores:
            return
        if Fix.OFFLOAD_STORE_WAIT_COMPUTE in self.fixes:
            # fix: offload_store_wait_compute -- the step's KV writes may still be queued on
            # the compute stream: the side stream waits for an event recorded after them
            self.streams.wait(self.streams.copy, self.streams.record_main())
        event = None
        for g, block, host, _ in stores:
            for tier, caches in ((self.k[g], self.kv.k_caches), (self.v[g], self.kv.v_caches)):
                event = self.streams.copy_after(None, tier[host], caches[g][block])
        self.pending.append((stores, event))
