"""Oracle helpers: poisoned allocations, exact mismatch reports, canary-guarded buffers."""

from __future__ import annotations

import pytest
import torch

from harness.oracle import Guarded, expect_all, mismatch
from harness.outcome import ENV_ORACLE, WrongResult
from harness.runner.poison import poisoned_allocations
from harness.servers import child_env


def test_poisoned_allocations_fill_and_restore(device: str) -> None:
    before = torch.get_deterministic_debug_mode()
    fill_before = torch.utils.deterministic.fill_uninitialized_memory
    with poisoned_allocations():
        ints = torch.empty(5, dtype=torch.int32, device=device)
        floats = torch.empty(5, device=device)
    assert (ints == torch.iinfo(torch.int32).max).all(), ints
    assert floats.isnan().all(), floats
    assert torch.get_deterministic_debug_mode() == before
    assert torch.utils.deterministic.fill_uninitialized_memory == fill_before


def test_mismatch_reports_count_and_positions() -> None:
    a = torch.tensor([[1, 2], [3, 4]])
    assert mismatch("x", a, a.clone()) is None
    b = a.clone()
    b[1, 0] = 9
    assert mismatch("x", a, b) == "x: 1/4 differ (actual vs expected) (1, 0): 3 vs 9"
    assert "shape (2, 2) != expected (4,)" in mismatch("x", a, a.flatten())
    nan = torch.tensor([float("nan"), 1.0])
    assert mismatch("f", nan, nan.clone()) is None


def test_expect_all_raises_every_problem() -> None:
    expect_all([None, None])
    with pytest.raises(WrongResult, match="a\nb"):
        expect_all(["a", None, "b"])


def test_with_the_oracle_off_problems_are_printed_not_raised(monkeypatch, capsys) -> None:
    monkeypatch.setenv(ENV_ORACLE, "off")
    expect_all(["a", None, "b"])
    assert capsys.readouterr().err == "oracle off, not raised:\na\nb\n"
    monkeypatch.setenv(ENV_ORACLE, "on")
    with pytest.raises(WrongResult):
        expect_all(["a"])


def test_children_never_inherit_the_oracle_switch(monkeypatch) -> None:
    monkeypatch.setenv(ENV_ORACLE, "off")
    assert ENV_ORACLE not in child_env()


def test_guarded_buffer_reports_trampled_rows() -> None:
    g = Guarded.make(2, (3,), 4, fill=-2, canary=-99, dtype=torch.int32, device="cpu")
    assert g.view.shape == (2, 3) and (g.view == -2).all()
    g.view[1, 2] = 5  # inside: not a canary
    assert g.trampled("buf") is None
    g.base[5, 0] = 7
    assert g.trampled("buf") == "buf: canary overwritten in rows [5] (past its 2 real rows)"
