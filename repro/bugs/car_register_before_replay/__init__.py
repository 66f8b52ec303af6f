"""car_register_before_replay (vLLM #28334, #28318): a graph replayed inside the custom
all-reduce's capture window reads rank-data rows that are registered only when it closes.

vLLM's custom all-reduce cannot know, while a CUDA graph is being captured, where its input
lies in each peer's graph pool: each captured call points its kernel at the next row of a
pre-allocated rank-data table and records its input; only when the communicator's capture
context exits (register_graph_buffers) are the peers' IPC handles exchanged and the rows
filled. With LoRA graphs specialised, each size's dummy run runs once per LoRA case; with
speculative decoding the drafter's dummy run carries no LoRA case, so the second case replays
the draft graph the first captured, inside the window: an illegal memory access. The fix gives
the drafter's dummy run the target's descriptor, LoRA case included. Runs as two rank
processes (Scenario.ranks): `python -m repro.bugs.car_register_before_replay`.
"""

from __future__ import annotations

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import Axes, BugRecord, Expect, Fidelity, Scenario

ILLEGAL = ByDevice.both(Outcome.ILLEGAL_ADDRESS)
PART = Fix.DRAFT_GRAPH_LORA_KEY

# How true to upstream (DESIGN.md 15), graded by what was read (search, issues corpus).
FIDELITY = Fidelity(
    grade="simplified",
    evidence=(
        "#28334's description (open: the custom all-reduce kernel faults with an illegal "
        "memory access when called in a captured graph before CustomAllReduce.capture exits; "
        "after #25914's LoRA graph specialisation the dummy run runs twice per num_tokens, "
        "with and without LoRA, and with spec decoding the second replays the draft model's "
        "graph, which does not depend on the LoRA flag; #28318 a temporary fix); #28318's "
        "description (merged: LoRA with EAGLE fails unless cudagraph_specialize_lora is off; "
        "the PR passes the batch_descriptor with the LoRA specialisation to "
        "drafter.dummy_run); #2192's review thread on custom_all_reduce.cuh (during capture "
        "the kernel is given d_rank_data_base_ + graph_unreg_buffers_.size() and the input is "
        "recorded; the peers' pointers are filled after capture); SGLang #14193's description "
        "(the capture() context manager sets _IS_CAPTURING and calls register_graph_buffers "
        "at its end; piecewise graphs without it fault with an illegal memory access); "
        "flashinfer #1894's description (buffers registered wrongly during capture leave the "
        "base pointer uninitialized: illegal memory access); #25914's review (graph keys per "
        "has_lora); #32005's title (one graph per active-LoRA count)"
    ),
    not_verified=(
        "#28318's diff line by line (its description was read); SGLang #21907 (not found in "
        "the corpus); the exact order of vLLM's capture loop (sizes and LoRA cases) and "
        "whether its warm-up runs inside graph_capture()"
    ),
    what=(
        "the TP path is a target and a drafter of one row-parallel projection each "
        "(harness/runner/tensor_parallel.py), no attention, no sampling; the graph pool is an "
        "arena of peer memory from which captured producers take their outputs, its peers' "
        "addresses exchanged as offsets (upstream: IPC handles and offsets); an unregistered "
        "row holds -1 (upstream: whatever the pre-allocated rank data held); LoRA cases are "
        "active-adapter counts (2, 1, 0) with no LoRA kernels; the all-reduce is one stage, "
        "one program, float32"
    ),
)

RECORD = BugRecord(
    id="car_register_before_replay",
    title="A graph replayed inside the custom all-reduce's capture window reads unregistered rows",
    upstream="https://github.com/vllm-project/vllm/pull/28318",
    symptom=(
        "with tensor parallelism, the custom all-reduce, LoRA (cudagraph_specialize_lora) and "
        "EAGLE speculative decoding, graph capture fails: an illegal memory access (#28334)"
    ),
    root_cause=(
        "a captured all-reduce reads every rank's input through a rank-data row filled only "
        "when the capture window closes (register_graph_buffers); the drafter's dummy run is "
        "keyed without the LoRA case, so a size's second LoRA case replays the draft graph "
        "captured by its first, inside the window"
    ),
    trigger=(
        "two TP ranks, LoRA graphs specialised (two or more cases per size) and a drafter: "
        "capture any size"
    ),
    fix_parts=(PART,),
    buggy_outcome=ILLEGAL,
    scenarios=(
        Scenario(
            "capture_window_replay",
            (Expect(frozenset({PART}), ILLEGAL),),
            timeout_s=120.0,
            axes=Axes(
                graph_modes=("NONE", "FULL"),
                capture_sizes=(8, 4),
                steps_per_size=3,
                states=(
                    "graph replayed inside the capture window",
                    "graph replayed after the capture window",
                    "the capture window's first graph and later ones",
                    "eager all-reduce through the registered buffer",
                ),
            ),
            # the interpreter's fault, in the all-reduce's load of an input (a GPU names none)
            cpu_signature=r'kernels/custom_allreduce\.py", line \d+ in _custom_allreduce_kernel\b',
            ranks=2,
        ),
    ),
    package=__name__,
    fidelity=FIDELITY,
    fuzz=(
        "not drawn yet: ranks (a tensor-parallel world of two workers over the custom "
        "all-reduce) with a drafter and LoRA graph cases; a program drives one worker"
    ),
    anchors=(
        (
            PART,
            "vllm/v1/worker/gpu_model_runner.py, _dummy_run: drafter.dummy_run is given the "
            "batch descriptor (its LoRA specialisation) (#28318); "
            "vllm/distributed/device_communicators/custom_all_reduce.py, capture() and "
            "register_graph_buffers; csrc/custom_all_reduce.cuh, the capture-time rank data",
        ),
    ),
    history=(
        "Verified upstream (search, issues corpus): issue #28334 (open, 2025-11-08: tracks a "
        "longer-term fix; #28318 named temporary); #28318 (merged, opened 2025-11-07: the "
        "drafter's dummy run gets the batch descriptor); #25914 (merged: LoRA CUDA-graph "
        "specialisation, the dummy run twice per size); #32005 (merged: one graph per "
        "active-LoRA count); #2192 (the custom all-reduce and its capture-time rank data); "
        "SGLang #14193 (closed: piecewise graphs captured without the capture context, never "
        "registered: illegal memory access), #11275 (open: errors hidden during capture with "
        "custom all-reduce); flashinfer #1894 (merged: vLLM-style graph registration, base "
        "pointer uninitialized); ROCm/aiter #2638 (merged: ranks recording different counts "
        "of graph buffers), #3838 (merged: stale addresses of graph-captured tensors before "
        "registration). Relatives in this catalogue: allreduce_flag_epoch (the same kernel's "
        "round under replay), graph_output_alias (a drafter graph replayed into a shared pool)."
    ),
)
