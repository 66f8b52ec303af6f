"""lora_dummy_run (vLLM #43139): LoRA metadata unset in dummy runs, a device-side assert.

With LoRA enabled, Model Runner V2's dummy runs (profile, warm-up, capture) never set a LoRA
mapping, so the punica wrapper's index buffers, allocated empty, still hold garbage when the
LoRA embedding gathers A rows at input_ids + embeddings_indices[1]: the gather's bounds assert
fires ("Triton Error [CUDA]: device-side assert triggered" upstream). The fix sets an all-zero
LoRAMapping in the dummy branch; convert_mapping turns id 0 into slot -1 and offset 0.
Run alone: `python -m repro.lora_dummy_run [--device cpu|cuda]`.
"""

from __future__ import annotations

import torch

from harness.fixes import Fix
from harness.oracle import expect_all, mismatch
from harness.outcome import ByDevice, Outcome
from harness.record import BugRecord, Context, Expect, Scenario
from harness.runner.model_runner import ModelRunner, RunnerConfig

DUMMY_TOKENS, DUMMY_REQS = 8, 2


def lora_runner(ctx: Context) -> ModelRunner:
    """A runner with LoRA enabled and two adapters loaded (ids 1 and 2), no mapping set yet."""
    runner = ModelRunner(RunnerConfig(ctx.device, ctx.fixes))
    runner.add_lora(1, seed=ctx.seed + 11)
    runner.add_lora(2, seed=ctx.seed + 12)
    return runner


def dummy_run_before_mapping(ctx: Context) -> str:
    """A profile-style dummy run with LoRA enabled before any real LoRA mapping.

    Fixed: the run completes, its logits equal the base model's, every wrapper's
    active_lora_ids is all -1, and no_lora_flag_cpu is set (cleared again, with
    num_active_loras_cpu = 1, where lora_capture_launch is on). Buggy: the LoRA embedding
    gathers with poisoned offsets: device-side assert on the GPU; torch's CPU gather raises
    IndexError("index out of range in self"), the same check.
    """
    runner = lora_runner(ctx)
    logits = runner.execute_model(dummy_run=True, num_tokens=DUMMY_TOKENS, num_reqs=DUMMY_REQS)
    expected = runner.model.reference([0] * DUMMY_TOKENS, [-1] * DUMMY_TOKENS)
    problems = [mismatch("dummy-run logits vs base model", logits.double().cpu(), expected)]
    launch_anyway = Fix.LORA_CAPTURE_LAUNCH in ctx.fixes
    for i, wrapper in enumerate(runner.lora_manager._adapter_manager.distinct_wrappers()):
        meta = wrapper.token_mapping_meta
        problems.append(
            mismatch(
                f"wrapper {i} active_lora_ids",
                meta.active_lora_ids.cpu(),
                torch.full_like(meta.active_lora_ids.cpu(), -1),
            )
        )
        flag, active = bool(meta.no_lora_flag_cpu[0]), int(meta.num_active_loras_cpu[0])
        if (flag, active) != (not launch_anyway, int(launch_anyway)):
            problems.append(f"wrapper {i}: no_lora_flag_cpu={flag}, num_active_loras_cpu={active}")
    expect_all(problems)
    return f"dummy run of {DUMMY_TOKENS} tokens equals the base model; LoRA ids all -1"


ASSERT = ByDevice.both(Outcome.DEVICE_ASSERT)

RECORD = BugRecord(
    id="lora_dummy_run",
    title="LoRA metadata unset in dummy runs: device-side assert",
    upstream="https://github.com/vllm-project/vllm/pull/43139",
    symptom="Triton Error [CUDA]: device-side assert triggered in a dummy run with LoRA enabled",
    root_cause=(
        "the dummy-run branch of execute_model never sets a LoRA mapping, so the LoRA index "
        "buffers (allocated empty) hold garbage that a gather indexes with"
    ),
    trigger="any dummy run (profile, warm-up, capture) with LoRA enabled before a real batch",
    fix_parts=(Fix.LORA_DUMMY_MAPPING,),
    buggy_outcome=ASSERT,
    scenarios=(
        Scenario(
            "dummy_run_before_mapping",
            dummy_run_before_mapping,
            (Expect(frozenset({Fix.LORA_DUMMY_MAPPING}), ASSERT),),
        ),
    ),
    history=(
        "Merged as a stop-gap, to be replaced by LoRA warm-up (PR #35536). Its all-(-1) "
        "mapping made CUDA-graph capture skip every LoRA kernel: regression "
        "lora_graph_capture (#43314)."
    ),
)


if __name__ == "__main__":
    from harness.cli import run_alone

    run_alone(RECORD.id)
