"""`repro fuzz`: programs it draws are valid, bad input is refused, and a counterexample is
found, shrunk, confirmed and replayed with the exit codes the command promises."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings

from harness.fixes import ALL_FIXES
from harness.isolate import Job
from harness.outcome import Outcome
from repro.commands import dispatch
from repro.fuzz import (
    EXAMPLE_TIMEOUT_S,
    SIMPLEST,
    TARGET,
    Search,
    _OutOfTime,
    minimize,
    programs,
)
from repro.program import invalid, with_defaults
from repro.registry import get

CONFIG = {
    "mode": "FULL",
    "sizes": [4],
    "backend": "paged",
    "draft": False,
    "tables_in_graph": False,
    "lora": True,
    "max_loras": 2,
    "specialize": False,
}
# lora_graph_capture's trigger as a program: an adapter, FULL capture, one LoRA decode step
LORA_STEP = {
    "config": CONFIG,
    "ops": [["add_lora", 1, True], ["capture"], ["step", [[1, 1, 0]], 0]],
}


def fuzz(capsys, *argv: str) -> tuple[int, str]:
    code = dispatch(["fuzz", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs())
def test_every_drawn_program_is_valid(program) -> None:
    assert invalid(program) is None, program
    assert json.loads(json.dumps(program)) == program, "a program is plain JSON"


@pytest.mark.parametrize(
    ("ops", "why"),
    [
        ([["step", [[1, 1, 0]], 0]], "inactive adapter"),
        ([["capture"], ["capture"]], "captured twice"),
        ([["sleep", 1], ["step", [[0, 1, 0]], 0]], "only wake"),
        ([["wake", None]], "do not sleep"),
        ([["sleep", 1], ["wake", ["weights"]], ["wake", ["weights"]]], "do not sleep"),
        ([["add_lora", 1, True]] * 2, "active"),
        ([["add_lora", i, True] for i in (1, 2, 3)], "no free slot"),
        ([["remove_lora", 1]], "not active"),
        ([["step", [[0, 40, 0]], 0]], "tokens at most"),
        ([["step", [[0, 4, 30]], 0]], "lengths"),
        ([["dummy", 2, 3]], "sizes"),
        ([["step", [[0, 1, 0, 9]], 0]], "allowed tokens"),
        ([["step", [[0, 1, 0, 0]], 0]], "allowed tokens"),
        ([["step", [[0, 1]], 0]], "requests are"),
        ([["serve", 3, 0]], "while a tag sleeps"),
        ([["add_lora", 1, True], ["step", [[1, 1, 0]], 0], ["hot_add", 9, True]], "every slot"),
        ([["add_lora", 1, True], ["add_lora", 2, True], ["hot_add", 9, True]], "after a step"),
        (
            [
                ["add_lora", 1, True],
                ["add_lora", 2, True],
                ["step", [[1, 1, 0]], 0],
                ["hot_add", 9, True],
                ["step", [[1, 1, 0]], 0],
            ],
            "is last",
        ),
        ([["sleep", 1], ["wake", None], ["serve", 3, 0]], "while a tag sleeps"),
        ([["sleep", 1], ["wake", ["weights"]], ["serve", 0, 0]], "1 to 32 tokens"),
        ([["generate", 20, 0]], "needs prefix caching"),
        ([["reload", -1]], "a checkpoint's seed"),
        ([["sleep", 1], ["reload", 1]], "only wake"),
        ([["step", [[0, 1, 0]], 0, [[1, 3, 0]]]], "guided rows"),
        ([["step", [[0, 1, 0]], 0, [[0, 3, 3]]]], "guided rows"),
        ([["step", [[0, 1, 0], [0, 1, 0]], 0, [[0, 3, 0], [0, 2, 0]]]], "guided rows"),
        ([["step", [[0, 1, 0]], 0, []]], "guided rows"),
        ([["jump"]], "an operation is"),
    ],
)
def test_invalid_programs_are_named(ops, why) -> None:
    assert why in (invalid({"config": CONFIG, "ops": ops}) or "valid")


def test_invalid_configs_are_named() -> None:
    assert "mode" in invalid({"config": {**CONFIG, "mode": "FULL_DECODE_ONLY"}, "ops": []})
    assert "keys" in invalid({"config": {"mode": "FULL"}, "ops": []})
    assert "capture" in invalid({"config": {**CONFIG, "mode": "NONE"}, "ops": [["capture"]]})
    # kernel blocks and a sliding window (issue 41): drawn since; a program without them is
    # the one it was (manager blocks, no window); the split-KV decode has no window
    assert invalid({"config": {**CONFIG, "kernel_blocks": "half", "window": 8}, "ops": []}) is None
    assert "kernel_blocks" in invalid({"config": {**CONFIG, "kernel_blocks": "x"}, "ops": []})
    flashmla = {**CONFIG, "backend": "flashmla", "window": 8}
    assert "paged backend" in invalid({"config": flashmla, "ops": []})
    assert "unknown" in invalid({"config": {**CONFIG, "no_such_key": 1}, "ops": []})


def test_the_draw_reaches_kernel_blocks_and_windows() -> None:
    import random

    from repro.fuzz import draw_program

    drawn = [draw_program(random.Random(n))["config"] for n in range(200)]
    assert {(c["kernel_blocks"], c["window"]) for c in drawn} == {
        (k, w) for k in ("manager", "half") for w in (0, 8)
    }
    assert all(not c["window"] or c["backend"] == "paged" for c in drawn)


def test_the_draw_reaches_the_hidden_state_readers() -> None:
    """Issue 41 item 3: the learned-gate MoE (with LoRA off only), the speculator's draft
    prefill (in the target's graphs or padded, in its own), the cache-only layer and prompt
    logprobs are drawn, after the operations: a seed's operations are the ones it drew before
    them."""
    import random

    from repro.fuzz import draw_program

    drawn = [draw_program(random.Random(n)) for n in range(300)]
    configs = [p["config"] for p in drawn]
    assert {c["moe"] for c in configs} == {"hash", "gate", "gate_skip"}
    assert all(c["moe"] == "hash" for c in configs if c["lora"])
    assert {c["speculator"] for c in configs} == {"none", "prefill", "padded"}
    assert {(c["extract"], c["prompt_logprobs"], c["reorder"]) for c in configs} == {
        (e, p, r) for e in (False, True) for p in (False, True) for r in (False, True)
    }
    for name in ("serve", "hot_add"):  # after a partial wake; past the slots, last
        assert any(op[0] == name for p in drawn for op in p["ops"]), name
    rows = [r for p in drawn for op in p["ops"] if op[0] == "step" for r in op[1]]
    assert {len(r) for r in rows} == {3, 4}, "some requests restricted by allowed_token_ids"
    later = ("moe", "speculator", "extract", "prompt_logprobs", "reorder")
    for program in drawn:
        assert invalid(program) is None
        # without these keys (their first values) the operations are valid too
        assert (
            invalid(
                {
                    "config": {k: v for k, v in program["config"].items() if k not in later},
                    "ops": program["ops"],
                }
            )
            is None
        )


def test_the_draw_reaches_prefix_caching_reloads_and_grammars() -> None:
    """Issue 41 item 3: prefix caching with a prompt served before a sleep and again after its
    wake, derived weights reloaded after the capture, steps with guided rows beside free ones;
    drawn last (a seed's earlier draws stay), and a program without these keys is valid."""
    import random

    from repro.fuzz import draw_program

    drawn = [draw_program(random.Random(n)) for n in range(300)]
    for program in drawn:
        config, ops = program["config"], program["ops"]
        if config["prefix_caching"]:
            assert not config["tables_in_graph"] and not config["window"]
            sleeps = [i for i, op in enumerate(ops) if op[0] == "sleep"]
            before = [[op for op in ops[:i] if op[0] != "reload"][-1] for i in sleeps]
            assert sleeps and all(op[0] == "generate" for op in before)
        else:
            assert all(op[0] != "generate" for op in ops)
        if not config["derived"]:
            assert all(op[0] != "reload" for op in ops)
        plain = {k: v for k, v in config.items() if k not in ("prefix_caching", "derived")}
        kept = [op[:3] if op[0] == "step" else op for op in ops]
        kept = [op for op in kept if op[0] not in ("generate", "reload")]
        assert invalid({"config": plain, "ops": kept}) is None
    configs = [p["config"] for p in drawn]
    assert {(c["prefix_caching"], c["derived"]) for c in configs} == {
        (p, d) for p in (False, True) for d in (False, True)
    }
    ops = [op for p in drawn for op in p["ops"]]
    assert any(op[0] == "reload" for op in ops) and any(op[0] == "generate" for op in ops)
    guided = [op for op in ops if op[0] == "step" and len(op) == 4]
    assert any(len(op[3]) < len(op[1]) for op in guided), "guided rows beside free ones"
    assert any(len(op[3]) == len(op[1]) > 1 for op in guided), "every row guided"
    assert any([g[0] for g in op[3]] != sorted(g[0] for g in op[3]) for op in guided)


def test_new_configs_and_operations_are_checked() -> None:
    tables = {**CONFIG, "prefix_caching": True, "tables_in_graph": True}
    assert "prefix caching" in invalid({"config": tables, "ops": []})
    window = {**CONFIG, "prefix_caching": True, "window": 8}
    assert "prefix caching" in invalid({"config": window, "ops": []})
    program = {
        "config": {**CONFIG, "prefix_caching": True, "derived": True},
        "ops": [
            ["capture"],
            ["generate", 20, 3],
            ["sleep", 2],
            ["wake", None],
            ["generate", 20, 3],
            ["reload", 4],
            ["step", [[0, 1, 3], [0, 2, 0, 4]], 0, [[1, 3, 2]]],
        ],
    }
    assert invalid(json.loads(json.dumps(program))) is None
    assert "needs prefix caching" in invalid(
        {"config": {**program["config"], "prefix_caching": False}, "ops": program["ops"]}
    )


def test_reader_configs_are_checked() -> None:
    gate = {**CONFIG, "moe": "gate"}
    assert "expert LoRA" in invalid({"config": gate, "ops": []})
    assert invalid({"config": {**gate, "lora": False}, "ops": []}) is None
    padded = {**CONFIG, "speculator": "padded", "backend": "flashmla", "draft": True}
    assert "one of them" in invalid({"config": padded, "ops": []})
    assert invalid({"config": {**padded, "draft": False}, "ops": []}) is None
    assert "speculator" in invalid({"config": {**CONFIG, "speculator": "eagle"}, "ops": []})
    ops = [["capture"], ["step", [[0, 1, 3], [0, 2, 0, 4]], 0]]
    program = {
        "config": {
            **CONFIG,
            "lora": False,
            "moe": "gate_skip",
            "speculator": "prefill",
            "extract": True,
            "prompt_logprobs": True,
            "reorder": True,
        },
        "ops": ops,
    }
    assert invalid(json.loads(json.dumps(program))) is None


def test_the_draw_reaches_steps_in_flight_the_engine_and_the_cpu_tier() -> None:
    """Issue 41 item 3: async scheduling (steps in flight 1 to 3: submit, collect; the async
    engine), a CPU KV tier and a smaller batch after a larger one with a speculator; drawn
    last (a seed's earlier draws stay), valid for the state, and a program without these keys
    and operations is valid too."""
    import random

    from repro.fuzz import draw_program

    drawn = [draw_program(random.Random(n)) for n in range(300)]
    assert {p["config"]["async"] for p in drawn} == {0, 1, 2, 3}
    assert {p["config"]["offload"] for p in drawn} == {False, True}
    assert {(p["config"]["hybrid"], p["config"]["backend"]) for p in drawn} == {
        (h, b) for h in (False, True) for b in ("paged", "flashmla")
    }
    ops = [op for p in drawn for op in p["ops"]]
    for name in ("submit", "collect", "engine", "offload", "fresh"):
        assert any(op[0] == name for op in ops), name
    engines = [op for op in ops if op[0] == "engine"]
    assert {op[3] for op in engines} == {0, 1, 2} and any(op[4] for op in engines)
    submits = [op for op in ops if op[0] == "submit"]
    assert any(len(r) == 4 for op in submits for r in op[1]), "restricted submitted requests"
    assert any(all(len(r) == 3 for r in op[1]) for op in submits), "unrestricted ones"
    most = 0
    for program in drawn:
        config, ops = program["config"], program["ops"]
        assert invalid(json.loads(json.dumps(program))) is None
        in_flight = 0
        for op in ops:
            in_flight += {"submit": 1, "collect": -1}.get(op[0], 0)
            assert 0 <= in_flight <= config["async"]
            most = max(most, in_flight)
        assert in_flight == 0, "every submitted step collected"
        if config["offload"]:
            assert not config["prefix_caching"] and config["speculator"] != "padded"
            assert not config["hybrid"]
        for i, op in enumerate(ops):  # a fresh request right after a wake of the last tag
            assert op[0] != "fresh" or (ops[i - 1][0] == "wake" and config["hybrid"])
        new = ("submit", "collect", "engine", "offload", "fresh")
        kept = [op for op in ops if op[0] not in new]
        later = ("async", "offload", "hybrid", "engine_blocks")
        plain = {k: v for k, v in config.items() if k not in later}
        assert invalid({"config": plain, "ops": kept}) is None
    assert most == 3, "three steps in flight"


def test_async_and_offload_operations_are_checked() -> None:
    asynchronous = {**CONFIG, "async": 2}
    submit = ["submit", [[0, 1, 3], [0, 2, 0, 4]], 5]
    ok = [submit, submit, ["collect"], ["collect"], ["engine", [[4, 3]], 1, 2, 0, [1]]]
    assert invalid({"config": asynchronous, "ops": ok}) is None
    assert "async > 0" in invalid({"config": CONFIG, "ops": [submit]})
    assert "at most 2" in invalid({"config": asynchronous, "ops": [submit] * 3})
    assert "no step in flight" in invalid({"config": asynchronous, "ops": [["collect"]]})
    busy = [submit, ["capture"]]
    assert "only submit or collect" in invalid({"config": asynchronous, "ops": busy})
    assert "lora 0" in invalid({"config": asynchronous, "ops": [["submit", [[1, 1, 0]], 0]]})
    reorder = {**asynchronous, "reorder": True}
    assert invalid({"config": reorder, "ops": [["engine", [[4, 3]], 1, 2, 0, []]]}) is None
    two = ["engine", [[4, 3], [2, 3]], 1, 2, 0, []]
    assert "reorder" in invalid({"config": reorder, "ops": [two]})
    tight = ["engine", [[6, 3]], 1, 2, 4, []]  # a budget of 4 under a prompt of 6
    assert "budget" in invalid({"config": asynchronous, "ops": [tight]})
    guided = ["step", [[0, 1, 3, 2]], 0, [[0, 2, 1]]]
    assert "guided" in invalid({"config": asynchronous, "ops": [guided]})
    tier = {**CONFIG, "offload": True}
    assert invalid({"config": tier, "ops": [["capture"], ["offload", 3, 7]]}) is None
    assert "config offload" in invalid({"config": CONFIG, "ops": [["offload", 3, 7]]})
    assert "prefix caching" in invalid({"config": {**tier, "prefix_caching": True}, "ops": []})
    padded = {**tier, "speculator": "padded"}
    assert "padded drafter" in invalid({"config": padded, "ops": []})
    hybrid = {**CONFIG, "hybrid": True, "backend": "flashmla"}
    ops = [["capture"], ["sleep", 1], ["wake", None], ["fresh", 9, 3], ["step", [[0, 1, 3]], 0]]
    assert invalid({"config": hybrid, "ops": ops}) is None
    assert "hybrid" in invalid({"config": {**hybrid, "offload": True}, "ops": []})
    assert "hybrid" in invalid({"config": {**hybrid, "draft": True}, "ops": []})
    caching = {**CONFIG, "prefix_caching": True}
    assert "no prefix caching" in invalid({"config": caching, "ops": [["fresh", 9, 3]]})


def test_the_draw_reaches_preemption_and_rollbacks_over_window_frees() -> None:
    """Issue 41 item 3, third round: the engine's runs drawn again, last (a seed's earlier
    draws stay): on a scarce pool (config engine_blocks: two or three long requests, which
    preempt and resume), and under a sliding window (long prompts, two drafts, most steps
    rejected); valid, plain JSON, and valid without the new key."""
    import random

    from repro.fuzz import draw_program
    from repro.program import (
        BLOCK_SIZES,
        ENGINE_BLOCKS,
        MAX_DRAFTS,
        MAX_OUTPUT,
        MAX_PROMPT,
    )

    # a request alone always fits the scarce pool: its optimistic count is at most its prompt,
    # its outputs and two steps' drafts
    assert ENGINE_BLOCKS * min(BLOCK_SIZES) >= MAX_PROMPT + MAX_OUTPUT + 2 * MAX_DRAFTS
    drawn = [draw_program(random.Random(n)) for n in range(300)]
    assert {p["config"]["engine_blocks"] for p in drawn} == {0, ENGINE_BLOCKS}
    scarce = rollbacks = 0
    for program in drawn:
        config, ops = program["config"], program["ops"]
        assert invalid(json.loads(json.dumps(program))) is None
        engines = [op for op in ops if op[0] == "engine"]
        if config["engine_blocks"]:
            assert engines and config["async"] and not config["hybrid"] and not config["window"]
            assert all(len(op[1]) >= 2 for op in engines), "requests that outgrow the pool"
            scarce += 1
            plain = {k: v for k, v in config.items() if k != "engine_blocks"}
            assert invalid({"config": plain, "ops": ops}) is None
        if config["window"] and engines:
            assert all(op[3] == MAX_DRAFTS and not op[4] for op in engines)
            assert all(n >= 6 for op in engines for n, _ in op[1]), "counts past the window"
            rollbacks += 1
    assert scarce >= 15 and rollbacks >= 15, (scarce, rollbacks)


def test_a_scarce_engine_pool_is_checked() -> None:
    scarce = {**CONFIG, "lora": False, "async": 1, "engine_blocks": 5}
    three = ["engine", [[8, 6], [7, 6], [5, 6]], 3, 2, 0, [1, 4]]
    assert invalid({"config": scarce, "ops": [three]}) is None
    assert "async > 0" in invalid({"config": {**scarce, "async": 0}, "ops": []})
    assert "hybrid" in invalid({"config": {**scarce, "hybrid": True}, "ops": []})
    assert "engine_blocks" in invalid({"config": {**scarce, "engine_blocks": 4}, "ops": []})
    # a preempted request prefills its prompt and outputs again: a budget must fit them
    tight = ["engine", [[8, 6], [7, 6]], 3, 2, 13, []]
    assert "prefill again" in invalid({"config": scarce, "ops": [tight]})
    assert invalid({"config": {**scarce, "engine_blocks": 0}, "ops": [tight]}) is None
    fits = ["engine", [[8, 6], [7, 6]], 3, 2, 14, []]
    assert invalid({"config": scarce, "ops": [fits]}) is None


# async_placeholder_leak's preemption path as a program: three requests outgrow a scarce pool
SCARCE = {
    "config": {**CONFIG, "mode": "NONE", "lora": False, "async": 1, "engine_blocks": 5},
    "ops": [["engine", [[5, 6], [7, 6], [7, 6]], 35, 1, 0, [0, 2, 9, 11]]],
}


@pytest.mark.async_placeholder_leak
def test_a_scarce_pool_preempts_and_resumes(device, isolator) -> None:
    """Drawn by seed 0 (repro fuzz async_placeholder_leak --variant buggy --seed 0), shrunk by
    hand: on a pool of five blocks a group the last running request is preempted with its step
    in flight and resumes later: the buggy runner's -1 placeholder reaches the embedding, the
    fixed one serves every request to its end, its logits as the reference; the held-back
    blocks come back (a step after the engine)."""
    program = {**SCARCE, "ops": [*SCARCE["ops"], ["step", [[0, 8, 0]] * 4, 3]]}
    assert invalid(program) is None
    bug = get("async_placeholder_leak")
    for fixes, want in ((bug.buggy_variant, "device_assert"), (ALL_FIXES, "pass")):
        job = Job(
            bug.id,
            "fuzz",
            TARGET,
            fixes,
            device,
            EXAMPLE_TIMEOUT_S,
            payload=json.dumps(program),
        )
        result = isolator.run(job)
        assert result.outcome.value == want, result.evidence


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variant", "buggy"], "needs a bug"),
        (["lora_graph_capture", "--without", "moe_align_oob_guard"], "not a part of"),
        (["lora_graph_capture", "--variant", "buggy", "--without", "lora_capture_launch"], "one"),
        (["no_such_bug"], "unknown bug id"),
        (["--budget", "0"], "--budget takes seconds"),
        (["--budget", "nan"], "--budget takes seconds"),
        (["--shrink", "-1"], "--shrink takes seconds"),
        (["--replay", "{not json"], "not JSON"),
        (["--replay", "[]"], "a program is"),
        (["--replay", json.dumps({"config": CONFIG, "ops": [["capture"], ["capture"]]})], "valid"),
        (["--replay", "@/no/such/file"], "--replay @/no/such/file"),
        (["--device", "tpu"], "device"),
        (["--seed", "x"], "--seed takes"),
        (["--seed", "5-3"], "--seed takes"),
    ],
)
def test_usage_errors(capsys, argv, message) -> None:
    code, out = fuzz(capsys, *argv)
    assert code == 2 and message in out, out


