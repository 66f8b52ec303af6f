"""The Fix enum (one member per named fix part) and variant selection.

A variant is a frozenset of the fix parts switched on; it is threaded explicitly through kernel
launchers and runner configs. The buggy variant of a bug is every fix minus that bug's parts, so
other bugs never interfere.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Fix(enum.Enum):
    # vLLM #40648 (block_table_wake)
    BLOCK_TABLE_REINIT_ON_WAKE = "block_table_reinit_on_wake"
    # vLLM #42444 (lazy_attn_state)
    FRESH_ATTN_STATE_FOR_CAPTURE = "fresh_attn_state_for_capture"
    # vLLM #40131 (moe_align_grid)
    MOE_ALIGN_GRID_PLUS_ONE = "moe_align_grid_plus_one"
    MOE_ALIGN_OOB_GUARD = "moe_align_oob_guard"
    MOE_ALIGN_SORT_ADAPTER_CHECK = "moe_align_sort_adapter_check"
    # vLLM #43139 (lora_dummy_run)
    LORA_DUMMY_MAPPING = "lora_dummy_mapping"
    # vLLM #43314 (lora_graph_capture)
    LORA_CAPTURE_LAUNCH = "lora_capture_launch"
    # vLLM #53197 (block_table_graph_wake; closed upstream unmerged)
    BLOCK_TABLE_REFRESH_IN_PLACE = "block_table_refresh_in_place"
    # vLLM #32277 (moe_lora_consumer_grid)
    MOE_LORA_GRID_PLUS_ONE = "moe_lora_grid_plus_one"
    MOE_LORA_ID_GUARD = "moe_lora_id_guard"
    # vLLM #44253 (spec_capture_state)
    SPEC_SEPARATE_WARMUP_STATE = "spec_separate_warmup_state"
    # vLLM #46523 (capture_first_call; open upstream, for issue #40742)
    CAPTURE_PREWARM = "capture_prewarm"
    # spec_prewarm_captured_state: #46523's prewarm (an eager capture-path call) re-opens
    # #44253's hazard in the speculator; modelled on vLLM #48261 (fresh speculator metadata
    # for every warm-up and capture pass): the eager pass gets a disposable state
    SPEC_DISPOSABLE_PREWARM_STATE = "spec_disposable_prewarm_state"
    # vLLM #16889 (level2_sleep_state; for issue #16564): buffers saved to host before a
    # level-2 sleep, restored when the weights wake
    SLEEP_SAVED_BUFFERS = "sleep_saved_buffers"
    # vLLM #44483 (partial_wake_forward; for issue #44395): resume scheduling, and let an idle
    # data-parallel rank run its dummy batch, only once every memory tag is awake
    FULLY_AWAKE_GATE = "fully_awake_gate"
    # vLLM #35219 (kv_block_stale_nan; ported to Model Runner V2 by #43990, generalized by #51749)
    ZERO_NEW_KV_BLOCKS = "zero_new_kv_blocks"
    # vLLM #22726 (sleep_prefix_cache)
    RESET_PREFIX_CACHE_ON_SLEEP = "reset_prefix_cache_on_sleep"
    # vLLM #43869 (pad_slot_negative_index; open upstream, for issue #43810): the cache-only
    # layer's write skips padding slots (-1) instead of indexing the cache with them in torch
    CACHE_ONLY_SKIP_PAD_SLOTS = "cache_only_skip_pad_slots"
    # vLLM #39773 (spec_stale_pad_tail): the speculator pads its last_token_indices past the
    # live requests before the draft prefill, so a padded graph gathers no stale index
    SPEC_PAD_LAST_TOKEN_INDICES = "spec_pad_last_token_indices"
    # vLLM #39391 (moe_pad_nan_topk; issues #39244, #37758): NaN/Inf gate probabilities clamped
    # to 0 before the top-k selection, so a NaN padding row picks distinct experts
    MOE_GATE_NAN_CLAMP = "moe_gate_nan_clamp"
    # moe_pad_sentinel: consumers honour the -1 expert id of padding rows (producers: vLLM
    # #46428, #48979; consumers fixed by #57036, #57946, open)
    MOE_PAD_SENTINEL_GUARD = "moe_pad_sentinel_guard"
    # vLLM #48419 (input_batch_swap_alias; open upstream): swap_states swaps the allowed-token-ids
    # mask rows through a copy (list indexing), not a tuple of two row views
    INPUT_BATCH_SWAP_COPY = "input_batch_swap_copy"
    # vLLM #27753 (kernel_block_size; issues #27264, #26936): the attention metadata builders
    # get the kernel block size, the one the block tables and the cache views are in
    KERNEL_BLOCK_SIZE_TO_BUILDERS = "kernel_block_size_to_builders"
    # vLLM #47725 (lora_slot_memo; issue #47724): the mapping memo is keyed on the slot layout
    # too, so an eviction that moves adapters under an unchanged mapping refreshes the metadata
    LORA_SLOT_LAYOUT_MEMO = "lora_slot_layout_memo"
    # vLLM #53520 (graph_output_alias; open upstream, for issue #53488): the target's graph
    # outputs leave the shared graph pool before the padded drafter's graph replays into it
    GRAPH_OUTPUT_COPY_BEFORE_DRAFT = "graph_output_copy_before_draft"
    # vLLM #24527, #25279 (async_pinned_race): under async scheduling the host waits for the last
    # step's upload of a reused pinned host tensor before rewriting it (prepare_inputs_event)
    ASYNC_PINNED_REUSE_WAIT = "async_pinned_reuse_wait"
    # vLLM #29623 (async_output_lifetime): the async output keeps the sampled token ids' device
    # tensor until their copy-stream download completes
    ASYNC_OUTPUT_KEEP_REF = "async_output_keep_ref"
    # vLLM #40768 (async_placeholder_leak; closed upstream, for issue #37159; #26385 sends a
    # resumed request's tokens): placeholders of a request with no row in the last step are
    # filled from the host's tokens, not left as -1 for the embedding
    ASYNC_PLACEHOLDER_HOST_FILL = "async_placeholder_host_fill"
    # vLLM #47728 (async_window_free; issue #47282): blocks out of a sliding window are freed on
    # the processed token count (computed minus in flight), not the optimistic one
    ASYNC_WINDOW_FREE_PROCESSED = "async_window_free_processed"
    # vLLM #28774 (dp_zero_token_skip; gate widened by #44601, open, for issue #43547): a DP
    # rank with zero scheduled tokens runs a one-token dummy step, so it joins the step's
    # all-reduce of token counts across DP ranks, before returning its empty output
    DP_ZERO_TOKEN_DUMMY_RUN = "dp_zero_token_dummy_run"
    # vLLM #17929 (rank_rng_divergence; issue #17498; relatives #31288, #31307 broadcast rank
    # 0's ngram drafts instead): an unset engine seed defaults to 0, so every tensor-parallel
    # worker seeds its sampling alike and the ranks accept the same drafts
    SEED_DEFAULT_ZERO = "seed_default_zero"
    # vLLM #40589 (dp_drafter_boundary_hang; issue #44185 and its fix #44954, open; vllm-ascend
    # #16514): a DP rank whose batch cannot take its drafts near max_model_len still runs the
    # drafter's dummy steps, so it joins the draft steps' agreements of the ranks that draft
    DP_DRAFTER_DUMMY_RUN = "dp_drafter_dummy_run"
    # SGLang #30450 (ep_graph_bucket_local; issue #30242, a regression of #29461; relatives
    # SGLang #27945, vLLM #25906): every expert-parallel rank replays the decode graph bucket of
    # the token count agreed across the ranks (their max), not the bucket of its local batch,
    # so the ranks pass one geometry to the all-to-all's fixed-layout receive buffers
    EP_GRAPH_BUCKET_AGREED = "ep_graph_bucket_agreed"
    # vLLM #28318 (car_register_before_replay; issue #28334, open): the drafter's dummy run is
    # given the target's batch descriptor, its LoRA case included, so each LoRA case captures a
    # draft graph of its own instead of replaying one inside the custom all-reduce's capture
    # window, before the graphs' buffers are registered
    DRAFT_GRAPH_LORA_KEY = "draft_graph_lora_key"
    # vLLM #46913 (allreduce_flag_epoch; ROCm/aiter #3928, SGLang #29508): the all-reduce's
    # round ("flag color") is a counter in device memory the kernel advances at each call, not
    # a host scalar a CUDA graph freezes at capture
    ALLREDUCE_DEVICE_ROUND = "allreduce_device_round"
    # vLLM #51113 (mamba_align_prefix_poison; issue #43559; first as #45477, #47861): in Mamba
    # align mode, prefill chunks stay block-aligned past the EAGLE-backed-off last cache position
    MAMBA_ALIGN_PAST_LAST_CACHE = "mamba_align_past_last_cache"
    # vLLM #56196 (conv_state_short_chunk; open upstream): the causal-conv1d kernel stores a
    # prefill chunk shorter than its conv state into the sequence's own block, not the one its
    # initial state was read from (a shared prefix block with prefix caching)
    CONV_STATE_OWN_BLOCK = "conv_state_own_block"
    # vLLM #48251 (reload_derived_rebind; tracker #48312): post-load processing refreshes the
    # tensors it derives from the parameters in place (copy_ into their storage) at a reload,
    # so graphs captured before it read the new weights, not the old allocation
    RELOAD_DERIVED_IN_PLACE = "reload_derived_in_place"
    # vLLM #46278 (offload_store_race; issue #45704; #31341 for the OffloadingConnector): the CPU
    # offload connector's GPU-to-CPU stores wait for a compute-done event recorded after the
    # step's KV writes, not only for the scheduler's word that the tokens are computed
    OFFLOAD_STORE_WAIT_COMPUTE = "offload_store_wait_compute"
    # vLLM #22963, #22896 (grammar_bitmask_fill; vllm-gaudi #1199, #1200): the worker's
    # batch-sized grammar bitmask starts neutral (every token allowed) in the rows no guided
    # request fills, and only the guided requests' rows are scattered into it
    GRAMMAR_NEUTRAL_FILL = "grammar_neutral_fill"
    GRAMMAR_GUIDED_ROW_COUNT = "grammar_guided_row_count"
    # vLLM #42971, #43733 (draft_lookahead_alloc): a drafter that writes KV past the sequence in
    # the target's step gets its k + 1 lookahead slots (the bonus token's too) allocated, on a
    # request's first (prefill) step as on every later one
    DRAFT_LOOKAHEAD_BONUS_SLOT = "draft_lookahead_bonus_slot"
    DRAFT_LOOKAHEAD_ON_PREFILL = "draft_lookahead_on_prefill"


Variant = frozenset[Fix]
ALL_FIXES: Variant = frozenset(Fix)


class UsageError(ValueError):
    """Bad input from a user: unknown names or conflicting options (CLI exit 2)."""


def parse_fix(name: str) -> Fix:
    try:
        return Fix(name)
    except ValueError:
        valid = ", ".join(f.value for f in Fix)
        raise UsageError(f"unknown fix part {name!r}; valid parts: {valid}") from None


def select_variant(
    bug_parts: Iterable[Fix],
    variant: str | None = None,
    without: Iterable[str] = (),
    fixes: str | None = None,
) -> Variant:
    """Variant from CLI-style options: --variant fixed|buggy, --without PART..., --fixes none."""
    without = [parse_fix(name) for name in without]
    chosen = [opt for opt, val in (("--variant", variant), ("--fixes", fixes)) if val is not None]
    if len(chosen) > 1 or (chosen and without and variant != "fixed"):
        raise UsageError("use one of --variant, --fixes none, or --without PART (with fixed)")
    if fixes is not None and fixes != "none":
        raise UsageError(f"--fixes takes only 'none', got {fixes!r}")
    if fixes == "none":
        return frozenset()
    if variant not in (None, "fixed", "buggy"):
        raise UsageError(f"--variant takes fixed or buggy, got {variant!r}")
    base = ALL_FIXES - frozenset(bug_parts) if variant == "buggy" else ALL_FIXES
    return base - frozenset(without)


def describe(variant: Variant, bug_parts: Iterable[Fix]) -> str:
    """Short name of a variant relative to one bug: fixed, buggy, or the parts it lacks."""
    missing = ALL_FIXES - variant
    if not missing:
        return "fixed"
    if missing == frozenset(bug_parts):
        return "buggy"
    return "without " + ",".join(sorted(f.value for f in missing))
