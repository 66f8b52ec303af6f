"""Sharding for CI's runners (`--shard K/N` of matrix, mutants and fuzz) and the files read back
as one (`repro report`, `repro diff`), and the bench diff that warns of a slowdown."""

from __future__ import annotations

import json
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from repro import registry
from repro.common import take_shard
from tests import procs

BUGS = ("--bug", "moe_align_grid", "--bug", "lora_dummy_run")


def repro(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        procs.repro_command(*argv), capture_output=True, text=True, timeout=600, check=False
    )


def runs(path) -> list[tuple]:
    doc = json.loads(path.read_text())
    assert doc["complete"] is True
    keys = ("bug", "scenario", "variant", "device", "seed", "outcome")
    return [tuple(r[k] for k in keys) for r in doc["results"]]


@given(
    st.lists(st.floats(0.01, 100.0), max_size=40),
    st.integers(1, 5),
)
def test_the_parts_are_disjoint_and_make_the_whole(costs, n) -> None:
    items = list(enumerate(costs))
    parts = [take_shard(items, (k, n), lambda i: i[1], lambda i: i[0]) for k in range(1, n + 1)]
    assert sorted(i for part in parts for i in part) == items
    for part in parts:  # each in the caller's order
        assert part == sorted(part)
    if items:  # balanced: no part over the mean by more than the largest item
        loads = [sum(c for _, c in part) for part in parts]
        assert max(loads) <= sum(costs) / n + max(costs) + 1e-9


@pytest.mark.cpu_job
@pytest.mark.moe_align_grid
@pytest.mark.lora_dummy_run
def test_matrix_shards_are_disjoint_and_their_union_is_the_whole(tmp_path) -> None:
    whole, parts = tmp_path / "whole.json", [tmp_path / f"s{k}.json" for k in (1, 2)]
    done = repro("matrix", *BUGS, "--device", "cpu", "--json", str(whole))
    assert done.returncode == 0, done.stdout + done.stderr
    # the longest start first, but results read in the plan's order: bug, scenario, variant
    plan = [(b.id, s.name) for b in map(registry.get, BUGS[1::2]) for s in b.scenarios]
    assert list(dict.fromkeys(r[:2] for r in runs(whole))) == plan
    for k, part in enumerate(parts, 1):
        done = repro("matrix", *BUGS, "--device", "cpu", "--shard", f"{k}/2", "--json", str(part))
        assert done.returncode == 0, done.stdout + done.stderr
    first, second = runs(parts[0]), runs(parts[1])
    assert first and second and not set(first) & set(second)
    for k, part in enumerate(parts, 1):  # each says how long it took (repro bench reads it)
        timing = json.loads(part.read_text())["matrix"]
        assert timing["shard"] == f"{k}/2" and timing["repeat"] == 1 and timing["as_expected"]
        assert timing["seconds"] > 0 and not timing["each_part"]
    assert sorted(first + second) == sorted(runs(whole))
    # read as one: one table, and no run changed against the whole
    junit = tmp_path / "merged.xml"
    report = repro("report", *map(str, parts), "--junit", str(junit))
    assert report.returncode == 0, report.stderr
    suite = ET.parse(junit).getroot()
    assert int(suite.get("tests")) == len(runs(whole)) and suite.get("failures") == "0"
    assert report.stdout.count("| bug | scenario |") == 1
    rows = [line for line in report.stdout.splitlines() if line.startswith("| moe_align_grid")]
    assert len(rows) == len({r[1] for r in runs(whole) if r[0] == "moe_align_grid"})
    diff = repro("diff", f"{parts[0]},{parts[1]}", str(whole))
    assert diff.returncode == 0 and "0 run(s) changed" in diff.stdout, diff.stdout + diff.stderr


def test_mutant_shards_are_disjoint_and_their_union_is_the_whole() -> None:
    def listed(*extra: str) -> list[tuple[str, ...]]:  # (bug, mutant) of each row
        lines = repro("mutants", "--list", *extra).stdout.splitlines()[1:]
        return [tuple(line.split()[:2]) for line in lines]

    whole = listed()
    first, second = listed("--shard", "1/2"), listed("--shard", "2/2")
    assert first and second and not set(first) & set(second)
    assert sorted(first + second) == sorted(whole)


@pytest.mark.parametrize(
    "argv",
    [
        ["matrix", "--shard", "0/2"],
        ["matrix", "--shard", "3/2"],
        ["mutants", "--shard", "two"],
        ["fuzz", "--seed", "0", "--shard", "2/2"],
    ],
)
def test_a_bad_shard_is_a_usage_error(argv) -> None:
    done = repro(*argv)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--shard" in done.stderr