@pytest.mark.lora_graph_capture
def test_replay_of_a_counterexample(capsys, device, tmp_path) -> None:
    """Exit 1 with the evidence and a replay command on the buggy variant, 0 on the fixed; in
    bfloat16, which the replay command keeps (float32 is the search tests' dtype)."""
    program = json.dumps(LORA_STEP)
    report = tmp_path / "found.json"
    argv = ["lora_graph_capture", "--device", device, "--dtype", "bfloat16", "--replay", program]
    code, out = fuzz(capsys, *argv, "--variant", "buggy", "--json", str(report))
    assert code == 1, out
    assert "FOUND wrong_result" in out and "operation 2 (step [lora 1 x1 @0])" in out
    command = f"repro fuzz lora_graph_capture --variant buggy --device {device} --dtype bfloat16"
    assert f"replay: {command} --replay" in out
    doc = json.loads(report.read_text())
    assert doc["found"] and doc["confirmed"] and doc["program"] == LORA_STEP
    code, out = fuzz(capsys, *argv)
    assert code == 0 and "nothing found" in out, out


@pytest.mark.lora_graph_capture
def test_search_finds_and_confirms(capsys, device) -> None:
    """The search itself (seed 3: two programs; no shrinking): lora_graph_capture's buggy variant
    is found,
    confirmed, and printed with its operations and a replay command."""
    argv = ["lora_graph_capture", "--variant", "buggy", "--device", device]
    code, out = fuzz(capsys, *argv, "--budget", "120", "--seed", "3", "--shrink", "0")
    assert code == 1, out
    assert "FOUND wrong_result" in out and "--replay" in out
    ops = [line for line in out.splitlines() if line[:4].strip().rstrip(".").isdigit()]
    assert len(ops) >= 2 and "capture()" in out, out


