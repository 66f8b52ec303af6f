"""conv_state_short_chunk (vLLM #56196, open): a short prefill chunk's conv state stored into the
block its initial state came from.

With prefix caching a Mamba layer's causal-conv1d kernel reads a sequence's initial conv state
from one block (initial_state_idx: a cached prefix block, shared) and writes its new state to
another (the block of its last scheduled token: its own). When a prefill chunk is shorter than
the conv state (width - 1 tokens, 3 for width 4) the kernel takes a "shift left" branch that
stored the new state through the pointer it had read the initial state from: the sequence's own
block is never written, and the shared prefix block is overwritten, so every later sequence
reusing the prefix reads this one's conv state. The fix stores that branch's state into the
own block, as the long branch does.
Run alone: `python -m repro.bugs.conv_state_short_chunk`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Fold, Scenario

PART = Fix.CONV_STATE_OWN_BLOCK
WRONG = ByDevice.both(Outcome.WRONG_RESULT)  # another sequence's finite conv state: no fault
FOLD_FILES = ("kernels/causal_conv1d.py", "harness/runner/mamba_align.py")

# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-28, search, read_file).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#56196's description (open: the two short 'shift left' branches of "
        "_causal_conv1d_fwd_kernel store through conv_states_base, read from initial_state_idx, "
        "not the block of block_idx_last_scheduled_token; the own block never written, the "
        "shared prefix block overwritten; NaN logits when the own block held non-finite "
        "bytes); stored copies of vllm's causal_conv1d.py (the long branch's store to the "
        "last scheduled block, the short branch's through conv_states_base; the update "
        "kernel's store to the last scheduled block)"
    ),
    not_verified=(
        "#56196's diff and tests; the report's model and setup (the description's excerpt ends "
        "there); whether mamba_cache_mode 'all' or 'align' schedules the short chunks upstream"
    ),
    what=(
        "kernels/causal_conv1d.py is a small twin of the forward kernel (one program per "
        "sequence, width 4, channels-last, no bias or SiLU, no intermediate block states), its "
        "two final-state stores kept as upstream's branches; it serves the Mamba align-mode "
        "engine of mamba_align_prefix_poison (harness/runner/mamba_align.py), where a short "
        "chunk is a prompt's last (a budget never cuts one short there) and no decode is "
        "modelled: the own block's never-written state is checked directly (after each prefill "
        "each chunk's own slot against the float64 conv state, and tests/test_causal_conv1d.py), "
        "the shared block's overwrite through a later sequence's logits"
    ),
)

RECORD = BugRecord(
    id="conv_state_short_chunk",
    title="A prefill chunk shorter than the conv state stores it into the shared prefix block",
    upstream="https://github.com/vllm-project/vllm/pull/56196",
    symptom=(
        "with prefix caching on a Mamba/hybrid model, requests reusing a cached prefix decode "
        "subtly wrong text, or NaN logits and a tail of token 0 when the sequence's own block "
        "held non-finite bytes; it depends on a prefill chunk shorter than width - 1 tokens"
    ),
    root_cause=(
        "the causal-conv1d forward kernel's short-chunk branches (a chunk under width - 1 "
        "tokens shifts the initial state left) stored the new conv state through the pointer "
        "of the block the initial state was read from instead of the block of the chunk's last "
        "token; with prefix caching those differ"
    ),
    trigger=(
        "prefix caching; a sequence resuming from a cached prefix block with a chunk of 1 or 2 "
        "tokens (width 4); a later sequence reusing the same prefix"
    ),
    fix_parts=(PART,),
    buggy_outcome=WRONG,
    scenarios=(
        Scenario(
            "short_chunk_after_prefix_hit",
            (Expect(frozenset({PART}), WRONG),),
            axes=Axes(
                graph_modes=("NONE",),
                states=(
                    "conv chunk shorter than its state",
                    "conv chunk at least as long as its state",
                    "prefill from a prefix-cached state",
                    "prefill from a fresh state",
                    "a second sequence reusing the prefix",
                    "prefix hit on a cached Mamba state",
                    "the own slot's conv state after the step",
                ),
            ),
            signature="second consumer \\(hit 8\\) logits vs reference: \\d+/\\d+ differ",
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    folds=(Fold(PART, ("own_block", "OWN_BLOCK"), FOLD_FILES),),
    fuzz=(
        "not drawn yet: the Mamba align-mode engine (harness/runner/mamba_align.py) and its "
        "causal-conv1d kernel are no runner configuration the programs of repro/program.py "
        "build"
    ),
    anchors=(
        (
            PART,
            "vllm/model_executor/layers/mamba/ops/causal_conv1d.py _causal_conv1d_fwd_kernel: "
            "the branch for a chunk shorter than state_len (with and without a loaded initial "
            "state) stores the new conv state to the block of block_idx_last_scheduled_token, "
            "as the long branch does, not through conv_states_base (#56196, open); here "
            "kernels/causal_conv1d.py's OWN_BLOCK",
        ),
    ),
    history=(
        "Verified with search (2026-11): #56196 '[Bugfix][Kernel] Mamba: store a short prefill "
        "chunk's conv state in its own block' (open, opened 2026-09-10) describes the kernel's "
        "two short-chunk branches storing through the initial state's pointer and the two "
        "consequences (own block never written, shared prefix block overwritten); found through "
        "NaN logits. Stored copies of vllm's causal_conv1d.py (read_file) show the long "
        "branch storing through conv_states_output_coord (the last scheduled block) and the "
        "short branch through conv_states_base; #25752 (merged) added Mamba2 prefix caching to "
        "the kernel. Relatives: fla #1141 (the final-state gradient of chunks shorter than "
        "W - 1), kekzl/imp #1976 (a conv window committed from one block while others read "
        "it), vllm-xpu-kernels #544 (a conv-state layout at block boundaries with MTP). "
        "Not read: #56196's diff, its tests, the issue it may fix."
    ),
)