def bench_file(path, **figures: float) -> str:
    doc = {"schema": "repro-bench/1", "device": "cuda", "cpus": 16, "figures": figures}
    path.write_text(json.dumps(doc))
    return str(path)


def test_bench_diff_names_a_planted_slowdown(tmp_path) -> None:
    before = bench_file(tmp_path / "a.json", floor_import=3.8, check_warm=0.85, list=0.25)
    after = bench_file(tmp_path / "b.json", floor_import=3.9, check_warm=1.7, list=0.26)
    done = repro("diff", before, after)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "check_warm: 0.850s -> 1.700s (2.00x)" in done.stdout
    assert "floor_import" not in done.stdout.splitlines()[0] and "1 of 3 figure(s)" in done.stdout
    same = repro("diff", before, before)
    assert same.returncode == 0 and "0 of 3 figure(s)" in same.stdout


def test_bench_diff_reads_per_bug_files_and_shards_as_one(tmp_path) -> None:
    doc = {"schema": "repro-bench/1", "bugs": {"moe_align_grid": {"check_warm": 1.0}}}
    (tmp_path / "p1.json").write_text(json.dumps(doc))
    doc["bugs"] = {"lora_dummy_run": {"check_warm": 1.0}}
    (tmp_path / "p2.json").write_text(json.dumps(doc))
    doc["bugs"] = {"moe_align_grid": {"check_warm": 1.1}, "lora_dummy_run": {"check_warm": 3.0}}
    (tmp_path / "after.json").write_text(json.dumps(doc))
    parts = ",".join(str(tmp_path / p) for p in ("p1.json", "p2.json"))
    done = repro("diff", parts, str(tmp_path / "after.json"))
    assert done.returncode == 1
    assert "lora_dummy_run.check_warm: 1.000s -> 3.000s (3.00x)" in done.stdout
    assert "moe_align_grid" not in done.stdout


