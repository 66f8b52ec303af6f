"""`repro report` (Markdown, HTML) and `repro diff` on small results documents."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest

from repro import report
from repro.commands import dispatch
from repro.results import document


def run(bug, scenario, variant, device, outcome, expected, seed=0) -> dict:
    return {
        "bug": bug,
        "scenario": scenario,
        "variant": variant,
        "fixes_off": [],
        "device": device,
        "gpu": None,
        "outcome": outcome,
        "expected": expected,
        "seed": seed,
        "seconds": 1.5,
        "scenario_seconds": 1.0,
        "evidence": f"evidence of {bug} {scenario} {variant} <&>",
    }


RUNS = [
    run("moe_align_grid", "last_slot_rows", "fixed", "cpu", "pass", "pass"),
    run("moe_align_grid", "last_slot_rows", "buggy", "cpu", "wrong_result", "wrong_result"),
    run("lora_dummy_run", "dummy_run_before_mapping", "fixed", "cpu", "error", "pass"),
    run(
        "lora_dummy_run",
        "dummy_run_before_mapping",
        "buggy",
        "cpu",
        "device_assert",
        "device_assert",
    ),
]


def write(tmp_path, name: str, runs: list[dict]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(document(runs)))
    return str(path)


def test_markdown_has_a_row_per_scenario_and_marks_the_unexpected() -> None:
    text = report.markdown([document(RUNS)])
    lines = text.splitlines()
    assert lines[0] == "| bug | scenario | fixed (cpu) | buggy (cpu) |"
    assert "| moe_align_grid | last_slot_rows | pass | wrong_result |" in lines
    assert (
        "| lora_dummy_run | dummy_run_before_mapping | error (UNEXPECTED 1, expected pass) |"
        in text
    )
    assert "3/4 runs as expected." in text


def test_detector_runs_get_their_own_columns_and_only_the_oracle_an_expectation(
    tmp_path, capsys
) -> None:
    buggy = run("lora_graph_capture", "full_graphs", "buggy", "cpu", "", "wrong_result")
    runs = [
        dict(buggy, outcome="wrong_result", detector="oracle"),
        dict(buggy, outcome="pass", detector="none"),
    ]
    text = report.markdown([document(runs)])
    assert "| bug | scenario | buggy (cpu none) | buggy (cpu oracle) |" in text
    assert "| lora_graph_capture | full_graphs | pass | wrong_result |" in text
    assert "2/2 runs as expected." in text
    a = write(tmp_path, "a.json", runs)
    b = write(tmp_path, "b.json", [runs[0], dict(runs[1], outcome="crash")])
    assert dispatch(["diff", a, b]) == 1
    assert "full_graphs buggy 0 none cpu: pass -> crash" in capsys.readouterr().out


class _Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows, self.cells, self.grid = 0, [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.grid |= tag == "table" and attrs.get("id") == "grid"
        self.rows += tag == "tr"
        if tag == "td":
            self.cells.append(attrs)


def test_html_grid_colours_cells_and_carries_the_evidence() -> None:
    page = report.html_page([document(RUNS)])
    parsed = _Cells()
    parsed.feed(page)
    assert parsed.grid and parsed.rows == 3 and len(parsed.cells) == 4  # header + 2 scenarios
    unexpected = [c for c in parsed.cells if "unexpected" in c["class"]]
    assert (
        len(unexpected) == 1
        and "lora_dummy_run dummy_run_before_mapping fixed <&>" in unexpected[0]["title"]
    )
    assert "&lt;&amp;&gt;" in page and "<details>" in page and "Provenance" in page


def test_diff_lists_changed_runs_and_exits_1(tmp_path, capsys) -> None:
    a = write(tmp_path, "a.json", RUNS)
    assert dispatch(["diff", a, a]) == 0
    changed = [dict(RUNS[0], outcome="wrong_result"), *RUNS[1:]]
    b = write(tmp_path, "b.json", changed)
    assert dispatch(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "moe_align_grid last_slot_rows fixed 0 cpu: pass -> wrong_result" in out
    assert "1 run(s) changed" in out


def test_diff_of_a_cpu_and_a_gpu_run_matches_runs_across_devices(tmp_path, capsys) -> None:
    a = write(tmp_path, "cpu.json", RUNS)
    b = write(tmp_path, "gpu.json", [dict(r, device="cuda") for r in RUNS])
    assert dispatch(["diff", a, b]) == 0, capsys.readouterr().out


def test_report_writes_files_and_refuses_other_json(tmp_path, capsys) -> None:
    a = write(tmp_path, "a.json", RUNS)
    md, page = tmp_path / "r.md", tmp_path / "r.html"
    assert dispatch(["report", a, "--markdown", str(md), "--html", str(page)]) == 0
    assert md.read_text().startswith("| bug |") and page.read_text().startswith("<!DOCTYPE html>")
    other = tmp_path / "other.json"
    other.write_text("[]")
    assert dispatch(["report", str(other)]) == 2
    assert "not a repro-results/1 document" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["report"], ["diff", "only-one.json"]])
def test_report_and_diff_usage(argv, capsys) -> None:
    assert dispatch(argv) == 2
