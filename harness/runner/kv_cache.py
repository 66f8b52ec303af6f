"""The paged KV cache of every group, its block tables and block allocation (free lists, prefix
caching, a hybrid runner's state blocks), in the kv_cache memory pool; and the attention
metadata of one step.

NOTE: a freed block keeps its bytes, and its prefix-cache entry, until it is taken again: the
next tenant reads whatever it does not overwrite (vLLM #35219), and a cache hit reads whatever
the block holds now (after a sleep: the wake's poison, vLLM #22726).

NOTE: with a sliding window, or in a hybrid runner, block 0 of every group is the null block
(upstream's BlockPool null_block, which every runner reserves): never a request's. A dummy run's
table entries name it: a hybrid runner's decode reads its whole pages, so one of a request's state
blocks there would read as NaN (its int32 -1). With a window it is also the entry of every block
freed because it left the window, and holds NaN (poison): a position read through it shows.
Other runners still hand it out (their dummy runs read no page past their positions); reserving
it there too moves every seeded allocation, the scenarios' included.

NOTE: the metadata of a step is views of persistent buffers (input buffers, block tables, slot
mappings), refreshed in place every step: a captured graph, and the attention a PIECEWISE
graph runs eagerly between its pieces, read the live step through them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from harness.runner.block_table import BlockTables, run_now
from harness.runner.input_batch import InputBatch
from harness.runner.mamba import state_pages
from harness.runner.sleep_mode import TaggedPools

TAG = "kv_cache"
NULL_BLOCK = 0  # reserved with a window or in a hybrid runner (see above)


@dataclass(eq=False)
class AttentionMetadata:
    """One step's KV-cache view (batch rows and tokens, padding included)."""

    k_caches: list[torch.Tensor]  # per group [num_kernel_blocks, kernel_block_size, heads, dim]
    v_caches: list[torch.Tensor]
    slot_mappings: torch.Tensor  # [num_groups, num_tokens] int64, -1 for padding
    block_tables: list[torch.Tensor]  # per group [num_reqs, max_num_blocks] int32
    token_rows: torch.Tensor  # [num_tokens] int32, batch row of each token
    positions: torch.Tensor  # [num_tokens] int64
    seq_lens: torch.Tensor  # [num_reqs] int32
    max_model_len: int
    uniform_decode: bool  # one token per request: the split-KV decode backend may serve it
    sched: object | None = None  # the decode backend's lazily planned state (flashmla.py)
    num_actual_tokens: int | None = None  # the tokens attention computes, padding excluded
    block_sizes: tuple[int, ...] = ()  # per group, what the builder tells attention a block is
    window: int = 0  # the sliding window (tokens), 0: none