def test_the_gpu_job_keeps_a_bench_and_diffs_it_as_a_warning() -> None:
    ci = (procs.ROOT / ".ci" / "gpu").read_text()
    assert "repro bench" in ci and "bench.json" in ci
    workflow = (procs.ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert "repro diff" in workflow and "bench.json" in workflow
    assert "shard: [1, 2]" in workflow and "SHARD:" in workflow
    assert os.access(procs.ROOT / ".ci" / "gpu", os.R_OK)


def test_the_gpu_job_runs_its_matrices_on_a_warm_server_and_its_bench_on_its_own() -> None:
    """Every part of .ci/gpu starts `repro serve` after the suite, before its matrix (whose
    figure the bench reads: the issue's matrix figure is a warm server's), and stops it before
    the bench, which starts a server of its own."""
    lines = (procs.ROOT / ".ci" / "gpu").read_text().splitlines()

    def at(text: str) -> int:
        found = [i for i, line in enumerate(lines) if line.strip().startswith(text)]
        assert len(found) == 1, (text, found)
        return found[0]

    serve = at("step serve 0 repro serve --device cuda")
    stop = at("repro serve --device cuda --stop")
    assert at("step pytest-gpu") < serve < at("step matrix 0") < at("step matrix-bf16 0")
    assert at("step fuzz 0") < stop and at("step ranks 0") < stop < at("step bench 0")
    assert not lines[serve].startswith(" "), "the serve step runs in every part"


@pytest.mark.parametrize(("device", "worker"), [("cuda", "gw3"), ("cpu", "gw3"), ("cuda", None)])
def test_a_gpu_workers_slowest_tests_go_first_longest_first(
    tmp_path, monkeypatch, device, worker
) -> None:
    """On a GPU under xdist, the tests of SLOW_S or more in the durations file start first,
    longest first, the rest in collection order; on the CPU (the file holds the GPU's
    durations) and outside xdist, the collection order stays."""
    import conftest

    seconds = {"t::a": 0.5, "t::b": 9.0, "t::c": conftest.SLOW_S, "t::d": 1.9, "t::f": 30.0}
    (tmp_path / "durations.json").write_text(json.dumps(seconds))
    names = ["t::a", "t::b", "t::c", "t::d", "t::e", "t::f"]
    items = [SimpleNamespace(nodeid=name) for name in names]
    config = SimpleNamespace(
        stash={conftest.DEVICE_KEY: device},
        option=SimpleNamespace(durations_path=str(tmp_path / "durations.json")),
        rootpath=tmp_path,
    )
    if worker:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    conftest._slowest_first(config, items)
    order = [item.nodeid for item in items]
    if device == "cuda" and worker:
        assert order == ["t::f", "t::b", "t::c", "t::a", "t::d", "t::e"]
    else:
        assert order == names


@pytest.mark.parametrize(("fixed", "buggy", "code"), [(0, 1, 0), (1, 1, 125), (0, 0, 125)])
def test_bench_names_a_check_that_did_not_end_as_its_verdict(
    monkeypatch, capsys, fixed, buggy, code
) -> None:
    """A fixed check that fails, or a buggy one that passes, ends fast: timed as if it were a
    verdict, it would look like a speed-up. The bench names it and exits 125."""
    from repro import bench

    def run(argv, **kwargs):
        wanted = {"check": buggy if "buggy" in argv else fixed}
        return subprocess.CompletedProcess(argv, wanted.get(argv[3], 0) if len(argv) > 3 else 0)

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setattr(bench, "_WRONG_EXITS", [])
    assert bench._per_bug("cpu", ["lora_dummy_run"], 1, None, True) == code
    err = capsys.readouterr().err
    assert ("exit 1, not 0" in err) == (fixed == 1) and ("exit 0, not 1" in err) == (buggy == 0)


def test_bench_diff_compares_a_parts_matrix_with_the_same_part_only(tmp_path) -> None:
    """A runner's bench times its own part's matrix (`repro bench --shard K/N`): against
    another part's, or the whole's, the matrix figure would be no comparison at all."""

    def part(name, shard, matrix):
        doc = {"schema": "repro-bench/1", "figures": {"matrix_each_part": matrix, "list": 0.2}}
        (tmp_path / name).write_text(json.dumps({**doc, **({"shard": shard} if shard else {})}))
        return str(tmp_path / name)

    before = part("before.json", "2/2", 30.0)
    slower = repro("diff", before, part("slower.json", "2/2", 70.0))
    assert slower.returncode == 1, slower.stdout + slower.stderr
    assert "matrix_each_part[2/2]: 30.000s -> 70.000s (2.33x)" in slower.stdout
    for other in (part("whole.json", None, 70.0), part("first.json", "1/2", 70.0)):
        done = repro("diff", before, other)
        assert done.returncode == 0 and "0 of 1 figure(s)" in done.stdout, done.stdout


@pytest.fixture
def faked_bench(monkeypatch) -> list[list[str]]:
    """`repro bench` with its timed commands and children faked: the argv of each command it
    would have run (every one exits as wanted)."""
    from repro import bench

    timed, real = [], subprocess.run

    def run(argv, **kwargs):
        if argv[0] == "git":  # a results document's provenance, not a timed command
            return real(argv, **kwargs)
        timed.append(list(argv))
        return subprocess.CompletedProcess(argv, 2 if "no_such_bug" in argv else 0)

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setattr(bench, "_per_child", lambda *args: 0.1)
    monkeypatch.setattr(bench, "_WRONG_EXITS", [])
    for name in (bench.ENV_SERVER, bench.ENV_SERVER_DIR):  # the bench sets them: restored after
        monkeypatch.delenv(name, raising=False)
    return timed


@pytest.mark.cpu_job
def test_a_bench_of_one_part_times_that_parts_matrix_and_says_so(faked_bench, tmp_path) -> None:
    from repro import bench, commands

    timed = faked_bench
    out = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--repeat", "1", "--shard", "2/2", "--json", str(out)]
    assert bench.cmd_bench(commands.build_parser().parse_args(argv)) == 0
    matrix = [a for a in timed if "matrix" in a]
    assert len(matrix) == 1 and matrix[0][-2:] == ["--shard", "2/2"]
    assert json.loads(out.read_text())["shard"] == "2/2"


@pytest.mark.cpu_job
def test_the_first_warm_check_after_serve_is_a_figure_of_its_own(faked_bench, tmp_path) -> None:
    """The first check after `repro serve` (on a GPU, the server's first spares still making
    their contexts: the server's start) is timed on its own, and the warm check's median is
    of the N after it (a median of two had been half the server's start)."""
    from repro import bench, commands

    out = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--repeat", "2", "--json", str(out)]
    assert bench.cmd_bench(commands.build_parser().parse_args(argv)) == 0
    serve = next(i for i, argv in enumerate(faked_bench) if "serve" in argv)
    assert [argv for argv in faked_bench[serve:] if "check" in argv] == [faked_bench[serve + 1]] * 3
    figures = json.loads(out.read_text())["figures"]
    assert {"check_first_warm", "check_warm"} <= figures.keys()


@pytest.mark.cpu_job
def test_a_per_bug_benchs_first_check_after_serve_is_no_bugs(
    faked_bench, tmp_path, monkeypatch
) -> None:
    """`repro bench --checks`: one check runs after `repro serve` before any is timed (on a
    GPU the first check after the server's start took 2.1 s against 0.9 s for the next: it
    was half the first bug's median of two), then each bug's, `--repeat` times a variant."""
    from repro import bench, commands

    faked = bench.subprocess.run
    buggy_exits_1 = lambda argv, **kw: subprocess.CompletedProcess(
        faked(argv, **kw).args, 1 if "buggy" in argv else 0
    )
    monkeypatch.setattr(bench.subprocess, "run", buggy_exits_1)

    out = tmp_path / "checks.json"
    argv = ["bench", "--device", "cpu", "--checks", "--repeat", "2", "--json", str(out)]
    argv += ["--bug", "lora_dummy_run", "--bug", "moe_align_grid"]
    assert bench.cmd_bench(commands.build_parser().parse_args(argv)) == 0
    serve = next(i for i, argv in enumerate(faked_bench) if "serve" in argv)
    checks = [argv[argv.index("check") + 1 :] for argv in faked_bench[serve:] if "check" in argv]
    fixed, buggy = ["--device", "cpu"], ["--device", "cpu", "--variant", "buggy"]
    want = [["lora_dummy_run", *fixed]] * 3 + [["lora_dummy_run", *buggy]] * 2
    assert checks == want + [["moe_align_grid", *fixed]] * 2 + [["moe_align_grid", *buggy]] * 2
    assert list(json.loads(out.read_text())["bugs"]) == ["lora_dummy_run", "moe_align_grid"]


@pytest.mark.cpu_job
def test_a_per_bug_bench_cut_short_keeps_the_rows_it_has(faked_bench, tmp_path, monkeypatch):
    """`repro bench --checks --json` writes each bug's row as it comes (complete: false until
    the table): a bench interrupted at its second bug keeps the first's row."""
    from repro import bench, commands

    faked, cut = bench.subprocess.run, []

    def run(argv, **kwargs):
        if cut and "check" in argv and "lora_dummy_run" in argv:
            raise KeyboardInterrupt
        done = faked(argv, **kwargs)
        return subprocess.CompletedProcess(argv, 1) if "buggy" in argv else done

    monkeypatch.setattr(bench.subprocess, "run", run)
    out = tmp_path / "checks.json"
    argv = ["bench", "--device", "cpu", "--checks", "--repeat", "1", "--json", str(out)]
    argv += ["--bug", "moe_align_grid", "--bug", "lora_dummy_run"]
    args = commands.build_parser().parse_args(argv)
    assert bench.cmd_bench(args) == 0
    assert json.loads(out.read_text())["complete"] is True
    out.unlink()
    cut.append(True)
    with pytest.raises(KeyboardInterrupt):
        bench.cmd_bench(args)
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and list(doc["bugs"]) == ["moe_align_grid"], doc


def _matrix_doc(path, rows=10, **timing) -> str:
    """A finished matrix's JSON as `repro matrix --each-part --repeat 2 --shard 2/2` writes it,
    with `timing`'s changes (dtype: the runs'). Written unchecked; whether it is a valid results
    document is asserted by its callers where it matters."""
    from repro import results

    row = {"bug": "b", "scenario": "s", "variant": "fixed", "fixes_off": [], "device": "cpu"}
    row |= {"dtype": timing.pop("dtype", "float32"), "gpu": None, "outcome": "pass"}
    row |= {"expected": "pass", "seed": 0, "seconds": 1.0, "scenario_seconds": 0.5}
    doc = results.document([{**row, "evidence": "as the reference"}] * rows, {"cpu"})
    doc["complete"] = True
    doc["matrix"] = {"seconds": 50.0, "repeat": 2, "each_part": True, "shard": "2/2"}
    doc["matrix"] |= {"bugs": [], "jobs": None, "interrupted": False, "as_expected": True}
    doc["matrix"] |= timing
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.cpu_job
@pytest.mark.parametrize(
    ("timing", "code", "said"),
    [
        ({}, 0, ""),
        ({"as_expected": False}, 125, "not every run as expected"),
        ({"shard": "1/2"}, 2, "its part is 1/2, not 2/2"),
        ({"each_part": False}, 2, "not --each-part"),
        ({"dtype": "bfloat16"}, 2, "not the default float32"),
        ({"interrupted": True}, 2, "interrupted"),
        ({"bugs": ["moe_align_grid"]}, 2, "not every bug"),
        ({"jobs": 4}, 2, "not the default"),
        ({"repeat": 0}, 2, "repeat 0"),
        ({"seconds": float("nan")}, 2, "seconds nan"),
        ({"repeat": "2"}, 2, "not a valid repro-results/1 document"),
        ({"shard": None}, 2, "its part is None, not 2/2"),
    ],
)
def test_a_bench_takes_the_matrix_steps_time_over_its_repeats(
    faked_bench, capsys, tmp_path, timing, code, said
) -> None:
    """.ci/gpu's bench does not run its part's matrix again: it reads the matrix step's time
    and runs (halved for its two repeats); a matrix of another part, without --each-part, or
    that did not end as expected, is not that figure."""
    from repro import bench, commands

    out, matrix = tmp_path / "bench.json", _matrix_doc(tmp_path / "m.json", **timing)
    timed = faked_bench
    argv = ["bench", "--device", "cpu", "--repeat", "1", "--shard", "2/2"]
    argv += ["--matrix-json", matrix, "--json", str(out)]
    try:
        got = bench.cmd_bench(commands.build_parser().parse_args(argv))
    except bench.UsageError as e:
        got, err = 2, str(e)
    else:
        err = capsys.readouterr().err
    assert got == code and said in err, err
    assert not [a for a in timed if "matrix" in a]  # never run again
    if code != 2:  # one pass: the seconds and the runs over the repeats; said in the file
        assert bench._matrix_timing(matrix, "cpu", "2/2") == (25.0, 5.0)
        written = json.loads(out.read_text())
        assert written["figures"]["matrix_each_part"] == 25.0 and written["matrix_from"] == "step"


def test_a_bench_refuses_a_matrix_json_that_is_not_a_finished_matrix(tmp_path) -> None:
    from repro import results

    good = json.loads(Path(_matrix_doc(tmp_path / "m.json")).read_text())
    assert results.problem(good) is None, results.problem(good)
    old = {k: v for k, v in good.items() if k != "matrix"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    cuda = {**good, "results": [{**row, "device": "cuda"} for row in good["results"]]}
    (tmp_path / "cuda.json").write_text(json.dumps(cuda))
    (tmp_path / "deep.json").write_text("[" * 100_000)
    for path, said in (
        (tmp_path / "old.json", "no timing"),
        (tmp_path / "none", "not a results document"),
        (tmp_path / "deep.json", "nested too deeply"),
        (tmp_path / "cuda.json", "ran on ['cuda'], not cpu"),
    ):
        done = repro("bench", "--device", "cpu", "--shard", "2/2", "--matrix-json", str(path))
        assert done.returncode == 2 and said in done.stderr, done.stdout + done.stderr
        assert "Traceback" not in done.stderr


def test_a_bench_figure_from_a_matrix_step_is_compared_with_such_figures_only(tmp_path) -> None:
    """The matrix step's time (--matrix-json) is not the bench's own matrix run's: `repro
    diff` does not compare the two, and compares two of the step's."""

    def bench(name, seconds, **extra):
        doc = {"schema": "repro-bench/1", "device": "cuda", "cpus": 16, "shard": "2/2"}
        doc |= {"figures": {"matrix_each_part": seconds}, **extra}
        (tmp_path / name).write_text(json.dumps(doc))
        return str(tmp_path / name)

    own, step = bench("own.json", 30.0), bench("step.json", 30.0, matrix_from="step")
    done = repro("diff", own, bench("step-slow.json", 70.0, matrix_from="step"))
    assert done.returncode == 0 and "0 of 0 figure(s)" in done.stdout, done.stdout
    done = repro("diff", step, bench("step-slower.json", 70.0, matrix_from="step"))
    assert done.returncode == 1 and "matrix_each_part[2/2,step]" in done.stdout, done.stdout
    heads = repro("bench", "--table", own, step).stdout.splitlines()[0].split(" | ")
    assert ["matrix from its step" in head for head in heads[1:]] == [False, True], heads


@pytest.mark.parametrize("how", [["--checks"], ["--usual"], ["--per-bug"]])
def test_a_bench_shard_goes_with_the_default_figures_only(how) -> None:
    done = repro("bench", "--device", "cpu", *how, "--shard", "1/2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--shard" in done.stderr
