"""CUDA-graph semantics, pinned identically on the GPU (real graphs) and the CPU (emulation)."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.runner.cudagraph import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    CUDAGraphMode,
    Launcher,
    capturing,
    host_sync,
)


def test_host_branch_taken_at_capture_is_frozen(device) -> None:
    launch, flag = Launcher(), torch.tensor([True])
    out = torch.zeros(4, device=device)
    with capturing(launch, device, None) as graph:
        launch(out.fill_, 1.0 if flag[0] else 2.0)
    flag[0] = False
    out.zero_()
    graph.replay()
    assert out.tolist() == [1.0] * 4


def test_in_place_updates_are_seen_at_replay(device) -> None:
    launch = Launcher()
    inp, out = torch.zeros(3, device=device), torch.zeros(3, device=device)
    with capturing(launch, device, None) as graph:
        launch(torch.add, inp, 1.0, out=out)
    for value in (5.0, -2.0):
        inp.fill_(value)
        graph.replay()
        assert out.tolist() == [value + 1.0] * 3


def test_work_skipped_by_a_host_check_is_absent_from_every_replay(device) -> None:
    launch, skip = Launcher(), torch.tensor([True])
    out = torch.full((2,), -7.0, device=device)

    def forward() -> None:
        launch(out.add_, 1.0)
        if not skip[0]:
            launch(out.mul_, 10.0)

    with capturing(launch, device, None) as graph:
        forward()
    skip[0] = False
    for _ in range(2):
        graph.replay()
    assert out.tolist() == [-5.0, -5.0]
    assert graph.launches == ["add_"]


def test_capture_records_instead_of_running_and_keeps_allocations(device) -> None:
    launch = Launcher()
    inp = torch.full((4,), 3.0, device=device)
    with capturing(launch, device, None) as graph:
        tmp = torch.empty(4, device=device)  # allocated during capture
        launch(torch.mul, inp, 2.0, out=tmp)
    ptr = tmp.data_ptr()
    inp.fill_(4.0)
    graph.replay()
    assert tmp.data_ptr() == ptr and tmp.tolist() == [8.0] * 4


def test_what_capture_allocates_holds_poison_until_a_replay(device) -> None:
    launch = Launcher()
    inp = torch.full((4,), 3.0, device=device)
    with capturing(launch, device, None) as graph:
        ints = torch.empty(4, 4, dtype=torch.int32, device=device)
        floats = torch.empty(4, device=device)
        launch(ints.fill_, 7)
        launch(torch.mul, inp, 2.0, out=floats)
    assert (ints == 2**31 - 1).all().item(), "recorded, not run: int32 max"
    assert floats.isnan().all().item(), "float32 NaN"
    graph.replay()
    assert (ints == 7).all().item() and floats.tolist() == [6.0] * 4


@pytest.mark.moe_lora_consumer_grid
def test_tensor_ops_in_capture_run_at_every_replay(device) -> None:
    """Ops outside the Launcher are device work a graph records too: a zeros() made in capture
    is zeroed again at every replay, a direct in-place op and a functional one run there."""
    launch, inp = Launcher(), torch.zeros(4, device=device)
    with capturing(launch, device, None) as graph:
        acc = torch.zeros(4, device=device)  # a captured memset
        launch(acc.add_, inp)
        acc.add_(1.0)  # direct, in place: recorded, not run
        out = acc * 2.0  # direct, functional: allocated now, written at replay
    assert out.isnan().all().item(), "not run at capture: poison"
    for value in (0.0, 3.0, 3.0):
        inp.fill_(value)
        graph.replay()
        assert acc.tolist() == [value + 1.0] * 4, "zeroed again at every replay"
        assert out.tolist() == [2.0 * (value + 1.0)] * 4


REBINDS = {
    "data": lambda t, new: setattr(t, "data", new),
    "set_": lambda t, new: t.set_(new),
}


@pytest.mark.block_table_graph_wake
@pytest.mark.parametrize("rebind", sorted(REBINDS))
def test_replay_keeps_the_storage_capture_saw(device, rebind) -> None:
    """A graph holds addresses: after `.data =` or `set_()` the object has a new storage, and
    replay still reads and writes the old one (the CPU emulation binds storages too)."""
    launch = Launcher()
    inp, out = torch.full((4,), 2.0, device=device), torch.zeros(4, device=device)
    with capturing(launch, device, None) as graph:
        launch(torch.mul, inp, 3.0, out=out)
        launch(out.add_, 1.0)  # a method of a captured tensor
    old_inp, old_out = inp.data, out.data  # the captured storages (aliases of them)
    REBINDS[rebind](inp, torch.full((4,), 5.0, device=device))
    REBINDS[rebind](out, torch.full((4,), -1.0, device=device))
    assert inp.data_ptr() != old_inp.data_ptr() and out.data_ptr() != old_out.data_ptr()
    graph.replay()
    assert out.tolist() == [-1.0] * 4, "the rebound output is not written"
    assert old_out.tolist() == [7.0] * 4, "the captured storage is written, from the old input"
    old_inp.fill_(10.0)  # in place, on the captured storage: seen
    graph.replay()
    assert old_out.tolist() == [31.0] * 4


@pytest.mark.capture_first_call
def test_a_host_sync_is_refused_while_capturing(device) -> None:
    if device == "cuda":
        pytest.skip("the GPU refuses it by invalidating the capture: shown in a child process")
    launch = Launcher()
    host_sync(launch, device)  # eager: fine
    refused = pytest.raises(RuntimeError, match="stream is capturing")
    with refused, capturing(launch, device, None):
        host_sync(launch, device)


def test_manager_warms_up_captures_and_dispatches(device) -> None:
    launch = Launcher()
    manager = CudaGraphManager(device, launch)
    inp = torch.zeros(16, device=device)
    calls = []

    def create_forward_fn(desc: BatchExecutionDescriptor, warmup: bool = True):
        def forward(mode: CUDAGraphMode) -> torch.Tensor:
            calls.append((desc.num_tokens, mode))
            out = torch.empty(desc.num_tokens, device=device)
            launch(torch.add, inp[: desc.num_tokens], 1.0, out=out)
            return out

        return forward, None

    full = [BatchExecutionDescriptor(CUDAGraphMode.FULL, n, n, True) for n in (4, 8)]
    piecewise = [BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, n, n) for n in (4, 8)]
    manager.capture(full + piecewise, create_forward_fn)
    # PIECEWISE first (larger activations), then FULL; largest first in each; FULL: warm-up,
    # the capture path once eagerly, capture (in mode NONE: the whole forward is in the graph)
    assert [n for n, _ in calls] == [8, 8, 4, 4, 8, 8, 8, 4, 4, 4]
    assert [m for _, m in calls][:4] == [CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE] * 2
    assert [m for _, m in calls][4:] == [CUDAGraphMode.NONE] * 6
    dispatch = manager.dispatch
    assert dispatch(3, 3, True) == full[0] and dispatch(5, 5, True) == full[1]
    assert dispatch(3, 2, False) == piecewise[0] and dispatch(5, 5, False) == piecewise[1]
    assert dispatch(9, 1, False) is None and dispatch(3, 3, True, lora_case=2) is None
    inp.copy_(torch.arange(16.0))
    assert manager.run(dispatch(6, 6, True)).tolist() == [float(i + 1) for i in range(8)]


def test_piecewise_runs_outside_work_eagerly_at_every_replay(device) -> None:
    launch, calls = Launcher(), []
    out = torch.zeros(2, device=device)

    def attention(value: float) -> None:
        calls.append(value)  # host code: runs at capture in FULL, at every replay in PIECEWISE
        launch(out.add_, value)

    def forward() -> None:
        launch(out.mul_, 2.0)
        launch.outside_graph(attention, 1.0)
        launch(out.add_, 10.0)

    with capturing(launch, device, None, piecewise=True) as graph:
        forward()
    assert calls == [] and graph.launches == ["mul_", "eager attention", "add_"]
    graph.replay()
    graph.replay()
    assert calls == [1.0, 1.0] and out.tolist() == [33.0, 33.0]  # (0*2+1+10)*2+1+10
    with capturing(launch, device, None) as full:
        forward()
    assert calls == [1.0, 1.0, 1.0] and full.launches == ["mul_", "add_", "add_"]


NONE, FULL, PIECEWISE = CUDAGraphMode.NONE, CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
# upstream's order (vLLM #46523's test, test_full_cudagraph_capture_prewarms_fresh_capture_
# forward_fn): (forward function, mode passed, inside the graph?); "warmup" is made with
# warmup=True, "capture-N" is the N-th made with warmup=False
UPSTREAM_ORDER = [("warmup", NONE, False), ("capture-1", NONE, False), ("capture-2", NONE, True)]


def _record_capture(device: str, mode: CUDAGraphMode, fixes) -> tuple:
    """Capture one descriptor with a factory that records every forward call: (the calls,
    the manager, the descriptor, each forward function's attention state by label)."""
    manager, calls, states = CudaGraphManager(device, Launcher(), fixes), [], {}

    def create_forward_fn(desc, warmup: bool):
        made = sum(label.startswith("capture") for label in states)
        label = "warmup" if warmup else f"capture-{made + 1}"
        states[label] = object()

        def forward(cg_mode: CUDAGraphMode) -> torch.Tensor:
            calls.append((label, cg_mode, manager.launcher.capturing))
            return torch.zeros(1, device=device)

        return forward, states[label]

    desc = BatchExecutionDescriptor(mode, 4, 4, uniform_decode=mode == FULL)
    manager.capture([desc], create_forward_fn)
    return calls, manager, desc, states


@pytest.mark.lazy_attn_state
@pytest.mark.capture_first_call
def test_full_capture_prewarms_a_fresh_capture_forward_fn(device) -> None:
    """Upstream's order: the general warm-up, a disposable capture-compatible function run
    eagerly (the prewarm), then another fresh one captured, whose state is kept."""
    calls, manager, desc, states = _record_capture(device, FULL, ALL_FIXES)
    assert calls == UPSTREAM_ORDER
    assert manager.warmup_attn_states[desc] is states["warmup"]
    assert manager.captured_attn_states[desc] is states["capture-2"]


BUGGY_ORDERS = [
    pytest.param(  # vLLM #46523's bug: the capture path's first call is the capture
        Fix.CAPTURE_PREWARM,
        [("warmup", NONE, False), ("capture-1", NONE, True)],
        "capture-1",
        marks=pytest.mark.capture_first_call,
        id="capture_prewarm",
    ),
    pytest.param(  # vLLM #42444's bug: the warm-up's function (and state) is captured
        Fix.FRESH_ATTN_STATE_FOR_CAPTURE,
        [("warmup", NONE, False), ("capture-1", NONE, False), ("warmup", NONE, True)],
        "warmup",
        marks=pytest.mark.lazy_attn_state,
        id="fresh_attn_state_for_capture",
    ),
]


@pytest.mark.parametrize(("part", "order", "kept"), BUGGY_ORDERS)
def test_capture_order_without_a_part_is_not_upstreams(device, part, order, kept) -> None:
    calls, manager, desc, states = _record_capture(device, FULL, ALL_FIXES - {part})
    assert calls != UPSTREAM_ORDER and calls == order
    assert manager.captured_attn_states[desc] is states[kept]


@pytest.mark.capture_first_call
@pytest.mark.parametrize("fixes", [ALL_FIXES, frozenset()], ids=["fixed", "no_fixes"])
def test_piecewise_capture_runs_the_warmup_function_in_its_mode(device, fixes) -> None:
    calls, manager, desc, states = _record_capture(device, PIECEWISE, fixes)
    assert calls == [("warmup", NONE, False), ("warmup", PIECEWISE, True)]
    assert manager.captured_attn_states[desc] is states["warmup"]