class KVCache:
    def __init__(
        self,
        block_sizes: tuple[int, ...],
        num_blocks: int,
        num_heads: int,
        head_dim: int,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        pools: TaggedPools,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        prefix_caching: bool = False,
        hybrid: bool = False,  # a state group shares group 0's blocks (mamba.py)
        kernel_block_sizes: tuple[int, ...] = (),  # per group, dividing block_sizes (default: =)
        builder_block_sizes: tuple[int, ...] = (),  # per group, told to attention (default: =)
        sliding_window: int = 0,  # every group's attention sees the last `sliding_window` tokens
    ) -> None:
        self.block_sizes, self.num_blocks = block_sizes, num_blocks
        self.kernel_block_sizes = kernel_block_sizes or block_sizes
        self.builder_block_sizes = builder_block_sizes or self.kernel_block_sizes
        pairs = list(zip(block_sizes, self.kernel_block_sizes, strict=True))
        if any(m % k for m, k in pairs):
            raise ValueError(f"kernel blocks {self.kernel_block_sizes} do not divide {block_sizes}")
        per = [m // k for m, k in pairs]  # kernel blocks per manager block
        self.max_model_len, self.seed = max_model_len, seed
        self.prefix_caching, self.hybrid = prefix_caching, hybrid
        self.sliding_window = sliding_window
        shape = lambda size: (num_blocks, size, num_heads, head_dim)
        self.k_caches = [pools.zeros(TAG, shape(size), dtype) for size in block_sizes]
        self.v_caches = [pools.zeros(TAG, shape(size), dtype) for size in block_sizes]
        self.state_pages = state_pages(self.v_caches[0]) if hybrid else None
        self.block_tables = BlockTables(
            self.kernel_block_sizes, max_num_reqs, max_num_tokens, max_model_len, pools, per
        )
        self.reset()
        if sliding_window:
            for cache in (*self.k_caches, *self.v_caches):
                cache[NULL_BLOCK] = float("nan")

    def reset(self) -> None:
        """Forget every request and every cached block; blocks are handed out in a seeded
        order."""
        gen = torch.Generator().manual_seed(self.seed)
        # NOTE: a free list is a queue whose head is its end (allocation pops there) and whose
        # tail is its start: a freed block queues up behind every free one (upstream's
        # FreeKVCacheBlockQueue), so blocks are reused least recently freed first
        self.free_lists = [
            torch.randperm(self.num_blocks, generator=gen).tolist() for _ in self.block_sizes
        ]
        if self.sliding_window or self.hybrid:
            self.free_lists = [[b for b in ids if b != NULL_BLOCK] for ids in self.free_lists]
        self.blocks: dict[int, list[list[int]]] = {}  # row -> each group's block ids
        self.state_blocks: dict[int, int] = {}  # row -> its state block, one of group 0's
        self.tokens: dict[int, list[int]] = {}  # row -> its token ids from position 0
        self.cached: list[dict[int, int]] = [{} for _ in self.block_sizes]  # hash -> block
        self.block_hash: list[dict[int, int]] = [{} for _ in self.block_sizes]  # block -> hash
        self.new_block_ids: list[list[int]] = [[] for _ in self.block_sizes]
        self.running: set[int] = set()  # rows whose request has run a step since it was given
        # row -> the slots past its tokens a drafter writes in the step (the scheduler's count)
        self.lookahead: dict[int, int] = {}

    def free(self, row: int) -> None:
        """Request row `row` finished: its blocks queue up at the free lists' tails, each
        group's last block first (upstream's order), its state block after them; cached blocks
        stay in the prefix cache until they are taken again."""
        for g, ids in enumerate(self.blocks.pop(row, [])):
            self.free_lists[g][:0] = [b for b in ids if not self._null(b)]
        if row in self.state_blocks:
            self.free_lists[0][:0] = [self.state_blocks.pop(row)]
        self.tokens.pop(row, None)
        self.running.discard(row)

    def first_step(self, row: int) -> bool:
        """Whether the request in row `row` has run no step yet (upstream: scheduled from the
        waiting queue, its num_computed_tokens still 0, prefix hit or not)."""
        return row not in self.running

    def _null(self, block: int) -> bool:
        return bool(self.sliding_window or self.hybrid) and block == NULL_BLOCK

    def remove_skipped_blocks(self, row: int, num_computed_tokens: int) -> None:
        """Free the row's blocks wholly before the window of position `num_computed_tokens`
        (the next one computed): their entries become the null block (upstream:
        SlidingWindowManager.remove_skipped_blocks)."""
        skipped = max(0, num_computed_tokens - self.sliding_window + 1)
        for g, size in enumerate(self.block_sizes):
            owned = self.blocks.get(row, [[] for _ in self.block_sizes])[g]
            for i in range(min(skipped // size, len(owned))):
                if not self._null(owned[i]):
                    self.free_lists[g][:0] = [owned[i]]
                    owned[i] = NULL_BLOCK

    def swap_rows(self, i: int, j: int) -> None:
        """Requests in rows i and j trade places (a batch reordered by swaps): their blocks,
        state block and tokens move with them (the device tables follow in ensure_blocks)."""
        for table in (self.blocks, self.state_blocks, self.tokens):
            held = {row: table.pop(row) for row in (i, j) if row in table}
            table.update({j if row == i else i: value for row, value in held.items()})
        ran = {j if row == i else i for row in (i, j) if row in self.running}
        self.running = (self.running - {i, j}) | ran

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while a request holds blocks, as
        upstream's (vLLM #12284)."""
        if self.blocks:
            return False
        for table in (*self.cached, *self.block_hash):
            table.clear()
        return True

    def get_computed_blocks(self, row: int, token_ids: Sequence[int]) -> int:
        """A new request in row `row`: the longest prefix of `token_ids` whose blocks every group
        has cached and free (whole blocks of every size, never the last token: it is computed)
        is taken for the row; returns its length (0 without prefix caching)."""
        if not self.prefix_caching:
            return 0
        runs = [self._cached_run(g, token_ids) for g in range(len(self.block_sizes))]
        sizes = self.block_sizes
        n = min(min(len(ids) * s for ids, s in zip(runs, sizes, strict=True)), len(token_ids) - 1)
        n -= n % math.lcm(*sizes)
        self.blocks[row] = [ids[: n // s] for ids, s in zip(runs, sizes, strict=True)]
        for g, ids in enumerate(self.blocks[row]):
            self.free_lists[g] = [b for b in self.free_lists[g] if b not in ids]
        self.tokens[row] = list(token_ids[:n])
        return n

    def _cached_run(self, group: int, token_ids: Sequence[int]) -> list[int]:
        """The cached free blocks of `group` holding token_ids' first whole blocks."""
        run = []
        for h in block_hashes(token_ids, self.block_sizes[group]):
            block = self.cached[group].get(h)
            if block is None or block not in self.free_lists[group]:  # held: no reference counts
                break
            run.append(block)
        return run

    def _take(self, group: int) -> int:
        """The head of `group`'s free list; a cached block leaves the prefix cache."""
        block = self.free_lists[group].pop()
        h = self.block_hash[group].pop(block, None)
        if h is not None:
            del self.cached[group][h]
        return block

    def take_new_block_ids(self) -> list[list[int]]:
        """Each group's blocks given to requests since the last call (upstream: the scheduler
        output's new_block_ids_to_zero; prefix-cache hits are not new)."""
        new, self.new_block_ids = self.new_block_ids, [[] for _ in self.block_sizes]
        return new

    def fill_random(self, seed: int) -> None:
        """Seeded K/V everywhere: the context of requests whose earlier steps are not run."""
        gen = torch.Generator().manual_seed(seed)
        for cache in (*self.k_caches, *self.v_caches):
            cache.copy_(torch.randn(cache.shape, generator=gen))

    def ensure_blocks(self, row: int, seq_len: int, token_ids: Sequence[int] = ()) -> None:
        """Enough blocks in every group for `seq_len` tokens of request row `row`, whose step
        schedules `token_ids` (the last ones), and its `lookahead` slots past them (a
        drafter's, within max_model_len); a hybrid runner's new request gets a state block
        first. With prefix caching the row's full blocks are cached."""
        if seq_len > self.max_model_len:
            raise ValueError(
                f"sequence of {seq_len} tokens over max_model_len {self.max_model_len}"
            )
        owned = self.blocks.setdefault(row, [[] for _ in self.block_sizes])
        self.running.add(row)
        if self.hybrid and row not in self.state_blocks:
            self.state_blocks[row] = self._take(0)
        slots = min(seq_len + self.lookahead.get(row, 0), self.max_model_len)
        for g, size in enumerate(self.block_sizes):
            while len(owned[g]) < triton.cdiv(slots, size):
                owned[g].append(self._take(g))
                self.new_block_ids[g].append(owned[g][-1])
        if self.prefix_caching:
            self._cache_full_blocks(row, seq_len, token_ids)
        self.block_tables.set_row(row, owned)

    def _cache_full_blocks(self, row: int, seq_len: int, token_ids: Sequence[int]) -> None:
        """Record the row's token ids; each full block becomes a prefix-cache entry (unless an
        equal block already is one)."""
        known, start = self.tokens.get(row, []), seq_len - len(token_ids)
        if len(known) < start:  # earlier tokens no step scheduled (a seeded context)
            return
        tokens = self.tokens[row] = known[:start] + list(token_ids)
        for g, size in enumerate(self.block_sizes):
            full = block_hashes(tokens, size)  # the last block may be partial: no hash
            for block, h in zip(self.blocks[row][g], full, strict=False):
                if h not in self.cached[g]:
                    self.cached[g][h], self.block_hash[g][block] = block, h

    def slot(self, group: int, row: int, position: int) -> int:
        """Where position `position` of request row `row` lives in group `group` (host side)."""
        size = self.block_sizes[group]
        return self.blocks[row][group][position // size] * size + position % size

    def metadata(self, batch: InputBatch, launch=None) -> AttentionMetadata:
        """The batch's block tables and slot mappings, gathered through the layout tensors; a
        dummy batch gets block 0 everywhere and no slot (nothing is written to the cache).
        With `launch` (a graph that gathers at every replay) the kernels go through it, a dummy
        batch's included: its buffers are the ones each replayed step refreshes."""
        tables = self.block_tables
        t, r = batch.num_tokens_after_padding, batch.num_reqs_after_padding
        run = launch or run_now
        run(torch.Tensor.fill_, tables.slot_mappings[:, :t], -1)
        if batch.is_dummy and launch is None:
            gathered = [table[:r].zero_() for table in tables.input_block_tables]
        else:
            gathered = tables.gather_block_tables(batch.idx_mapping, run)
            tables.compute_slot_mappings(
                batch.query_start_loc[: batch.num_reqs + 1], batch.positions, run
            )
        return AttentionMetadata(
            self.kernel_views(self.k_caches),
            self.kernel_views(self.v_caches),
            tables.slot_mappings[:, :t],
            gathered,
            batch.token_rows,
            batch.positions,
            batch.seq_lens,
            self.max_model_len,
            batch.uniform_decode,
            num_actual_tokens=batch.num_tokens,
            block_sizes=self.builder_block_sizes,
            window=self.sliding_window,
        )

    def kernel_views(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each group's cache as the attention kernel pages it: [num_blocks * blocks per
        manager block, kernel block size, ...] (the same memory, the same slots)."""
        if self.kernel_block_sizes == self.block_sizes:
            return caches
        return [
            cache.view(-1, size, *cache.shape[2:])
            for cache, size in zip(caches, self.kernel_block_sizes, strict=True)
        ]


def block_hashes(token_ids: Sequence[int], size: int) -> list[int]:
    """The hash of each whole block of `token_ids`, chained with its prefix's (upstream's block
    hash: the parent's hash and the block's token ids)."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - size + 1, size):
        parent = hash((parent, tuple(token_ids[start : start + size])))
        hashes.append(parent)
    return hashes
