"""dp_drafter_boundary_hang (vLLM #44185, #40589): a DP rank whose batch cannot take its drafts
near max_model_len must still join the drafter's collectives. At the runner level, one rank's
collectives are recorded (no peer: nothing issued); the scenario runs as two rank processes
(harness/ranks.py), where the buggy ranks disagree and the trace oracle names it in seconds."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.parallel import Collectives, ParallelConfig

pytestmark = [pytest.mark.dp_drafter_boundary_hang, pytest.mark.distributed, pytest.mark.cpu_job]

PART = Fix.DP_DRAFTER_DUMMY_RUN
K, MAX_MODEL_LEN = 3, 12


class Recorded(Collectives):
    """One rank's collectives, recorded and not issued (its peers are imagined)."""

    def __init__(self, parallel: ParallelConfig) -> None:
        super().__init__(parallel, "cpu")
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def all_reduce(self, tensor: torch.Tensor, group: str = "dp", op: str = "sum"):
        self.ops.append((group, tuple(tensor.shape)))
        return tensor


def runner_of(fixes, data_parallel_size: int = 2) -> tuple[ModelRunner, Recorded]:
    parallel = ParallelConfig(
        world_size=data_parallel_size, rank=0, data_parallel_size=data_parallel_size
    )
    collectives = Recorded(parallel)
    config = runner_config(
        "cpu",
        fixes,
        cudagraph_mode=CUDAGraphMode.NONE,
        enable_lora=False,
        max_model_len=MAX_MODEL_LEN,
        num_speculative_tokens=K,
        parallel=parallel,
    )
    return ModelRunner(config, collectives=collectives), collectives


def step_at(runner: ModelRunner, seq_len: int):
    """A decode step whose sequence is `seq_len` long after it (earlier tokens: seeded KV)."""
    runner.kv_cache.reset()
    runner.kv_cache.fill_random(0)
    return runner.execute_model([Request("r", (5,), 0, seq_len - 1)], use_cudagraph=False)


TARGET = ("dp", (2,))  # the target's token-count agreement
DRAFT = ("dp", (2, 2))  # one draft step's batch agreement


@pytest.mark.parametrize("seq_len", [MAX_MODEL_LEN - K - 1, MAX_MODEL_LEN - K])
def test_a_batch_within_the_limit_drafts_and_joins_each_draft_step(seq_len) -> None:
    for fixes in (ALL_FIXES, ALL_FIXES - {PART}):
        runner, collectives = runner_of(fixes)
        out = step_at(runner, seq_len)
        assert out.drafts is not None and out.drafts.shape == (1, K)
        assert collectives.ops == [TARGET] + [DRAFT] * K
        assert runner.drafter.batches_across_dp == [[[1, 1], [0, 0]]] * K


@pytest.mark.parametrize("seq_len", [MAX_MODEL_LEN - K + 1, MAX_MODEL_LEN - 1])
def test_fixed_a_batch_past_the_limit_runs_the_dummy_draft_steps(seq_len) -> None:
    runner, collectives = runner_of(ALL_FIXES)
    out = step_at(runner, seq_len)
    assert out.drafts is None
    assert collectives.ops == [TARGET] + [DRAFT] * K  # as many as a drafting peer's
    assert runner.drafter.batches_across_dp == [[[1, 1], [0, 0]]] * K  # one token, one request


def test_buggy_a_batch_past_the_limit_skips_the_draft_steps() -> None:
    runner, collectives = runner_of(ALL_FIXES - {PART})
    out = step_at(runner, MAX_MODEL_LEN - K + 1)
    assert out.drafts is None
    assert collectives.ops == [TARGET]  # a drafting peer waits in its first draft step


def test_one_dp_rank_needs_no_dummy_draft_steps() -> None:
    runner, collectives = runner_of(ALL_FIXES, data_parallel_size=1)
    assert step_at(runner, MAX_MODEL_LEN - 1).drafts is None
    assert runner.drafter.batches_across_dp is None
    assert all(op != DRAFT for op in collectives.ops)


def test_an_idle_rank_dummy_step_runs_the_drafter_dummy_too() -> None:
    """A rank with zero tokens (dp_zero_token_skip's dummy step) joins the drafter's steps."""
    for fixes in (ALL_FIXES, ALL_FIXES - {PART}):
        runner, collectives = runner_of(fixes)
        assert runner.execute_model([], use_cudagraph=False).drafts is None
        assert collectives.ops == [TARGET] + [DRAFT] * K
