"""rank_rng_divergence (vLLM #17929): tensor-parallel ranks with an unset seed must draw the
same acceptance uniforms. The mechanism at the runner level (two ranks' generators built in one
process, each after its own process state), the rejection rule, and the scenario as two rank
processes (harness/ranks.py), whose buggy traces disagree at the drafter's all-reduce."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.parallel import Collectives, ParallelConfig
from harness.runner.rejection_sampler import rejection_sample

pytestmark = [pytest.mark.rank_rng_divergence, pytest.mark.distributed, pytest.mark.cpu_job]

BUGGY = ALL_FIXES - {Fix.SEED_DEFAULT_ZERO}


def _rank_uniforms(fixes, rank: int, seed: int | None = None) -> torch.Tensor:
    """The first acceptance uniforms of TP rank `rank`'s runner, built in a process whose own
    random state is rank-specific (as two unseeded worker processes are)."""
    torch.manual_seed(1000 + rank)
    parallel = ParallelConfig(world_size=2, rank=rank, tensor_parallel_size=2)
    config = runner_config(
        "cpu",
        fixes,
        cudagraph_mode=CUDAGraphMode.NONE,
        enable_lora=False,
        rejection_sampling=True,
        seed=seed,
        parallel=parallel,
    )
    runner = ModelRunner(config, collectives=Collectives(parallel, "cpu"))
    return torch.rand(4, generator=runner.rejection_generator)


def test_fixed_tp_ranks_draw_alike_with_the_seed_unset() -> None:
    assert torch.equal(_rank_uniforms(ALL_FIXES, 0), _rank_uniforms(ALL_FIXES, 1))
    zero = torch.rand(4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_rank_uniforms(ALL_FIXES, 1), zero), "the unset seed is 0"


def test_buggy_tp_ranks_draw_apart_with_the_seed_unset() -> None:
    assert not torch.equal(_rank_uniforms(BUGGY, 0), _rank_uniforms(BUGGY, 1))


def test_a_set_seed_is_shared_either_way() -> None:
    for fixes in (ALL_FIXES, BUGGY):
        assert torch.equal(_rank_uniforms(fixes, 0, seed=7), _rank_uniforms(fixes, 1, seed=7))


def test_rejection_rule_accepts_while_p_passes_u_times_q() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]))
    # draft 0 accepted (0.5 >= 0.9 * 0.5), draft 1 accepted (0.6 >= 0.5 * 1), bonus: token 2
    assert rejection_sample(logits, [0, 1], [0.5, 1.0], torch.tensor([0.9, 0.5])) == ([0, 1, 2], 2)
    # draft 1 rejected (0.6 < 0.7): the recovered token is the best other one, token 2
    assert rejection_sample(logits, [0, 1], [0.5, 1.0], torch.tensor([0.9, 0.7])) == ([0, 2], 1)
    # a draft of probability 0 is never accepted
    assert rejection_sample(logits, [0], [0.0], torch.tensor([0.0])) == ([1], 0)
