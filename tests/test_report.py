"""`repro report` (Markdown, HTML) and `repro diff` on small results documents."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest

from repro import report
from repro.commands import dispatch
from repro.results import SCHEMA_FILE, SCHEMA_KEYWORDS, document, problem


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


def _paths(value, path=()):
    """Every place in a JSON value, as a path of keys and indexes."""
    yield path
    if isinstance(value, (dict, list)):
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            yield from _paths(item, (*path, key))


def _damaged(doc: dict):
    """The document with one place removed or replaced by a value of another kind."""
    for path in list(_paths(doc))[1:]:
        for replacement in (None, "x", 1, 1.5, True, [], {}, "drop"):
            copy = json.loads(json.dumps(doc))
            parent = copy
            for key in path[:-1]:
                parent = parent[key]
            if replacement == "drop":
                if isinstance(parent, dict):
                    del parent[path[-1]]
                else:
                    parent.pop(path[-1])
            else:
                parent[path[-1]] = replacement
            yield path, copy


def test_the_schema_uses_only_keywords_the_validator_knows() -> None:
    def keywords(schema: dict):
        yield from schema
        for name in ("properties", "$defs"):
            for sub in schema.get(name, {}).values():
                yield from keywords(sub)
        for name in ("items", "additionalProperties"):
            if isinstance(schema.get(name), dict):
                yield from keywords(schema[name])
        for sub in schema.get("anyOf", ()):
            yield from keywords(sub)

    unknown = set(keywords(json.loads(SCHEMA_FILE.read_text()))) - SCHEMA_KEYWORDS
    assert not unknown, f"results.schema.json uses keywords repro.results does not check: {unknown}"


def test_the_validator_agrees_with_jsonschema_on_every_single_damage() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA_FILE.read_text())
    doc = document([*RUNS[:2], {**RUNS[2], "confirmation": "pass", "detector": "none"}])
    doc["verdict"], doc["complete"] = {"exit": 1, "text": "PRESENT"}, True
    assert problem(doc) is None
    checked = 0
    for path, damaged in _damaged(doc):
        valid = jsonschema.Draft202012Validator(schema).is_valid(damaged)
        found = problem(damaged)
        assert (found is None) == valid, f"{path}: jsonschema says {valid}, repro says {found}"
        checked += 1
    assert checked > 500
