"""The sentinel sweep (repro/sentinels.py): every contract is honoured on this tree, and
breaks when its consumer's guard is removed (the guard's edits applied to a copy of the tree,
or its fix part turned off): each guard is the one thing between the sentinel and the data."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from repro import registry
from repro.sentinels import CONTRACTS, NAMES, run

ROOT = Path(__file__).resolve().parent.parent
TREE = ("harness", "kernels", "repro", "csrc")


def _marks(contract):
    marks = [pytest.mark.sentinels]
    if contract.bug:
        marks.append(getattr(pytest.mark, contract.bug))
    return marks


CASES = [pytest.param(c, id=c.name, marks=_marks(c)) for c in CONTRACTS]


@pytest.mark.parametrize("contract", CASES)
def test_every_consumer_honours_its_sentinel(contract, device):
    assert run(contract, device) == []


@pytest.mark.parametrize("contract", CASES)
def test_removing_the_guard_breaks_the_contract(contract, device, tmp_path):
    """In a child process on a copy of the tree: a consumer without its guard may fault (a
    device-side assert ends the process's CUDA context; an out-of-bounds load in Triton's
    interpreter ends the process with SIGSEGV, the CPU's illegal address)."""
    for directory in TREE:
        shutil.copytree(ROOT / directory, tmp_path / directory)
    for file, old, new in contract.edits:
        path = tmp_path / file
        path.write_text(path.read_text().replace(old, new))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "repro.sentinels", contract.name, "--device", device]
    command += ["--without-part"] if contract.part else []
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    if proc.returncode == -signal.SIGSEGV:  # the interpreter's illegal address: the process dies
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{contract.name}: BROKEN" in proc.stdout, proc.stdout


@pytest.mark.sentinels
def test_the_catalogue_is_whole():
    """Every guard is either edits that apply once to this tree or a registered bug's fix part;
    every contract is listed in docs/tools.md; names are unique; usage errors exit 2."""
    assert len(NAMES) == len(CONTRACTS)
    page = (ROOT / "docs" / "tools.md").read_text()
    for c in CONTRACTS:
        assert bool(c.edits) != (c.part is not None), c.name
        for file, old, _ in c.edits:
            assert (ROOT / file).read_text().count(old) == 1, (c.name, file, old)
        if c.part is not None:
            assert c.part in registry.get(c.bug).fix_parts, c.name
        assert f"`{c.name}`" in page, f"{c.name} is not in docs/tools.md's sentinel table"
    proc = subprocess.run(
        [sys.executable, "-m", "repro.sentinels", "no_such_contract"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unknown contract no_such_contract" in proc.stderr


@pytest.mark.sentinels
def test_the_fuzzers_sentinel_rule_sees_a_write_outside_the_real_slots(device):
    """repro fuzz's rule (repro/program.py): after a step, only its real tokens' slots changed.
    A padded FULL-graph step passes; a write into a slot no request owns is named."""
    import json

    import torch

    from harness.fixes import ALL_FIXES
    from harness.record import Context
    from repro.program import Machine

    config = {"mode": "FULL", "sizes": [4], "backend": "paged", "draft": False}
    config |= {"tables_in_graph": False, "lora": False, "max_loras": 2, "specialize": False}
    machine = Machine(Context(ALL_FIXES, device), config)
    machine.apply(["capture"])
    shape = [[0, 2, 0]]  # one request, 2 tokens: padded to the 4-token graph
    before = machine.kv_snapshot()
    assert [p for p in machine.apply(["step", shape, 0]) if p] == []
    assert machine.kv_written_outside(before, shape) == []
    owned = {machine.runner.kv_cache.slot(0, 0, p) for p in range(2)}
    stray = next(s for s in range(64) if s not in owned)
    k = machine.runner.kv_cache.k_caches[0]
    k.view(-1, *k.shape[2:])[stray] = torch.full(k.shape[2:], 3.0)
    found = machine.kv_written_outside(before, shape)
    assert len(found) == 1 and f"slots [{stray}]" in found[0], (found, json.dumps(shape))
