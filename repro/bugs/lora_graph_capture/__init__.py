"""lora_graph_capture (vLLM #43314): LoRA kernels never captured in CUDA graphs.

The fix of #43139 sets an all-zero LoRAMapping in dummy runs; prepare_tensors then finds every
token on slot -1 and sets no_lora_flag_cpu, so the shrink/expand host wrappers return before
launching. Capture runs host code once: the graphs hold no LoRA kernel, and every replay drops
the LoRA delta silently (a spec-decode LoRA test fell to 76/100 matches upstream). The fix
clears the flag and sets num_active_loras_cpu = 1 on each distinct punica wrapper after the
dummy mapping: the kernels are captured and each program exits on lora_id == -1 until a real
batch refreshes the same buffers. Run alone: `python -m repro.bugs.lora_graph_capture`.
"""

from __future__ import annotations

import dataclasses

from harness.fixes import Fix
from harness.outcome import ByDevice, Outcome
from harness.record import BugRecord, Expect, Fidelity, Scenario
from repro.bugs.lora_dummy_run import CAPTURE_AXES

WRONG = ByDevice.both(Outcome.WRONG_RESULT)
ASSERT = ByDevice.both(Outcome.DEVICE_ASSERT)
WARM_UP_FIRST = "the warm-up dummy run hits lora_dummy_run (#43139) first"


def _scenario(name: str, why_assert: str) -> Scenario:
    """Without lora_dummy_mapping too: #43139's assert (`why_assert`); else a wrong result."""
    rules = (
        Expect(frozenset({Fix.LORA_DUMMY_MAPPING}), ASSERT, why=why_assert),
        Expect(frozenset({Fix.LORA_CAPTURE_LAUNCH}), WRONG),
    )
    mode = "PIECEWISE" if name == "piecewise_graphs" else "FULL"
    axes = dataclasses.replace(CAPTURE_AXES, graph_modes=(mode,))
    if name == "specialized_graphs":  # one size, 8 tokens, per LoRA case: every batch on it
        axes = dataclasses.replace(axes, capture_sizes=(8,), steps_per_size=3)
    return Scenario(
        name,
        rules,
        timeout_s=240.0,
        axes=axes,
        signature=r"replay hidden states vs eager: \d+/\d+ differ",
    )


# How true to upstream (DESIGN.md 15), graded by what was read (2026-11-27, search).
FIDELITY = Fidelity(
    grade="faithful",
    evidence=(
        "seed 001 (#43314 digest): after #43139, test_lora_with_spec_decode at 76/100; the all -1"
        " mapping short-circuits the wrappers so capture records no LoRA kernel; the fix sets "
        "no_lora_flag_cpu False and num_active_loras_cpu 1 per distinct punica wrapper"
    ),
    not_verified="the PR thread itself (the seed only)",
)

RECORD = BugRecord(
    id="lora_graph_capture",
    title="LoRA kernels never captured in CUDA graphs: replays drop the LoRA delta",
    upstream="https://github.com/vllm-project/vllm/pull/43314",
    symptom="silent wrong output with LoRA and CUDA graphs (76/100 matches in a spec-decode test)",
    root_cause=(
        "the dummy all-(-1) mapping sets no_lora_flag_cpu; the shrink/expand host wrappers "
        "return before launching while capture runs host code once"
    ),
    trigger="CUDA-graph capture after the #43139 dummy mapping, then batches with LoRA",
    fix_parts=(Fix.LORA_CAPTURE_LAUNCH,),
    buggy_outcome=WRONG,
    scenarios=tuple(
        _scenario(name, why)
        for name, why in (
            ("full_graphs", WARM_UP_FIRST),
            ("piecewise_graphs", WARM_UP_FIRST),
            ("specialized_graphs", WARM_UP_FIRST),
            (
                "capture_without_dummy_run",
                "nothing set the LoRA metadata before the capture's warm-up",
            ),
            (
                "capture_after_base_batch",
                "the real batch wrote offsets for its 5 tokens only; the 8-token capture "
                "reads the poisoned rest",
            ),
        )
    ),
    package=__name__,
    fidelity=FIDELITY,
    anchors=(
        (
            Fix.LORA_CAPTURE_LAUNCH,
            "vllm/v1/worker/gpu/model_runner.py, the dummy-run branch after the all-zero "
            "mapping: for each distinct punica wrapper, the token and prompt LoRAKernelMeta "
            "(vllm/lora/ops/triton_ops/lora_kernel_metadata.py) get no_lora_flag_cpu = False, "
            "num_active_loras_cpu = 1; the host check it defeats is in lora_shrink_op.py and "
            "lora_expand_op.py",
        ),
    ),
    history=(
        "A regression caused by the fix of lora_dummy_run (#43139, fix part "
        "lora_dummy_mapping): with both LoRA fix parts off the full, piecewise and "
        "specialized scenarios show #43139's device-side assert instead of a wrong result. "
        "Follow-ups upstream: #35536 (a LoRA capture hook per active-LoRA count, "
        "num_active_loras in the dispatch key), #43160 (PIECEWISE capture with LoRA on the "
        "default stream), #43084 (capture with has_lora=False looked up with has_lora=True)."
    ),
)
