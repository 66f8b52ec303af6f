"""The `repro` command: output, exit codes for git bisect, and clear errors for bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from harness import device as devices
from harness.fixes import UsageError
from repro import registry
from repro.commands import dispatch
from repro.registry import BUGS
from repro.results import SCHEMA_FILE, junit_class, problem
from tests import procs


def repro(capsys, *argv: str) -> tuple[int, str, str]:
    """The command in this process (the entry point's signal handling: tests/test_faults.py)."""
    code = dispatch(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_shows_every_bug(capsys) -> None:
    code, out, _ = repro(capsys, "list")
    assert code == 0
    for bug in BUGS:
        line = next(row for row in out.splitlines() if row.startswith(bug.id))
        assert bug.upstream.rsplit("/", 1)[-1] in line and bug.buggy_outcome.cuda.value in line


def test_list_tells_the_lora_chain(capsys) -> None:
    _, out, _ = repro(capsys, "list")
    history = out.split("history:")[1]
    assert "lora_graph_capture: A regression caused by the fix of lora_dummy_run" in history


def test_info_shows_the_record(capsys) -> None:
    code, out, _ = repro(capsys, "info", "moe_align_grid")
    assert code == 0
    for text in (
        "pull/40131",
        "moe_align_sort_adapter_check",
        "scenario oob_lora_id",
        "without moe_align_grid_plus_one: cpu pass",
        "#32277",
        "axis adapters: enabled, disabled, absent, evicted",
    ):
        assert text in out


def entry_point(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        procs.repro_command(*argv),
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["info", "no_such_bug"],
            {},
            "unknown bug id 'no_such_bug'; valid ids: block_table_wake, lazy_attn_state, moe",
        ),
        (["check", "no_such_bug"], {}, "unknown bug id"),
        (["matrix", "--bug", "no_such_bug"], {}, "unknown bug id"),
        (["run", "moe_align_grid", "--without", "nope"], {}, "unknown fix part 'nope'; valid"),
        (
            ["check", "moe_align_grid", "--without", "lora_dummy_mapping"],
            {},
            "--without lora_dummy_mapping: a fix part of lora_dummy_run, not of moe_align_grid",
        ),
        (
            ["check", "moe_align_grid", "--variant", "buggy", "--without", "moe_align_oob_guard"],
            {},
            "use one of",
        ),
        (["run", "moe_align_grid", "--scenario", "nope"], {}, "has no scenario 'nope'; scenarios:"),
        (["check", "moe_align_grid", "--device", "tpu"], {}, "--device must be one of"),
        (["matrix", "--device", "tpu"], {}, "--device must be one of"),
        (["check", "moe_align_grid", "--variant", "broken"], {}, "invalid choice"),
        (["frobnicate"], {}, "invalid choice"),
        (["check", "moe_align_grid", "--device", "cpu", "--sanitizer"], {}, "needs --device cuda"),
        ([], {}, "required"),
        (["matrix", "--jobs", "0"], {}, "--jobs must be at least 1, got 0"),
        (["matrix", "--jobs", "-3"], {}, "--jobs must be at least 1, got -3"),
        (["matrix", "--repeat", "0"], {}, "--repeat must be at least 1"),
        (["matrix", "--json", "/no/such/dir/m.json"], {}, "--json /no/such/dir/m.json: cannot"),
        (["matrix", "--junit", "/tmp"], {}, "--junit /tmp: is a directory"),
        (["check", "moe_align_grid"], {"REPRO_ISOLATION": "garbage"}, "$REPRO_ISOLATION must"),
        (["check", "moe_align_grid"], {"REPRO_DEVICE": "tpu"}, "$REPRO_DEVICE must be one of"),
        (["matrix"], {"REPRO_DEVICE": "tpu"}, "$REPRO_DEVICE must be one of"),
        (["list"], {"REPRO_CACHE_DIR": "/etc/hostname"}, "$REPRO_CACHE_DIR must name a directory"),
        (["list"], {"REPRO_SERVER": "maybe"}, "$REPRO_SERVER must be auto or off"),
        (["list"], {"REPRO_SERVER_DIR": "/etc/hostname"}, "$REPRO_SERVER_DIR must name a"),
        (["serve", "--idle", "0"], {}, "--idle must be a finite number of seconds above 0"),
        (["serve", "--idle", "nan"], {}, "--idle must be a finite number of seconds above 0"),
        (["serve", "--idle", "inf"], {}, "--idle must be a finite number of seconds above 0"),
        (["check", "moe_align_grid", "--timeout", "0"], {}, "--timeout must be a finite number"),
        (["matrix", "--timeout", "nan"], {}, "--timeout must be a finite number"),
        (["detectors", "--timeout", "-1"], {}, "--timeout must be a finite number"),
        (["list"], {"REPRO_TIMEOUT": "soon"}, "$REPRO_TIMEOUT must be a finite number"),
        (["bench", "--repeat", "0"], {}, "--repeat must be at least 1"),
        (["mutants", "--jobs", "0"], {}, "--jobs must be at least 1"),
        (["mutants", "--mutant", "nope"], {}, "no mutant 'nope'; mutants:"),
        (["mutants", "no_such_bug"], {}, "unknown bug id"),
        (["matrix", "--dtype", "float16"], {}, "--dtype: invalid choice: 'float16'"),
        (["check", "moe_align_grid", "--dtype", "fp8"], {}, "--dtype: invalid choice: 'fp8'"),
    ],
)
def test_usage_error_exits_2_with_one_line_and_no_torch(argv, env, message) -> None:
    done = entry_point(*argv, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert lines == [
        f"repro: error: {lines[0].removeprefix('repro: error: ')}",
        "torch imported: False",
    ]
    assert message in lines[0]
    assert done.stdout == ""


def test_list_and_info_never_import_torch() -> None:
    for argv in (["list"], ["info", "lazy_attn_state"], ["check", "--help"]):
        done = entry_point(*argv)
        assert done.returncode == 0, done.stderr
        assert "torch imported: False" in done.stderr


@pytest.mark.cpu_job  # a faked GPU: the same on a GPU machine
@pytest.mark.moe_align_grid
@pytest.mark.block_table_wake
@pytest.mark.parametrize("command", ["check", "run", "matrix"])
def test_the_client_of_a_cuda_run_never_imports_torch(command) -> None:
    """On a machine the client takes for a GPU machine (faked on a CPU machine: a CUDA torch, one
    GPU), a cuda run gets as far as its server and its children (which import torch; without a
    GPU they fail to build csrc: cannot test; on a GPU they pass); the client process itself
    never imports torch, Triton or numpy."""
    argv = [command, "moe_align_grid", "--device", "cuda", "--scenario", "last_slot_rows"]
    if command == "matrix":  # a bug of one scenario
        argv = [command, "--bug", "block_table_wake", "--device", "cuda"]
    done = subprocess.run(
        procs.repro_command(*argv, fake_gpu=True), capture_output=True, text=True, check=False
    )
    if devices.cuda_available():
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        assert done.returncode == 125, done.stdout + done.stderr
        assert "preparing cuda failed" in done.stdout + done.stderr, done.stdout + done.stderr
    assert "torch imported: False" in done.stderr, done.stderr


def test_check_help_states_the_exit_code_contract() -> None:
    out = entry_point("check", "--help").stdout
    for line in ("0    every selected scenario ran and passed", "125  cannot test", "flaky"):
        assert line in out
    assert "never 128 or more" in out


@pytest.mark.skipif(devices.cuda_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_cannot_test(capsys) -> None:
    code, out, _ = repro(capsys, "check", "moe_align_grid", "--device", "cuda")
    assert code == 125 and "cannot test: no CUDA device" in out
    code, out, _ = repro(capsys, "run", "moe_align_grid", "--device", "cuda")
    assert code == 125 and "skipped: no CUDA device" in out


@pytest.mark.parametrize(
    ("variant", "code", "verdict"), [("fixed", 0, "absent"), ("buggy", 1, "PRESENT")]
)
def test_check_exit_codes(capsys, device, variant, code, verdict) -> None:
    got, out, _ = repro(
        capsys,
        "check",
        "moe_align_grid",
        "--variant",
        variant,
        "--device",
        device,
        "--scenario",
        "last_slot_rows",
    )
    assert got == code, out
    assert f"moe_align_grid [{variant}, {device}]: {verdict}" in out


def test_run_json(capsys, device) -> None:
    code, out, _ = repro(
        capsys,
        "run",
        "moe_align_grid",
        "--json",
        "--device",
        device,
        "--without",
        "moe_align_oob_guard",
        "--scenario",
        "oob_lora_id",
    )
    assert code == 1
    doc = json.loads(out)
    validate(doc)
    [row] = doc["results"]
    assert row["outcome"] == row["expected"] == "wrong_result"
    assert row["fixes_off"] == ["moe_align_oob_guard"]
    assert "canary overwritten in rows [5]" in row["evidence"]


@pytest.mark.lora_graph_capture
def test_a_silent_bug_is_found_in_bfloat16(capsys, device) -> None:
    """The silent wrong result stays visible through bfloat16's tolerance (the fixed runner's
    bfloat16 steps: tests/test_runner.py; every bug: .ci/gpu's bfloat16 matrix)."""
    argv = ["lora_graph_capture", "--variant", "buggy", "--scenario", "full_graphs"]
    got, out, _ = repro(capsys, "run", *argv, "--device", device, "--dtype", "bfloat16", "--json")
    doc = json.loads(out)
    validate(doc)
    [row] = doc["results"]
    assert got == 1 and row["outcome"] == row["expected"] == "wrong_result", row["evidence"]
    assert row["dtype"] == "bfloat16"


def test_matrix_writes_json_and_junit(capsys, device, tmp_path) -> None:
    jpath, xpath = tmp_path / "m.json", tmp_path / "m.xml"
    code, out, _ = repro(
        capsys,
        "matrix",
        "--bug",
        "moe_align_grid",
        "--device",
        device,
        "--json",
        str(jpath),
        "--junit",
        str(xpath),
    )
    assert code == 0, out
    doc = json.loads(jpath.read_text())
    validate(doc)
    rows = doc["results"]
    assert {(r["variant"], r["device"]) for r in rows} == {("fixed", device), ("buggy", device)}
    assert all(r["outcome"] == r["expected"] for r in rows)
    assert doc["provenance"]["interpreter"] == (device == "cpu")
    assert doc["provenance"]["packages"]["torch"] and doc["provenance"]["project"]["root"]
    runs = 2 * len(registry.get("moe_align_grid").scenarios)
    assert f"{runs}/{runs} runs as expected" in out
    suite = ET.parse(xpath).getroot()
    assert suite.get("tests") == str(runs) and suite.get("failures") == "0"
    for case in suite.iter("testcase"):  # evidence for every cell, failing or not
        assert " " not in case.get("classname")
        assert case.find("system-out").text.startswith(("pass", "wrong_result", "illegal"))


@pytest.mark.parametrize("module", ["repro", "repro.cli"])
def test_module_entry_point(module) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "list"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and "moe_align_grid" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("variant", "code", "outcome"), [("buggy", 1, "sanitizer_error"), ("fixed", 0, "pass")]
)
def test_sanitizer_run(capsys, variant, code, outcome) -> None:
    got, out, _ = repro(
        capsys,
        "run",
        "moe_align_grid",
        "--device",
        "cuda",
        "--sanitizer",
        "--variant",
        variant,
        "--scenario",
        "consumer_poisoned",
        "--json",
    )
    [row] = json.loads(out)["results"]
    assert (got, row["outcome"]) == (code, outcome), row["evidence"]


def test_junit_class_names_have_no_spaces() -> None:
    name = junit_class("moe_align_grid", "without moe_align_oob_guard,a.b", "cpu")
    assert name == "moe_align_grid.without-moe_align_oob_guard,a_b.cpu"


@pytest.mark.moe_align_grid
def test_check_fail_fast_starts_nothing_after_a_failure(capsys, device) -> None:
    argv = ["check", "moe_align_grid", "--variant", "buggy", "--device", device, "--fail-fast"]
    argv += ["--scenario", "last_slot_rows", "--scenario", "upstream_sizes"]
    argv += ["--scenario", "oob_lora_id", "--scenario", "disabled_adapter"]
    code, out, _ = repro(capsys, *argv)
    assert code == 1 and "last_slot_rows=wrong_result" in out, out
    for name in ("upstream_sizes", "oob_lora_id", "disabled_adapter"):
        assert f"{name}=skipped" in out, out


def test_check_writes_its_verdict_with_the_confirmations(tmp_path, device) -> None:
    path = tmp_path / "check.json"
    argv = ("check", "moe_align_grid", "--variant", "buggy", "--scenario", "last_slot_rows")
    done = entry_point(*argv, "--device", device, "--json", str(path))
    assert done.returncode == 1, done.stdout
    doc = json.loads(path.read_text())
    validate(doc)
    assert doc["verdict"]["exit"] == 1 and "PRESENT" in doc["verdict"]["text"]
    [row] = doc["results"]
    assert row["outcome"] == row["confirmation"] == "wrong_result"


def validate(doc: dict) -> None:
    """Against the versioned schema, as `repro report` checks it (and with jsonschema too where
    that test dependency is installed: the GPU runner installs offline); the schema rejects what
    it should."""
    broken = {**doc, "results": [{**doc["results"][0], "outcome": "fine"}]}
    assert problem(doc) is None, problem(doc)
    assert "'fine' is not one of" in problem(broken)
    with contextlib.suppress(ImportError):
        import jsonschema

        schema = json.loads(SCHEMA_FILE.read_text())
        jsonschema.validate(doc, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_matrix_honours_repro_device(tmp_path, device) -> None:
    out = tmp_path / "m.json"
    env = {"REPRO_DEVICE": device}
    done = entry_point("matrix", "--bug", "lora_dummy_run", "--json", str(out), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {row["device"] for row in json.loads(out.read_text())["results"]} == {device}
    if not devices.cuda_available():
        done = entry_point("matrix", "--bug", "lora_dummy_run", env={"REPRO_DEVICE": "cuda"})
        assert done.returncode == 125
        assert "cuda: skipped: no CUDA device is available" in done.stderr


@pytest.mark.moe_align_grid
def test_check_runs_a_suspect_parts_scenarios_first() -> None:
    from repro.check import plan
    from repro.commands import build_parser

    def order(*extra: str) -> list[str]:
        args = build_parser().parse_args(["check", "moe_align_grid", "--device", "cpu", *extra])
        return [job.scenario for job in plan(args).jobs]

    record = order()
    suspect = order("--suspect", "moe_align_sort_adapter_check")
    assert suspect[:2] == ["disabled_adapter", "triton_twin"]  # the part's scenarios first
    assert sorted(suspect) == sorted(record) and suspect[2:] == [
        s for s in record if s not in suspect[:2]
    ]
    with pytest.raises(UsageError, match="a fix part of lora_dummy_run"):
        order("--suspect", "lora_dummy_mapping")


@pytest.mark.lora_graph_capture
def test_a_check_starts_the_expected_failure_with_its_twin_then_the_longest(monkeypatch) -> None:
    """The order only (repro.check._schedule): a variant the record expects to fail starts the
    expected failure usually soonest to end with its second run beside it, at the normal
    priority; the rest longest first; a fixed check longest first; --suspect the plan's."""
    from repro.check import _schedule, plan
    from repro.commands import build_parser

    monkeypatch.setattr("repro.check._busy", lambda: 0)
    monkeypatch.setattr("os.cpu_count", lambda: 2)

    def schedule(*extra: str):
        args = build_parser().parse_args(["check", "lora_graph_capture", "--device", "cpu", *extra])
        p = plan(args)
        return p, *_schedule(p, keep_order=bool(args.suspect))

    p, starts, twins = schedule()
    usual = [p.bug.usual_s(job.scenario, "cpu") for job in starts]
    assert sorted(starts, key=p.jobs.index) == list(p.jobs) and twins == []
    assert usual == sorted(usual, reverse=True)  # fixed: longest first, no twin on 2 CPUs
    p, starts, twins = schedule("--variant", "buggy")
    soonest = min(p.jobs, key=lambda job: p.bug.usual_s(job.scenario, "cpu"))
    assert starts[:2] == [soonest, soonest] and twins == [soonest] and twins[0].nice == 0
    rest = [p.bug.usual_s(job.scenario, "cpu") for job in starts[2:]]
    assert rest == sorted(rest, reverse=True) and len(starts) == len(p.jobs) + 1
    p, starts, twins = schedule("--variant", "buggy", "--suspect", "lora_capture_launch")
    assert starts == list(p.jobs) and twins == []


@pytest.mark.rank_rng_divergence
def test_a_gpu_check_starts_the_rest_only_after_a_lead_of_ranks(monkeypatch) -> None:
    """repro.check._workers: on a GPU, a buggy check whose lead (the expected failure started
    with its twin) is a run of ranks runs those two runs' ranks at once, so the other scenarios
    wait for them; a fixed check, and any check on the CPU, as many as the CPUs."""
    from repro.check import _schedule, _workers, plan
    from repro.commands import build_parser

    monkeypatch.setattr("repro.check._busy", lambda: 0)

    def plans(variant: str):
        argv = ["check", "rank_rng_divergence", "--device", "cpu", "--variant", variant]
        p = plan(build_parser().parse_args(argv))
        jobs = tuple(dataclasses.replace(job, device="cuda") for job in p.jobs)
        return p, dataclasses.replace(p, device="cuda", jobs=jobs)

    cpu, gpu = plans("buggy")
    starts, _ = _schedule(gpu)
    assert starts[0] == starts[1] and starts[0].ranks == 2  # the two-rank pair leads
    assert [job.ranks for job in starts[2:]] == [4]  # the four-rank scenario waits
    assert _workers(gpu, starts) == 4 and _workers(cpu, _schedule(cpu)[0]) is None
    _, gpu = plans("fixed")
    assert _workers(gpu, _schedule(gpu)[0]) is None


def test_a_check_confirms_one_failure_at_a_time_until_one_counts() -> None:
    """The confirming runs of `repro check`: the first failure is rerun at once; the next only
    if that confirmation does not count (here: flaky); once one counts, no more reruns."""
    from harness.isolate import Job, Result
    from harness.outcome import Outcome
    from repro.check import _Confirm

    a, b, c, d = (Job("bug", name, "m:f", frozenset(), "cpu", 60.0) for name in "abcd")
    wrong, ok = Outcome.WRONG_RESULT, Outcome.PASS
    confirm = _Confirm(lambda first, again: first.outcome == again.outcome)
    assert confirm(Result(d, ok, "", 1.0)) is None  # a pass is never rerun
    assert confirm(Result(a, wrong, "", 1.0)) == a  # the first failure: rerun at once
    assert confirm(Result(b, wrong, "", 1.0)) is None  # waits: a's confirmation in flight
    assert confirm(Result(a, ok, "", 1.0)) == b  # a was flaky: b's turn
    assert confirm(Result(b, wrong, "", 1.0)) is None and confirm.settled_by == "b"
    assert confirm(Result(c, wrong, "", 1.0)) is None  # settled: c stays unconfirmed


def test_a_twin_is_the_confirmation_and_a_pass_stops_it() -> None:
    """A scenario run twice from the start (a twin, on CPUs the check would leave idle): the
    run that ends second confirms a failure, no third run starts; a pass ends the twin."""
    from harness.isolate import Job, Result
    from harness.outcome import Outcome
    from repro.check import _Confirm

    a, b, c = (Job("bug", name, "m:f", frozenset(), "cpu", 60.0) for name in "abc")
    wrong, ok, skipped = Outcome.WRONG_RESULT, Outcome.PASS, Outcome.SKIPPED
    confirm = _Confirm(lambda first, again: first.outcome == again.outcome, (a, b, c))
    assert confirm(Result(b, ok, "", 1.0)) is None and list(confirm.drop()) == [b]
    assert confirm.drop() == {}  # asked once
    assert confirm(Result(b, skipped, "not finished", 1.0)) is None and b not in confirm.again
    assert confirm(Result(c, wrong, "", 1.0)) is None  # its twin, in flight, confirms it
    assert confirm(Result(c, ok, "", 1.0)) is None and not confirm.settled_by  # flaky
    assert confirm(Result(a, wrong, "", 1.0)) is None
    assert confirm(Result(a, wrong, "", 1.0)) is None and confirm.settled_by == "a"
    assert confirm.again[a].outcome == wrong and confirm.firsts[c].outcome == wrong
    d = Job("bug", "d", "m:f", frozenset(), "cpu", 60.0, nice=10)  # a twin's copy
    confirm = _Confirm(lambda first, again: first.outcome == again.outcome, (d,))
    assert confirm(Result(d, wrong, "", 1.0)) is None
    rerun = confirm(Result(d, Outcome.TIMEOUT, "", 60.0))  # starved: a plain rerun decides
    assert rerun == d and rerun.nice == 0 and d not in confirm.again
    assert confirm(Result(d, wrong, "", 1.0)) is None and confirm.settled_by == "d"


def test_twins_fill_idle_cpus_only(monkeypatch) -> None:
    import dataclasses

    from harness.isolate import Job
    from repro.check import _twins

    a, b = (Job("bug", name, "m:f", frozenset(), "cpu", 60.0) for name in "ab")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("repro.check._busy", lambda: 0)
    assert _twins((a,), "cpu") == [a] and _twins((a, b), "cpu") == []
    assert _twins((a,), "cpu")[0].nice > 0  # it yields to the first runs
    assert _twins((dataclasses.replace(a, ranks=2),), "cpu") == []  # ranks: never
    cuda = dataclasses.replace(a, device="cuda")
    assert _twins((cuda,), "cuda") == []  # a GPU queues every run's context work
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert _twins((a, b), "cpu") == [a, b]
    monkeypatch.setattr("repro.check._busy", lambda: 2)  # other work holds 2 CPUs
    assert _twins((a, b), "cpu") == []


@pytest.mark.moe_align_grid
@pytest.mark.parametrize(("variant", "code"), [("buggy", 1), ("fixed", 0)])
def test_a_one_scenario_check_gives_its_verdict(tmp_path, device, variant, code) -> None:
    """One scenario (a twin beside it where a CPU is idle): exit 1 with the failure confirmed
    by a second run of the same class, or 0."""
    path = tmp_path / "check.json"
    argv = ("check", "moe_align_grid", "--variant", variant, "--scenario", "last_slot_rows")
    done = entry_point(*argv, "--device", device, "--json", str(path))
    assert done.returncode == code, done.stdout
    (row,) = json.loads(path.read_text())["results"]
    assert row["confirmation"] == (row["outcome"] if code else None), row


def test_a_buggy_check_leaves_the_other_failures_unconfirmed(tmp_path, device) -> None:
    path = tmp_path / "check.json"
    argv = ("check", "moe_align_grid", "--variant", "buggy", "--scenario", "last_slot_rows")
    argv += ("--scenario", "disabled_adapter", "--device", device, "--json", str(path))
    done = entry_point(*argv)
    assert done.returncode == 1, done.stdout
    rows = json.loads(path.read_text())["results"]
    confirmed = [r for r in rows if r["confirmation"]]
    assert len(rows) == 2 and all(r["outcome"] != "pass" for r in rows), rows
    assert len(confirmed) == 1 and confirmed[0]["confirmation"] == confirmed[0]["outcome"]
    settled = confirmed[0]["scenario"]
    (other,) = [r for r in rows if not r["confirmation"]]
    # the other failure ended before the settlement (left unconfirmed) or was still running
    # then (stopped: skipped); which one depends on the machine's load, both name the settler
    if other["outcome"] == "skipped":
        assert f"the verdict was settled by {settled}" in done.stdout, done.stdout
    else:
        assert f"not confirmed: {settled}'s confirmed failure settled the verdict" in done.stdout