class _Needs:
    """An isolator whose runs fail (wrong_result) when the program still holds a capture and,
    after it, a step with a LoRA request on a FULL runner: what lora_graph_capture needs."""

    def __init__(self) -> None:
        self.runs = 0

    def run(self, job: Job):
        self.runs += 1
        program = json.loads(job.payload)
        ops, captured, failing = program["ops"], False, None
        for i, op in enumerate(ops):
            captured = captured or op[0] == "capture"
            lora_step = op[0] == "step" and any(row[0] for row in op[1])
            if captured and lora_step and program["config"]["mode"] == "FULL":
                failing = i
                break
        if failing is None:
            return SimpleNamespace(outcome=Outcome.PASS, evidence="", seconds=0)
        evidence = f"operation {failing} ({ops[failing][0]}) broke an invariant:"
        return SimpleNamespace(outcome=Outcome.WRONG_RESULT, evidence=evidence, seconds=0)


def test_shrinking_keeps_only_what_the_finding_needs() -> None:
    """minimize() (no device): operations after the failing one, operations and sleep/wake
    groups it does not need and requests it does not need go (and a request's allowed tokens);
    the configuration gets plainer;
    the result still fails the same way and is a valid program."""
    program = {
        "config": {**CONFIG, "sizes": [4, 8], "tables_in_graph": True, "max_loras": 3},
        "ops": [
            ["add_lora", 1, True],
            ["add_lora", 2, False],
            ["dummy", 3, 2],
            ["capture"],
            ["step", [[0, 1, 3], [0, 1, 5]], 1],
            ["sleep", 1],
            ["wake", ["weights"]],
            ["wake", ["kv_cache"]],
            ["step", [[0, 1, 2], [2, 1, 7, 3], [0, 1, 9]], 2],
            ["remove_lora", 2],
            ["step", [[1, 2, 4]], 3],
        ],
    }
    assert invalid(program) is None
    runs = _Needs()
    search = Search(runs, get("lora_graph_capture").buggy_variant, "cpu", 60, shrink_s=60)
    search.outcome, search.found_after_s = Outcome.WRONG_RESULT, 0.0
    shrunk, evidence = minimize(search, program, runs.run(search.job(program)).evidence)
    assert shrunk["ops"] == [["add_lora", 2, False], ["capture"], ["step", [[2, 1, 7]], 2]]
    assert with_defaults(shrunk["config"]) == with_defaults({**program["config"], **SIMPLEST})
    assert invalid(shrunk) is None and evidence.startswith("operation 2 (step)")


