"""A FlashMLA-style decode attention backend whose split-KV schedule is planned lazily, and the
decode steps the graph manager captures with it.

NOTE: the schedule object starts empty; the first forward that uses it allocates the plan and
launches the planner (reading the live seq_lens), later forwards reuse the plan. Reuse is valid
only while the lengths are unchanged, and nothing checks that (upstream's contract).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.fixes import Variant
from harness.runner.cudagraph import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    CUDAGraphMode,
    Launcher,
)
from harness.runner.kv_cache import KVCache
from harness.runner.sleep_mode import make_pools
from kernels.split_kv_attention import combine_splits, plan_schedule, split_kv_attention


@dataclass
class FlashMLASchedMeta:
    """The attention state a forward function carries (upstream's name)."""

    tile_scheduler_metadata: torch.Tensor | None = None  # [num_parts, 4] int32
    num_splits: torch.Tensor | None = None  # [num_reqs] int32


@dataclass(frozen=True, slots=True)
class DecodeShape:
    num_reqs: int = 4
    num_heads: int = 2
    head_dim: int = 16
    block_size: int = 4
    num_blocks: int = 64
    max_model_len: int = 48
    num_parts: int = 4  # planner partitions; a power of two


class FlashMLABackend:
    def __init__(self, shape: DecodeShape, device: str) -> None:
        self.shape, self.device = shape, device
        # NOTE: persistent: captured graphs read the live lengths from this buffer
        self.seq_lens = torch.zeros(shape.num_reqs, dtype=torch.int32, device=device)

    def build_metadata(self, seq_lens: list[int]) -> None:
        """Write this step's lengths in place (same address every step)."""
        self.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))

    def forward(
        self, state: FlashMLASchedMeta, query, k_cache, v_cache, block_table, out, launch: Launcher
    ) -> None:
        s = self.shape
        if state.tile_scheduler_metadata is None:  # lazy: plan on first use
            state.tile_scheduler_metadata = torch.empty(
                s.num_parts, 4, dtype=torch.int32, device=self.device
            )
            state.num_splits = torch.empty(s.num_reqs, dtype=torch.int32, device=self.device)
            launch(plan_schedule, self.seq_lens, state.tile_scheduler_metadata, state.num_splits)
        partial_out = torch.empty(s.num_parts, *query.shape, device=self.device)
        partial_lse = torch.empty(s.num_parts, *query.shape[:2], device=self.device)
        launch(
            split_kv_attention,
            query,
            k_cache,
            v_cache,
            block_table,
            self.seq_lens,
            state.tile_scheduler_metadata,
            partial_out,
            partial_lse,
            s.head_dim**-0.5,
            s.max_model_len,
        )
        launch(combine_splits, partial_out, partial_lse, out)


class DecodeAttention:
    """Decode steps of one attention layer over a seeded paged KV cache, eager or replayed."""

    def __init__(
        self, device: str, fixes: Variant, shape: DecodeShape = DecodeShape(), seed: int = 0
    ) -> None:
        self.device, self.shape = device, shape
        s, gen = shape, torch.Generator().manual_seed(seed)
        self.kv = KVCache(
            (s.block_size,),
            s.num_blocks,
            s.num_heads,
            s.head_dim,
            s.num_reqs,
            s.num_reqs,
            s.max_model_len,
            make_pools(device),
            seed,
        )
        for cache in (*self.kv.k_caches, *self.kv.v_caches):
            cache.copy_(torch.randn(cache.shape, generator=gen))
        self.backend = FlashMLABackend(shape, device)
        self.launch = Launcher()
        self.graphs = CudaGraphManager(device, self.launch, fixes)
        self.query = torch.zeros(s.num_reqs, s.num_heads, s.head_dim, device=device)
        self.out = torch.zeros_like(self.query)
        self.rows = torch.arange(s.num_reqs, dtype=torch.int32, device=device)
        self.desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, s.num_reqs, s.num_reqs)

    def prepare(self, seq_lens: list[int], seed: int) -> None:
        """Blocks, block table, lengths and queries of a step, all written in place."""
        self.kv.reset()
        for row, length in enumerate(seq_lens):
            self.kv.ensure_blocks(row, length)
        self.block_table = self.kv.block_tables.gather_block_tables(self.rows)[0]
        self.backend.build_metadata(seq_lens)
        gen = torch.Generator().manual_seed(seed)
        self.query.copy_(torch.randn(self.query.shape, generator=gen))

    def create_forward_fn(self, desc: BatchExecutionDescriptor):
        state = FlashMLASchedMeta()

        def forward_fn(mode: CUDAGraphMode) -> torch.Tensor:
            self.backend.forward(
                state,
                self.query,
                self.kv.k_caches[0],
                self.kv.v_caches[0],
                self.block_table,
                self.out,
                self.launch,
            )
            return self.out

        return forward_fn, state

    def capture(self, warmup_lens: list[int]) -> None:
        """Warm up and capture with dummy lengths, as a runner does at start."""
        self.prepare(warmup_lens, seed=0)
        self.graphs.capture([self.desc], self.create_forward_fn)

    def replay(self, seq_lens: list[int], seed: int) -> torch.Tensor:
        self.prepare(seq_lens, seed)
        return self.graphs.run_fullgraph(self.desc).clone()

    def eager(self, seq_lens: list[int], seed: int) -> torch.Tensor:
        """A step with a fresh schedule (planned for these lengths)."""
        self.prepare(seq_lens, seed)
        forward_fn, _ = self.create_forward_fn(self.desc)
        return forward_fn(CUDAGraphMode.NONE).clone()
