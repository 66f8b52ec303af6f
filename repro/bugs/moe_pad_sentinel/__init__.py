"""moe_pad_sentinel (vLLM #54747; #57036, #57946): a MoE consumer never learned the -1 of
padding rows.

VLLM_MOE_SKIP_PADDING (#46428; in the top-k kernels since #48979, on by default) makes the
top-k write expert id -1 (weight 0) for the padding rows of a graph replay, so that MoE and
all-to-all kernels can skip them. A consumer that never learned the contract treats -1 as an
expert: upstream's AITER sort indexed the expert weights with it (#57036), FlashInfer's b12x
kernels their expert state (#57946): a read or write outside the buffer, a GPU memory fault.
Here the consumer is the expert-sorted MoE of moe_pad_nan_topk: its sort has a bucket for each
expert 0..E-1 and none for -1, so a padding pair gets no row, and a finalize without the guard
gathers through the entry the sort never wrote: an illegal memory access. The fix: the consumer
honours -1, skipping those pairs (as FlashInfer's finalize does, #37715). Run alone:
`python -m repro.bugs.moe_pad_sentinel`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Fold, Scenario

PART = Fix.MOE_PAD_SENTINEL_GUARD
# GPU: the finalize's gather at row 2^31 - 1, far past any allocation; CPU: the interpreter's
# wild read of the same address, SIGSEGV
ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)

# where the switches travel as names (repro checkout folds them; repro/fold.py)
FOLD_FILES = (
    "kernels/moe_permute.py",
    "harness/runner/model.py",
    "repro/bugs/moe_pad_sentinel/scenarios.py",
    "repro/bugs/moe_pad_nan_topk/scenarios.py",
    "repro/sentinels.py",
)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="simplified",
    what=(
        "upstream's dereference is shuffle_rows' input gather (#54747); here one consumer's "
        "finalize gathers through the unwritten entry, and the fix skips invalid ids as "
        "FlashInfer's finalize does (#37715), not #54747's sentinels and bounds check; #57036 and"
        " #57946 are consumers of the same -1 contract (relatives)"
    ),
    evidence=(
        "#54747's description (MRV2's -1 padded rows left input_permutation slots uninitialized, "
        "shuffle_rows dereferenced them, illegal address; fix: invalid sentinels and a bounds "
        "check); #57036's and #57946's descriptions; #37715's description"
    ),
    not_verified="every diff; FlashInfer's finalize source",
)

RECORD = BugRecord(
    id="moe_pad_sentinel",
    title="A MoE consumer treats the -1 expert id of padding rows as an expert",
    upstream="https://github.com/vllm-project/vllm/pull/54747",
    symptom=(
        "a GPU memory access fault (ROCm: 'Memory access fault by GPU node'; CUDA: an MMU "
        "fault, 'an illegal memory access was encountered') in MoE experts that receive "
        "topk_ids with -1: AITER fused experts on MI355X (#57036), FlashInfer b12x experts "
        "(#57946); at startup when a profile run marked every row as padding, and at any "
        "replay with padding rows"
    ),
    root_cause=(
        "the top-k producers mark padding rows with expert -1 (VLLM_MOE_SKIP_PADDING); a "
        "consumer that assumes every id names an expert indexes its per-expert data with -1, "
        "or (here) never places the pair and then dereferences the entry it never wrote"
    ),
    trigger=(
        "skip-padding on, a graph replay (FULL or PIECEWISE) with padding rows, a consumer "
        "without the -1 guard"
    ),
    fix_parts=(PART,),
    buggy_outcome=ILLEGAL,
    scenarios=(
        Scenario(
            "sentinel_rows",
            (Expect(frozenset({PART}), ILLEGAL),),
            # 3 live rows of 5; then an EP rank's expert map: rows [-1, 3], [6, -1], [0, 7]
            axes=Axes(states=("padded by tokens", "non-local experts marked -1 per pair")),
            cpu_signature='kernels/moe_permute\\.py", line \\d+ in _moe_finalize_kernel\\b',
        ),
        Scenario(
            "full_graph_padded_decode",
            (Expect(frozenset({PART}), ILLEGAL),),
            axes=Axes(
                graph_modes=("FULL",),
                capture_sizes=(4,),
                steps_per_size=2,
                states=("padded by tokens",),  # 3, then 2 tokens in the graph of 4
            ),
            cpu_signature='kernels/moe_permute\\.py", line \\d+ in _moe_finalize_kernel\\b',
        ),
        Scenario(
            "piecewise_padded_decode",
            (Expect(frozenset({PART}), ILLEGAL),),
            axes=Axes(
                graph_modes=("PIECEWISE",),
                capture_sizes=(4,),
                steps_per_size=2,
                states=("padded by tokens",),  # 3, then 2 tokens in the graph of 4
            ),
            cpu_signature='kernels/moe_permute\\.py", line \\d+ in _moe_finalize_kernel\\b',
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    folds=(Fold(PART, ("skip_invalid", "SKIP_INVALID"), FOLD_FILES),),
    anchors=(
        (
            PART,
            "the consumers: vllm/model_executor/layers/fused_moe's AITER path (#57036: topk_ids "
            "rewritten before aiter.fused_moe, -1 routed to expert 0 with weight 0, "
            "branch-free for graphs) and FlashInferB12xExperts (#57946: before "
            "B12xMoEWrapper.run); FlashInfer's CUTLASS finalize skips invalid ids before its "
            "permutation-table lookup (#37715's description). The producers: #46428's masking "
            "in vllm/model_executor/layers/fused_moe/modular_kernel.py, moved by #48979 into "
            "the top-k kernels, which read forward_context.is_padding",
        ),
    ),
    history=(
        "Verified with search (2026-11), from PR descriptions: #46428 '[Optimization] Skip DP "
        "padding tokens in MoE' (merged; VLLM_MOE_SKIP_PADDING, default 0 then, 'some MoE "
        "kernels may not support topk = -1'); #48979 'skip cudagraph/DP padding in topk' "
        "(merged; the is_padding mask passed into the top-k kernel, which sets topk_ids to -1); "
        "#57036 '[Bugfix][ROCm] Handle MoE padding sentinel in AITER fused experts' (open; "
        "moe_sorting indexed the expert weights with -1, DeepSeek-V4.1-Flash on MI355X; the "
        "profile run marked every row as padding; fix: route padding rows to expert 0 with "
        "zero weight); #57946 '[Bugfix] Handle MoE padding sentinel in FlashInfer b12x "
        "experts' (open; -1 wrote outside the workspace, an MMU fault; #57270 made Model Runner "
        "V2's profile run route its tokens, is_padding=not is_profile). Relatives: #47785 "
        "(merged; moe_align_block_size read expert_map[-1]), #42034 (closed; -1 through a "
        "local expert map), #50757/#50759 (routers without native padding support), #57471 "
        "(a revert: a profile run with every row padding), #37715 (open; padding rows masked "
        "to -1 for FlashInfer CUTLASS, whose finalize skips them). Not verified: the diffs "
        "line by line, and which sentinel value each upstream kernel checks. Modelled: one "
        "consumer stands for them all, the expert-sorted MoE of moe_pad_nan_topk, whose sort "
        "has no bucket for -1; the guard skips pairs outside [0, num_experts) in the finalize. "
        "sentinel_rows also walks ids invalid per (token, slot) pair, not per row: an EP rank's "
        "expert map marks another rank's experts -1 (vLLM's expert_map; #46408 '[Bugfix] "
        "Support -1 (invalid/non-local) slots in topk_ids for Triton MoE', merged: dispatch "
        "hands the experts such slots and the reduction must skip each unwritten one; #47785, "
        "DeepEP's dispatch marks non-local pairs -1), so a guard that tests one id per row "
        "faults. "
        "#57036's own fix (route -1 to expert 0 with weight 0) would give a padding row "
        "expert 0 in every slot: duplicates, moe_pad_nan_topk's hazard in a consumer that "
        "assumes distinct experts (the mutant route_to_expert_0). A read of weights[-1] "
        "itself would not fault here: the bytes before a weight lie in mapped memory on both "
        "devices, and a padding row's output is discarded."
    ),
)