COUNTEREXAMPLES = json.loads((Path(__file__).parent / "fuzz_counterexamples.json").read_text())


def _counterexamples():
    for bug_id, found in sorted(COUNTEREXAMPLES.items()):
        yield pytest.param(bug_id, found, marks=getattr(pytest.mark, bug_id), id=bug_id)


@pytest.mark.parametrize(("bug_id", "found"), list(_counterexamples()))
def test_counterexamples_found_while_building_stay_found(device, isolator, bug_id, found) -> None:
    """Each shrunk counterexample `repro fuzz` found (tests/fuzz_counterexamples.json) shows
    its class on the bug's buggy variant, a class the record documents, and passes fixed."""
    bug = get(bug_id)
    assert invalid(found["program"]) is None
    documented = {o for s in bug.scenarios for o in s.documented(device)}
    assert Outcome(found["outcome"]) in documented
    payload = json.dumps(found["program"])
    for fixes, want in ((bug.buggy_variant, found["outcome"]), (ALL_FIXES, "pass")):
        job = Job(bug_id, "fuzz", TARGET, fixes, device, EXAMPLE_TIMEOUT_S, payload=payload)
        result = isolator.run(job)
        assert result.outcome.value == want, result.evidence


# Found by `repro fuzz --device cuda --seed 2` on the FIXED runner (2026-11-28): a hybrid
# runner's dummy run names block 0 in its tables and reads whole pages of it; block 0 was a
# running request's state block (int32 -1: NaN as float32), so the dummy's outputs held NaN.
# Upstream's BlockPool reserves block 0 (the null block); the hybrid runner now does too.
HYBRID_DUMMY_AFTER_STEPS = {
    "config": {
        **CONFIG,
        "mode": "NONE",
        "kernel_blocks": "half",
        "moe": "hash",
        "reorder": True,
        "async": 1,
        "hybrid": True,
    },
    "ops": [
        ["submit", [[0, 1, 25], [0, 1, 20], [0, 1, 16], [0, 1, 16], [0, 1, 13]], 5],
        ["collect"],
        ["submit", [[0, 2, 18], [0, 1, 1], [0, 5, 5], [0, 3, 0]], 43],
        ["collect"],
        [
            "submit",
            [[0, 1, 18], [0, 1, 6], [0, 4, 15], [0, 5, 7], [0, 8, 10], [0, 8, 0], [0, 4, 26]],
            18,
        ],
        ["collect"],
        ["dummy", 11, 2],
    ],
}


