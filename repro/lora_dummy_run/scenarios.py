"""Scenarios of lora_dummy_run (vLLM #43139): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.fixes import Fix
from harness.oracle import decoder_reference, expect_all, mismatch
from harness.record import Context
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
    expected = decoder_reference(runner.model, [0] * DUMMY_TOKENS, [-1] * DUMMY_TOKENS)
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
