"""moe_pad_nan_topk (vLLM #39391): NaN padding rows pick one expert k times; the MoE sort faults.

A CUDA-graph replay pads the batch to the captured size. The padding rows' hidden states are
degenerate: attention computes the real tokens only and leaves the padding rows of its output
as allocated, NaN in nearly every padded step upstream measured. Through the gate, a NaN row's
softmax is all NaN, and topk_softmax's argmax loop (a later expert wins only when it compares
greater) never leaves expert 0: the row's top-k ids are [0, 0, ...]. FlashInfer's CUTLASS MoE
assumes distinct experts per token: its sort places a duplicate pair nowhere, and the finalize
dereferences the unwritten entry: an illegal memory access. The fix clamps NaN and Inf
probabilities to 0 before the selection, so ties pick experts 0, 1, ... Run alone:
`python -m repro.bugs.moe_pad_nan_topk`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Fold, Scenario

PART = Fix.MOE_GATE_NAN_CLAMP
# GPU: the finalize's gather at row 2^31 - 1, far past any allocation; CPU: the interpreter's
# wild read of the same address, SIGSEGV
ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)

# where the switches travel as names (repro checkout folds them; repro/fold.py)
FOLD_FILES = (
    "kernels/topk_gate.py",
    "harness/runner/model.py",
    "repro/bugs/moe_pad_nan_topk/scenarios.py",
    "repro/sentinels.py",
)

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "#39391's description and review (NaN gating in graph padding picks expert 0 for every "
        "slot, duplicate ids crash FlashInfer's three-step sort; clamp NaN/Inf to 0)"
    ),
    not_verified=(
        "where the NaN comes from: in #39391's review the author says the padding values are "
        "zeros; issues #39244, #37758, #39288; #39593's numbers; the diff"
    ),
)

RECORD = BugRecord(
    id="moe_pad_nan_topk",
    title="NaN padding rows pick one expert k times; the MoE sort leaves pairs unplaced",
    upstream="https://github.com/vllm-project/vllm/pull/39391",
    symptom=(
        "CUDA illegal memory access in FlashInfer's finalizeMoeRoutingKernel serving MoE models "
        "(Qwen3.5-397B-A17B-FP8, Qwen3-Next-80B BF16, Qwen3-30B-A3B) with FlashInfer CUTLASS MoE "
        "and CUDA graphs: at high concurrency (issue #39244), under data parallelism (issue "
        "#37758, whose ranks pad to a common size), or during capture (issue #39288)"
    ),
    root_cause=(
        "padding rows of a graph replay carry NaN hidden states; the gate's softmax of a NaN row "
        "is NaN and topk_softmax's argmax loop (NaN > x is false) picks expert 0 for every slot; "
        "the MoE sort assumes a token's experts are distinct and leaves the duplicates' entries "
        "unwritten, which the finalize dereferences"
    ),
    trigger=(
        "a learned-gate MoE whose consumer sorts by expert, a graph replay with padding rows "
        "whose attention output is NaN (PIECEWISE here: attention runs on the real tokens only)"
    ),
    fix_parts=(PART,),
    buggy_outcome=ILLEGAL,
    scenarios=(
        Scenario(
            "nan_padding_rows",
            (Expect(frozenset({PART}), ILLEGAL),),
            axes=Axes(states=("padded by tokens",)),  # 2 NaN rows behind 3 live ones
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
    folds=(Fold(PART, ("clamp_nonfinite", "CLAMP_NONFINITE"), FOLD_FILES),),
    anchors=(
        (
            PART,
            "csrc/moe/topk_softmax_kernels.cu, topkGatingSoftmax (and the generic moeSoftmax + "
            "moeTopK path): NaN/Inf scores clamped to 0 after the softmax (or sigmoid) scoring, "
            "before the argmax loop whose candidate is replaced only by a value that compares "
            "greater (`val > max_val`), ties going to the lower index; the consumer: FlashInfer's "
            "CUTLASS MoE (TensorRT-LLM's three-step sort, then finalizeMoeRoutingKernel)",
        ),
    ),
    history=(
        "Verified with search (2026-11): #39391 'fix: clamp NaN/Inf in topk_softmax to prevent "
        "duplicate expert IDs' (merged 2026-04-21, commit 28c2221; its description: graph replay "
        "pads to the capture size, padded tokens produce NaN gating logits, the argmax loop picks"
        " expert 0 for every slot, [0,0,0,0,0,0,0,0], and FlashInfer's three-step MoE sort leaves"
        " memory uninitialized that finalizeMoeRoutingKernel dereferences; with all-zero scores "
        "the picks are unique by index tie-breaking); it fixes issue #39244 (named in #39391's "
        "description; the issue itself was not found with search). #39593 (closed in favour of "
        "#39391) closes issue #37758 with a nan_to_num before top-k; its measurement: NaN in the "
        "padding rows after attention in 100% of 62 padded steps on one GPU (Qwen3-30B-A3B BF16, "
        "piecewise CUDA graphs), 99.6% of 832 with DP=2, and DP pads 13x more often. Issue #39288"
        " (Qwen3-Next-80B BF16, H100, PIECEWISE capture): its reporter found it resolved by "
        "#39391. Read: the pre-fix topk_softmax_kernels.cu (the `val > max_val` loop, the winner "
        "blanked for the next pick); not read: #39391's diff line by line. Relatives: ROCm/aiter "
        "#4530 (padding rows' NaN/Inf in a Triton routing sort, 'memory access fault'; vLLM "
        "hotfix #50859), tokenspeed #1461's review (an all-NaN row whose compare-with-max "
        "selection returns the out-of-range sentinel E), vLLM #42608's review (duplicate expert 0"
        " once every expert is exhausted), and moe_pad_sentinel here (padding rows marked -1 "
        "instead: the same consumer, the other contract). Modelled: the gate's top-k is a Triton "
        "compare loop whose NaN order is the GPU's (tests/test_topk_gate.py proves the "
        "interpreter's equals a torch twin's); the consumer is kernels/moe_permute (sort, GEMM, "
        "finalize); the NaN comes from PIECEWISE replays, whose eager attention computes the real"
        " tokens only (upstream's num_actual_tokens); the empty memory upstream leaves is "
        "poisoned here (NaN, and int32 max for the sort's entries) so that every run fails alike."
    ),
)
