"""ep_graph_bucket_local (SGLang #30450, issue #30242): expert-parallel ranks replay decode graphs
of different buckets, so their all-to-all disagrees on the receive buffers' geometry.

Under expert parallelism with CUDA graphs and a one-sided all-to-all (SGLang's FlashInfer MoE
A2A), the dispatch writes each token's row straight into the owning rank's receive buffer, laid
out per source rank with a fixed number of rows each; that number is the graph's bucket (the
rows per rank it was captured for), baked into the graph. Each rank picked its decode bucket
from its local batch, so ranks with batches in different buckets laid the buffer out
differently: a receiver reads rows no sender wrote (upstream: an illegal memory access). The
fix: every rank picks the bucket from the count agreed across the ranks (their max), as DP
padding does. Runs as two rank processes (Scenario.ranks):
`python -m repro.bugs.ep_graph_bucket_local`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

FAULT = ByDevice.both(Outcome.ILLEGAL_ADDRESS)
PART = Fix.EP_GRAPH_BUCKET_AGREED

# How true to upstream (DESIGN.md 15), graded by what was read (search, issues and code corpora).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "SGLang #30450's description (merged; opened 2026-07-08: 'Fix FlashInfer A2A IMA by "
        "DP-synchronizing the decode graph bucket'): with FlashInfer MoE A2A and DP attention "
        "(moe_dense_tp_size 1, enable_dp_lm_head) require_mlp_tp_gather is False, so each rank "
        "picks its decode CUDA-graph bucket from its local batch size; ranks replay "
        "different-sized graphs and pass different runtime_max_tokens_per_rank into "
        "MoeAlltoAll's fixed-geometry [ep_size, runtime_max_tokens_per_rank, ...] buffers: an "
        "illegal memory access, surfacing later at the sampler's argmax; the fix makes "
        "require_mlp_tp_gather True for FlashInfer A2A, so the bucket is the cross-rank max "
        "(max(global_num_tokens_cpu)) in eager, capture and replay; issue #30242 (closed: "
        "DeepSeek-V4 NVFP4 disaggregated decode, GB300, TP/DP/EP 16, bisected to #29461; the "
        "comments name the local bucket and runtime_max_tokens_per_rank as the cause and padding "
        "every rank to the max bucket as the fix); #29461's description (merged; opened "
        "2026-06-26: skip the runtime token-count all-gather in the FlashInfer A2A dispatcher "
        "during graph capture, the graph's fixed geometry from x.shape[0]); #27945's "
        "description (merged; opened 2026-06-11: the same per-rank sizing in eager mode, "
        "the combine reshaping to "
        "[ep_size, runtime_max_tokens_per_rank, hidden], NaN logits); vLLM #25906 (merged: a "
        "DP/EP dummy run dispatched its CUDA graph on the local token count instead of the "
        "count synchronized across DP ranks: a hang)"
    ),
    not_verified=(
        "#30450's diff line by line and its test (the description was read); vLLM #52632, "
        "named as a relative by the survey, was not found in the issues corpus; which access "
        "faults upstream (the one-sided kernels' source was not read: a receiver reading rows "
        "at its own geometry, per-rank counters, or a combine reading past a peer's rows)"
    ),
    what=(
        "the all-to-all is a Triton dispatch kernel that writes each token slot of the rank's "
        "bucket into every peer's receive rows through PeerMemory (a skip mark where the peer "
        "owns none of its experts, so a receiver of the same geometry reads only rows written "
        "this step), and an expert kernel that reads its own rows by its own bucket and loads "
        "the expert each row names, unchecked; receive rows start poisoned and are poisoned "
        "again after each read, so a row nobody wrote names a wild expert (the fault, on every "
        "run), where upstream reads whatever the workspace held (an IMA on GB300, NaN in "
        "#27945's eager case); top-1 routing of four experts on two ranks, float32; the "
        "graphs' barriers are torch.distributed all-reduces between three graphs per bucket "
        "where upstream's kernels synchronize through flags in one graph"
    ),
)

RECORD = BugRecord(
    id="ep_graph_bucket_local",
    title="EP ranks pick decode graph buckets from local batches: all-to-all geometries differ",
    upstream="https://github.com/sgl-project/sglang/pull/30450",
    symptom=(
        "DeepSeek-V4 NVFP4 disaggregated decode with expert parallelism and FlashInfer's MoE "
        "all-to-all crashes with a CUDA illegal memory access (surfacing at the sampler's "
        "argmax) once the decode ranks' batches fall in different CUDA-graph buckets (#30242)"
    ),
    root_cause=(
        "each EP rank picks its decode CUDA-graph bucket from its local batch size, and the "
        "graph's bucket is the rows per source rank the one-sided all-to-all lays its receive "
        "buffers out by: ranks with different buckets write and read a source's rows at "
        "different offsets"
    ),
    trigger=(
        "two EP ranks in a decode step whose local batches fall in different graph buckets "
        "(the larger on either rank, or one rank idle), with the decode step replaying graphs"
    ),
    fix_parts=(PART,),
    buggy_outcome=FAULT,
    scenarios=(
        Scenario(
            "ep_decode_buckets",
            (Expect(frozenset({PART}), FAULT),),
            timeout_s=120.0,
            axes=Axes(
                graph_modes=("FULL",),
                capture_sizes=(2, 4, 8),
                steps_per_size=3,
                states=(
                    "EP ranks' batches in different graph buckets",
                    "EP ranks' batches in one graph bucket",
                    "one DP rank idle, its peer busy",
                ),
            ),
            signature=r"rank 0: illegal_address",
            cpu_signature=r"in _ep_expert_combine_kernel",
            ranks=2,
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    fuzz=(
        "not drawn yet: ranks (an expert-parallel world of two workers, each with its own "
        "decode batch) and the expert-parallel MoE layer's graph buckets; a program drives one "
        "worker of a dense model"
    ),
    anchors=(
        (
            PART,
            "python/sglang/srt/layers/dp_attention.py (or server args), require_mlp_tp_gather: "
            "True for the FlashInfer MoE all-to-all backend, so the decode CUDA-graph runner "
            "buckets by max(global_num_tokens_cpu) and the dispatcher sizes "
            "runtime_max_tokens_per_rank from the same max (#30450; file from the PR's words, "
            "not its diff)",
        ),
    ),
    history=(
        "Verified upstream (search, issues corpus): SGLang #27945 (merged; opened 2026-06-11: the "
        "FlashInfer A2A dispatcher sized runtime_max_tokens_per_rank from the local x.shape[0] "
        "when global_num_tokens collapsed; NaN logits in eager mode); #29461 (merged; opened "
        "2026-06-26: the dispatcher skips its runtime token-count query during graph capture, "
        "so each graph bakes its own rows); issue #30242 (closed: the IMA on GB300 "
        "disaggregated decode, bisected to #29461); #30450 (merged; opened 2026-07-08: the "
        "bucket from the cross-rank max). vLLM #25906 (merged; opened 2025-09-29: the DP/EP "
        "dummy run dispatched the CUDA graph on the local token count, not "
        "num_tokens_after_padding: a hang) and "
        "#18724 (every DP rank must launch the same dispatch and combine kernels: DP padding) "
        "are the vLLM side. Relatives in this catalogue: dp_zero_token_skip (an idle DP rank "
        "must still join the step's agreement; here an idle rank's dummy step must also pick "
        "the agreed bucket)."
    ),
)