def test_a_hybrid_runners_dummy_run_reads_the_null_block(device, isolator) -> None:
    """The fixed runner passes the program above: no request is ever given block 0."""
    payload = json.dumps(HYBRID_DUMMY_AFTER_STEPS)
    assert invalid(HYBRID_DUMMY_AFTER_STEPS) is None
    job = Job("fuzz", "fuzz", TARGET, ALL_FIXES, device, EXAMPLE_TIMEOUT_S, payload=payload)
    result = isolator.run(job)
    assert result.outcome == Outcome.PASS, result.evidence


class _Runs:
    """An isolator whose runs fail on every variant, or on the buggy one only."""

    def __init__(self, fixed_fails: bool) -> None:
        self.fixed_fails, self.variants = fixed_fails, []

    def run(self, job: Job):
        self.variants.append(job.fixes)
        failing = self.fixed_fails or job.fixes != ALL_FIXES
        outcome = Outcome.WRONG_RESULT if failing else Outcome.PASS
        return SimpleNamespace(outcome=outcome, evidence="operation 0 (capture()) broke", seconds=0)


@pytest.mark.parametrize("fixed_fails", [False, True])
def test_a_finding_must_be_the_switched_off_parts(fixed_fails) -> None:
    """With a bug's parts off, a failing program is run on the fixed runner too: a finding the
    fixed runner shares is the runner's or the oracle's (cannot test), never the bug's."""
    buggy = get("lazy_attn_state").buggy_variant
    runs = _Runs(fixed_fails)
    search = Search(runs, buggy, "cpu", budget_s=60)
    with pytest.raises(_OutOfTime):
        search.run(LORA_STEP)
    assert runs.variants == [buggy, ALL_FIXES]
    if fixed_fails:
        assert search.best is None and "the fixed runner fails this program too" in search.broken
    else:
        assert search.broken is None and search.best[0] == LORA_STEP
    assert Search(runs, ALL_FIXES, "cpu", 60).fixed_fails(LORA_STEP) is None  # nothing is off
