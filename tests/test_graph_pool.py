"""The shared graph pool (vLLM #53520): graph outputs laid where the pool's free memory is, so
two graphs of one pool alias by construction on either device, and the runner's padded
drafter replays over the target's outputs unless they were copied first."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.oracle import close
from harness.runner.cudagraph import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    CUDAGraphMode,
    GraphPool,
    Launcher,
)
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, runner_config

pytestmark = pytest.mark.graph_output_alias
BUGGY = ALL_FIXES - {Fix.GRAPH_OUTPUT_COPY_BEFORE_DRAFT}
DESC = BatchExecutionDescriptor(CUDAGraphMode.FULL, 4, 4)


def _scaled(launch: Launcher, x: torch.Tensor, factor: float):
    """create_forward_fn of a graph whose one output is `factor * x`, allocated in capture."""

    def create(desc, warmup=True):
        def forward(mode):
            out = torch.empty_like(x)
            launch(torch.mul, x, factor, out=out)
            return (out,)

        return forward, None

    return create


@pytest.mark.parametrize("shared", [True, False], ids=["one pool", "own outputs"])
def test_two_graphs_of_one_pool_alias_their_outputs(device, shared) -> None:
    launch, x = Launcher(), torch.arange(4.0, device=device)
    pool = GraphPool(8, torch.float32, device) if shared else None
    target, drafter = (CudaGraphManager(device, launch, output_pool=pool) for _ in range(2))
    target.capture([DESC], _scaled(launch, x, 2.0))
    drafter.capture([DESC], _scaled(launch, x, -1.0))
    (out,), (draft,) = target.run(DESC), drafter.outputs[DESC]
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0], "a replay writes its outputs"
    same = out.data_ptr() == draft.data_ptr()
    assert same == shared, f"outputs at {out.data_ptr():#x} and {draft.data_ptr():#x}"
    drafter.run(DESC)
    want = [-0.0, -1.0, -2.0, -3.0] if shared else [0.0, 2.0, 4.0, 6.0]
    assert out.tolist() == want, "the drafter's replay decides what the target's outputs read"


def test_a_graph_output_past_the_pool_is_refused(device) -> None:
    launch, x = Launcher(), torch.arange(4.0, device=device)
    manager = CudaGraphManager(device, launch, output_pool=GraphPool(3, torch.float32, device))
    with pytest.raises(ValueError, match=r"graph output \(4,\) torch.float32 past the pool"):
        manager.capture([DESC], _scaled(launch, x, 2.0))


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_the_targets_hidden_states_leave_the_pool_before_the_drafter(device, fixes) -> None:
    config = runner_config(
        device,
        fixes,
        enable_lora=False,
        cudagraph_mode=CUDAGraphMode.FULL,
        cudagraph_sizes=(8,),
        max_num_reqs=4,
        max_num_tokens=16,
        max_model_len=16,
        num_kv_blocks=8,
        draft_prefill=True,
        draft_graphs=True,
    )
    runner = ModelRunner(config)
    runner.capture_model()
    requests = [Request("a", (5, 9, 13)), Request("b", (7, 3))]
    out = runner.execute_model(requests)
    arena = runner.cudagraph_manager.output_pool.arena
    assert runner.drafter_graphs.output_pool is runner.cudagraph_manager.output_pool
    in_pool = out.hidden_states.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    assert in_pool == (fixes == BUGGY)
    assert out.logits.data_ptr() != arena.data_ptr(), "the sampler's logits are consumed first"
    if fixes == BUGGY:  # the pool's first elements are the drafter's logits now
        draft = runner.speculator.draft_logits[:4].flatten()
        assert torch.equal(out.hidden_states.flatten(), draft[: out.hidden_states.numel()])
    else:
        eager = runner.execute_model(requests, use_cudagraph=False)
        assert not close("replay vs eager", out.hidden_states, eager.hidden_states)


def test_draft_graphs_need_a_drafter(device) -> None:
    with pytest.raises(ValueError, match="draft_graphs needs a drafter"):
        ModelRunner(runner_config(device, enable_lora=False, draft_graphs=True))
