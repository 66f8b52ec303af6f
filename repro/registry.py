"""The bug registry: one literal tuple of records: the five documented bugs in upstream fix
order, then their relatives (upstream follow-ups and twins)."""

from __future__ import annotations

from harness.fixes import UsageError
from harness.record import BugRecord
from repro.bugs import (
    allreduce_flag_epoch,
    async_output_lifetime,
    async_pinned_race,
    async_placeholder_leak,
    async_window_free,
    block_table_graph_wake,
    block_table_wake,
    capture_first_call,
    car_register_before_replay,
    conv_state_short_chunk,
    dp_drafter_boundary_hang,
    dp_zero_token_skip,
    draft_lookahead_alloc,
    ep_graph_bucket_local,
    grammar_bitmask_fill,
    graph_output_alias,
    input_batch_swap_alias,
    kernel_block_size,
    kv_block_stale_nan,
    lazy_attn_state,
    level2_sleep_state,
    lora_dummy_run,
    lora_graph_capture,
    lora_slot_memo,
    mamba_align_prefix_poison,
    moe_align_grid,
    moe_lora_consumer_grid,
    moe_pad_nan_topk,
    moe_pad_sentinel,
    offload_store_race,
    pad_slot_negative_index,
    partial_wake_forward,
    rank_rng_divergence,
    reload_derived_rebind,
    sleep_prefix_cache,
    spec_capture_state,
    spec_prewarm_captured_state,
    spec_stale_pad_tail,
)

BUGS: tuple[BugRecord, ...] = (
    block_table_wake.RECORD,
    lazy_attn_state.RECORD,
    moe_align_grid.RECORD,
    lora_dummy_run.RECORD,
    lora_graph_capture.RECORD,
    moe_lora_consumer_grid.RECORD,
    block_table_graph_wake.RECORD,
    spec_capture_state.RECORD,
    capture_first_call.RECORD,
    spec_prewarm_captured_state.RECORD,
    # recycled memory and the sleep lifecycle (issue 22), in upstream fix order
    level2_sleep_state.RECORD,
    sleep_prefix_cache.RECORD,
    kv_block_stale_nan.RECORD,
    partial_wake_forward.RECORD,
    # padding rows and sentinels (issue 23), in upstream fix order
    moe_pad_nan_topk.RECORD,
    spec_stale_pad_tail.RECORD,
    pad_slot_negative_index.RECORD,
    moe_pad_sentinel.RECORD,
    # memos, aliases and two notions of one size (issue 24), in upstream fix order
    kernel_block_size.RECORD,
    lora_slot_memo.RECORD,
    input_batch_swap_alias.RECORD,
    graph_output_alias.RECORD,
    # async scheduling and copy streams (issue 25), in upstream fix order
    async_pinned_race.RECORD,
    async_output_lifetime.RECORD,
    async_placeholder_leak.RECORD,
    async_window_free.RECORD,
    # ranks that must agree (issue 43), in upstream fix order
    rank_rng_divergence.RECORD,
    car_register_before_replay.RECORD,
    dp_zero_token_skip.RECORD,
    dp_drafter_boundary_hang.RECORD,
    allreduce_flag_epoch.RECORD,
    ep_graph_bucket_local.RECORD,
    # Mamba align-mode prefix caching (issue 44), in upstream fix order
    mamba_align_prefix_poison.RECORD,
    conv_state_short_chunk.RECORD,
    # weights reloaded under captured graphs, KV blocks offloaded to a CPU tier (issue 44)
    reload_derived_rebind.RECORD,
    offload_store_race.RECORD,
    # structured outputs and lookahead slots (issue 44), in upstream fix order
    grammar_bitmask_fill.RECORD,
    draft_lookahead_alloc.RECORD,
)


def get(bug_id: str) -> BugRecord:
    for bug in BUGS:
        if bug.id == bug_id:
            return bug
    valid = ", ".join(b.id for b in BUGS)
    raise UsageError(f"unknown bug id {bug_id!r}; valid ids: {valid}")


# Retired bugs (id, why): `repro query` lists them as deprecated; their ids are never reused.
RETIRED: tuple[tuple[str, str], ...] = ()
