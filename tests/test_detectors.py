"""`repro detectors`: every detector's run of buggy and fixed variants, and its table."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness import device as devices
from harness.fixes import select_variant
from harness.isolate import Result
from harness.outcome import ENV_ORACLE, Outcome
from repro import detectors, registry
from repro.commands import dispatch
from tests.test_cli import validate


def fake_run(name: str, variant: str, outcome: Outcome, scenario: str = "s") -> detectors.Run:
    bug = registry.get("moe_align_grid")
    job = detectors.BY_NAME[name].job(
        bug, bug.scenarios[0].name, select_variant(bug.fix_parts, variant), "cpu"
    )
    job = dataclasses.replace(job, scenario=scenario)
    return detectors.Run(detectors.BY_NAME[name], Result(job, outcome, "evidence", 1.0), variant)


def test_detectors_run_with_the_oracle_off_but_the_oracle_itself() -> None:
    bug = registry.get("lora_dummy_run")
    fixes = select_variant(bug.fix_parts, "fixed")
    for d in detectors.DETECTORS:
        job = d.job(bug, bug.scenarios[0].name, fixes, "cuda")
        assert ((ENV_ORACLE, "off") in job.env) == (d.name != "oracle"), d.name
        assert job.fresh == (d.name != "oracle"), d.name
    memcheck = detectors.BY_NAME["memcheck+nocache"].job(bug, bug.scenarios[0].name, fixes, "cuda")
    assert memcheck.sanitizer == "memcheck"
    assert ("PYTORCH_NO_CUDA_MEMORY_CACHING", "1") in memcheck.env


def test_cells_say_flagged_clean_false_alarm_or_could_not_tell() -> None:
    assert fake_run("oracle", "buggy", Outcome.WRONG_RESULT).cell == "wrong_result"
    assert fake_run("none", "buggy", Outcome.PASS).cell == "-"
    assert fake_run("none", "fixed", Outcome.CRASH).cell == "FALSE ALARM crash"
    assert fake_run("none", "fixed", Outcome.ERROR).cell == "(error)"
    runs = [
        fake_run("none", "buggy", Outcome.PASS, "a"),
        fake_run("none", "buggy", Outcome.DEVICE_ASSERT, "b"),
        fake_run("none", "buggy", Outcome.SKIPPED, "c"),
    ]
    assert detectors.summary(runs) == "device_assert 1/3 (skipped 1/3)"
    rows = detectors.table(runs, per_bug=True)
    assert rows[0] == ("bug", "variant", "device", "none")
    assert rows[1:] == [("moe_align_grid", "buggy", "cpu", "device_assert 1/3 (skipped 1/3)")]
    assert len(detectors.table(runs, per_bug=False)) == 4


def test_usage_errors(capsys) -> None:
    assert dispatch(["detectors", "--bug", "nope"]) == 2
    assert "unknown bug id 'nope'" in capsys.readouterr().err
    assert dispatch(["detectors", "--detector", "valgrind"]) == 2
    assert "invalid choice: 'valgrind'" in capsys.readouterr().err
    assert dispatch(["detectors", "--jobs", "0"]) == 2


@pytest.mark.lora_graph_capture
@pytest.mark.lora_dummy_run
def test_silent_bug_needs_the_oracle_and_a_loud_one_shows_itself(tmp_path, capsys) -> None:
    """On the CPU: the graph-capture bug is invisible but to the oracle (no instrument sees a
    kernel missing from a graph); the dummy-run bug asserts with the oracle off too."""
    out, md = tmp_path / "d.json", tmp_path / "d.md"
    argv = ["detectors", "--device", "cpu", "--first-scenario", "--json", str(out)]
    argv += ["--bug", "lora_graph_capture", "--bug", "lora_dummy_run", "--markdown", str(md)]
    argv += ["--detector", "oracle", "--detector", "none", "--detector", "memcheck"]
    code = dispatch(argv)
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads(out.read_text())
    validate(doc)
    seen = {(r["bug"], r["variant"], r["detector"]): r["outcome"] for r in doc["results"]}
    assert seen == {
        ("lora_graph_capture", "buggy", "oracle"): "wrong_result",
        ("lora_graph_capture", "buggy", "none"): "pass",
        ("lora_graph_capture", "fixed", "oracle"): "pass",
        ("lora_graph_capture", "fixed", "none"): "pass",
        ("lora_dummy_run", "buggy", "oracle"): "device_assert",
        ("lora_dummy_run", "buggy", "none"): "device_assert",
        ("lora_dummy_run", "fixed", "oracle"): "pass",
        ("lora_dummy_run", "fixed", "none"): "pass",
    }
    assert "not run on cpu: memcheck: they need a GPU" in printed
    table = md.read_text()
    assert "| lora_graph_capture | buggy | cpu | `wrong_result` | - |" in table
    assert "| lora_dummy_run | fixed | cpu | - | - |" in table


@pytest.mark.gpu
@pytest.mark.moe_align_grid
def test_memcheck_flags_the_poisoned_consumer_and_no_fixed_variant(tmp_path, capsys) -> None:
    out = tmp_path / "d.json"
    argv = ["detectors", "--device", "cuda", "--bug", "moe_align_grid", "--json", str(out)]
    code = dispatch([*argv, "--detector", "oracle", "--detector", "memcheck"])
    assert code == 0, capsys.readouterr().out
    runs = json.loads(out.read_text())["results"]
    memcheck = {
        (r["scenario"], r["variant"]): r["outcome"] for r in runs if r["detector"] == "memcheck"
    }
    assert memcheck["consumer_poisoned", "buggy"] == "sanitizer_error"
    assert {o for (_, v), o in memcheck.items() if v == "fixed"} == {"pass"}
    assert devices.cuda_available()
