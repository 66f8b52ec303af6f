"""A FlashMLA-style split-KV decode backend whose schedule is planned lazily, and a speculator's
draft attention on the target's attention states.

NOTE: a schedule state starts empty; the first forward that uses it allocates the plan and
launches the planner (reading the live seq_lens), later forwards reuse the plan. Reuse is valid
only while the lengths are unchanged, and nothing checks that (upstream's contract). Eager
steps and the attention a PIECEWISE graph runs between its pieces get a fresh state per step; a
FULL graph holds the state it was captured with (vLLM #42444: it must be fresh at capture, so
that the planner is recorded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.fixes import Fix, Variant
from harness.runner.cudagraph import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    CUDAGraphMode,
    Launcher,
)
from kernels.split_kv_attention import combine_splits, plan_schedule, split_kv_attention


@dataclass(eq=False)
class FlashMLASchedMeta:
    """The attention state a forward function carries (upstream's name)."""

    tile_scheduler_metadata: torch.Tensor | None = None  # [num_parts, 4] int32
    num_splits: torch.Tensor | None = None  # [num_reqs] int32


class FlashMLABackend:
    def __init__(
        self, num_parts: int, max_model_len: int, device: str, page_loads: bool = False
    ) -> None:
        """`page_loads`: the split kernel loads whole KV pages (TRTLLM's decode kernel does)."""
        self.num_parts, self.max_model_len, self.device = num_parts, max_model_len, device
        self.page_loads = page_loads

    def forward(
        self,
        state: FlashMLASchedMeta,
        query: torch.Tensor,  # [num_reqs, heads, dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
        seq_lens: torch.Tensor,  # [num_reqs] int32, live
        out: torch.Tensor,  # [num_reqs, heads, dim]
        scale: float,
        launch: Launcher,
    ) -> None:
        rows = query.shape[0]
        if state.tile_scheduler_metadata is None:  # lazy: plan on first use
            i32 = dict(dtype=torch.int32, device=self.device)
            state.tile_scheduler_metadata = torch.empty(self.num_parts, 4, **i32)
            state.num_splits = torch.empty(rows, **i32)
            launch(plan_schedule, seq_lens, state.tile_scheduler_metadata, state.num_splits)
        partial_out = torch.empty(self.num_parts, *query.shape, device=self.device)
        partial_lse = torch.empty(self.num_parts, *query.shape[:2], device=self.device)
        launch(
            split_kv_attention,
            query,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            state.tile_scheduler_metadata,
            partial_out,
            partial_lse,
            scale,
            self.max_model_len,
            page_loads=self.page_loads,
        )
        launch(combine_splits, partial_out, partial_lse, state.tile_scheduler_metadata, out)


@dataclass(frozen=True, slots=True)
class DraftInputs:
    """What a draft step reads: the target's sampled hidden states and layer 0's KV cache."""

    hidden: torch.Tensor  # [num_reqs, hidden] (the target's graph output, or an eager one)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, live


class DraftAttention:
    """A speculator's decode attention (query: the target's normalized sampled hidden state)
    with graphs of its own on the target's attention states (upstream: the speculator's prefill
    graph manager builds none). It warms up on the target's warm-up state (planned eagerly),
    prewarms its capture path (vLLM #46523) on a disposable state and captures on the captured
    one, so that at replay it reads the plan the target's graph has just made (vLLM #44253: the
    captured state's plan is not computed before that replay)."""

    def __init__(
        self,
        backend: FlashMLABackend,
        num_heads: int,
        normalize: Callable[[torch.Tensor, torch.Tensor], None],
        fixes: Variant,
    ) -> None:
        self.backend, self.num_heads, self.normalize = backend, num_heads, normalize
        self.launch, self.fixes = Launcher(), fixes
        self.graphs = CudaGraphManager(backend.device, self.launch, fixes)

    def forward(self, state: FlashMLASchedMeta, x: DraftInputs) -> torch.Tensor:
        rows, width = x.hidden.shape
        shape = (rows, self.num_heads, width // self.num_heads)
        query = torch.empty(shape, dtype=x.hidden.dtype, device=x.hidden.device)
        self.launch(self.normalize, x.hidden, query.view(rows, width))
        out, scale = torch.empty_like(query), (width // self.num_heads) ** -0.5
        self.backend.forward(
            state, query, x.k_cache, x.v_cache, x.block_table, x.seq_lens, out, scale, self.launch
        )
        return out

    def capture(
        self,
        target_states: dict[BatchExecutionDescriptor, tuple[FlashMLASchedMeta, FlashMLASchedMeta]],
        inputs: Callable[[BatchExecutionDescriptor], DraftInputs],
    ) -> None:
        """`target_states`: each descriptor's (warm-up, captured) attention states. A
        warmup=False function runs on the captured state in capture, on a fresh one eagerly."""

        def create_forward_fn(desc: BatchExecutionDescriptor, warmup: bool = True):
            warmup_state, captured_state = target_states[desc]
            state = captured_state
            if warmup and Fix.SPEC_SEPARATE_WARMUP_STATE in self.fixes:
                # fix: spec_separate_warmup_state -- the captured state's plan is uncomputed.
                state = warmup_state

            def forward(mode: CUDAGraphMode) -> torch.Tensor:
                run_on = state
                eager = not self.launch.capturing
                if not warmup and eager and Fix.SPEC_DISPOSABLE_PREWARM_STATE in self.fixes:
                    # fix: spec_disposable_prewarm_state -- never eagerly on the unmade plan.
                    run_on = FlashMLASchedMeta()
                return self.forward(run_on, inputs(desc))

            return forward, state

        self.graphs.capture(list(target_states), create_forward_fn)
