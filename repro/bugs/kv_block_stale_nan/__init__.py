"""kv_block_stale_nan (vLLM #35219): a recycled KV block's stale bytes turn attention to NaN.

In a hybrid model (attention and Mamba layers) the KV pool's raw blocks are shared by the
attention groups (bfloat16 or fp8 K/V) and the Mamba group (float32 state). A block freed by
one tenant and handed to another keeps its bytes; read in the other dtype they can be NaN or
Inf. Attention kernels that load a whole page and mask its unused slots by multiplying them by
their probability, 0 (FA3, FlashInfer's TRTLLM kernels), keep the NaN: 0 x NaN = NaN. The fix
zeroes newly allocated attention blocks before use: the scheduler reports
new_block_ids_to_zero, the worker's KVBlockZeroer (a Triton kernel) zeroes them. Run alone:
`python -m repro.bugs.kv_block_stale_nan`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import WAKES, Axes, BugRecord, Expect, Fidelity, Scenario

PART = Fix.ZERO_NEW_KV_BLOCKS
WRONG = ByDevice.both(Outcome.WRONG_RESULT)  # NaN logits: 0 x NaN on every device
NAN_LOGITS = r"logits vs .*: .*\bnan vs "  # the signature: logits that are NaN, not merely off

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "float32 Mamba state read as a smaller float is modelled by an int32 -1 sentinel group in"
        " a float32 cache; the page-loading kernel is the runner's split-KV backend"
    ),
    evidence=(
        "#35219's description (a block pool shared by attention and fp32 Mamba, leftover bits NaN"
        " in the smaller dtype, 0 x NaN masking, zeroes new attention blocks of hybrid models; "
        "fixes issue #35138); #54004; #36701"
    ),
    not_verified="issue #35138's own text; #43990's MRV2 port",
)

RECORD = BugRecord(
    id="kv_block_stale_nan",
    title="A recycled KV block's stale bytes of another dtype turn paged attention to NaN",
    upstream="https://github.com/vllm-project/vllm/pull/35219",
    symptom=(
        "hybrid models (Qwen3.5: Gated DeltaNet + full attention) with FA3 or FlashInfer's "
        "TRTLLM attention produce NaN attention, corrupt logits and garbage tokens after blocks "
        "are recycled; in Model Runner V2 (#43990) an invalid sampled token then failed "
        "vectorized_gather_kernel with 'index out of bounds' on the first request"
    ),
    root_cause=(
        "blocks of the shared KV pool are handed to a new tenant without clearing them: slots "
        "of an attention page that the new request has not written hold the Mamba state's "
        "float32 bytes, NaN or Inf read as bfloat16 or fp8, and kernels that load the whole page "
        "weight those slots by 0, and 0 x NaN = NaN"
    ),
    trigger=(
        "a hybrid runner whose attention loads whole pages; a block that held another tenant's "
        "state (or, after a sleep, the wake's poison) given to a request whose last page it "
        "becomes; a decode step reading that page"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "recycled_state_block",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                # B is given A's blocks; C's decode crosses into page 1, B's state block
                states=(
                    "hybrid groups",
                    "freed block reused by a new request",
                    "freed block reused by a running request",
                    "running request grows into a new block",
                ),
            ),
            signature=NAN_LOGITS,
        ),
        Scenario(
            "fresh_blocks_after_wake",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                sleep_levels=(1, 2),
                wakes=WAKES[:2],
                # a pool of 3 blocks and the null block: each serve after a wake is given the
                # last one's blocks
                states=("hybrid groups", "freed block reused by a new request"),
            ),
            signature=NAN_LOGITS,
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            PART,
            "vllm/v1/core/single_type_kv_cache_manager.py records the newly allocated attention "
            "block ids, which the scheduler output carries as new_block_ids_to_zero when "
            "vllm/v1/kv_cache_interface.py KVCacheConfig.needs_kv_cache_zeroing (Mamba layers; "
            "later mixed-precision and block-dropping layers) holds; vllm/v1/worker/utils.py "
            "KVBlockZeroer zeroes them with a Triton kernel before the forward (V1 runner), "
            "vllm/v1/worker/gpu/model_runner.py execute_model's _zero_block_ids right after "
            "block_tables.apply_staged_writes() (Model Runner V2, #43990); prefix-cache hits "
            "are not zeroed",
        ),
    ),
    history=(
        "Verified with search (2026-11): #35219 '[BUGFIX][Mamba][Qwen3.5] Zero freed SSM cache "
        "blocks on GPU' (merged; its description, quoted in #54004: only full-attention blocks "
        "are zeroed, because leftover fp32 Mamba bit patterns can read as NaN/Inf in a smaller "
        "dtype; review asked to zero only newly allocated, non-hit blocks and only when the "
        "groups' dtypes differ); #43990 (merged; opened 2026-05-29) ports it to Model Runner V2 "
        "(_init_kv_zero_meta, _zero_block_ids, new_block_ids_to_zero: TRTLLM attention with an "
        "fp8 cache read the whole page, NaN logits, an out-of-bounds gather); #51749 (merged) "
        "zeroes every AttentionSpec group (recycled fp8 sliding-window pages); #47574 (merged) "
        "extended needs_kv_cache_zeroing to quantized caches with block-dropping layers; "
        "#56524 (open) would zero Mamba state blocks too; #54004 (open) corrects the flag's "
        "docstring. The kernels' side: flash-attention #1745, #1974 (vLLM's hybrid models) and "
        "#2374 (FA3/FA4 load V pages whole: P = 0 times NaN), and vLLM #936 (2023), where "
        "vLLM's own paged attention kernel zeroed the values of positions past the context "
        "for the same reason. #35219's description says it fixes issue #35138 (its text not read). "
        "Relatives "
        "here: block_table_wake (the same pool discarded at sleep), and the wake's 0xFF poison, "
        "which makes every new page's unused slots NaN (fresh_blocks_after_wake). Modelled: a "
        "Mamba-like state group whose int32 value -1 stands for float32 state read as bfloat16 "
        "(the runner's KV cache is float32 by default, where a float32 state would read as "
        "itself); the page-loading kernel is the split-KV decode backend with PAGE_LOADS "
        "(decode_backend 'trtllm'); zeroing runs only on a hybrid runner, as upstream's flag "
        "gates it, so a non-hybrid runner with page loads after a wake is left as upstream "
        "leaves it."
    ),
)
