"""Per-bug regression tests: every scenario, on the run's device, shows exactly its expected
outcome for the fixed variant (pass), the buggy variant, each single-part removal, and the
variants its own expectation rules name (one rule's parts off; all of them off: the chains).

Each case carries its bug's marker: `pytest -m moe_align_grid` selects exactly that bug.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.fixes import ALL_FIXES, describe
from harness.isolate import Job
from harness.outcome import Outcome
from repro.matrix import variants
from repro.registry import BUGS


def _variants(bug, scenario) -> list:
    variants = [ALL_FIXES, bug.buggy_variant]
    if len(bug.fix_parts) > 1:
        variants += [ALL_FIXES - {part} for part in bug.fix_parts]
    variants += [ALL_FIXES - rule.missing for rule in scenario.expects]
    variants.append(ALL_FIXES.difference(*(rule.missing for rule in scenario.expects)))
    return list(dict.fromkeys(variants))


def _cases():
    for bug in BUGS:
        mark = getattr(pytest.mark, bug.id)
        for scenario in bug.scenarios:
            marks = [mark, pytest.mark.distributed] if scenario.ranks > 1 else [mark]
            for fixes in _variants(bug, scenario):
                name = describe(fixes, bug.fix_parts).replace(" ", "-")
                yield pytest.param(
                    bug, scenario, fixes, marks=marks, id=f"{bug.id}-{scenario.name}-{name}"
                )


def _bugs():
    return [pytest.param(bug, marks=getattr(pytest.mark, bug.id), id=bug.id) for bug in BUGS]


@pytest.mark.parametrize(("bug", "scenario", "fixes"), list(_cases()))
def test_scenario_shows_expected_outcome(device, isolator, bug, scenario, fixes) -> None:
    expected = scenario.expected(fixes, device)
    result = isolator.run(
        Job(
            bug.id,
            scenario.name,
            bug.target(scenario),
            fixes,
            device,
            scenario.timeout_s,
            ranks=scenario.ranks,
        )
    )
    assert result.outcome == expected, (
        f"{bug.id}/{scenario.name} [{describe(fixes, bug.fix_parts)}, {device}]: "
        f"{result.outcome.value}, expected {expected.value}\n{result.evidence}"
    )
    if fixes == bug.buggy_variant and expected != Outcome.PASS:  # the failure's signature
        assert scenario.signed(result.evidence, device), (
            f"{bug.id}/{scenario.name} [buggy, {device}]: {expected.value} without its "
            f"signature ({scenario.signature or '-'}; cpu {scenario.cpu_signature or '-'})\n"
            f"{result.evidence}"
        )


def test_leave_to_matrix_deselects_the_matrix_cells_only(device) -> None:
    """.ci/gpu's --leave-to-matrix: the verdict tests it deselects are the cells of `repro
    matrix --each-part`, one each; those it keeps (a relative's parts removed) are not."""
    args = ["--co", "-q", "-p", "no:cacheprovider", "--device", device, __file__]
    args += ["-k", "test_scenario_shows_expected_outcome"]
    run = lambda *more: subprocess.run(
        [sys.executable, "-m", "pytest", *args, *more], capture_output=True, text=True, check=True
    )
    ids = lambda out: {line for line in out.stdout.splitlines() if "::" in line}
    every, kept = ids(run()), ids(run("--leave-to-matrix"))
    cells = {
        f"{b.id}-{s.name}-{describe(f, b.fix_parts).replace(' ', '-')}"
        for b in BUGS
        for s in b.scenarios
        for f in variants(b, each_part=True)
    }
    left = {i.split("[", 1)[1][:-1] for i in every - kept}
    assert kept < every and left == cells
    assert not {i.split("[", 1)[1][:-1] for i in kept} & cells


@pytest.mark.parametrize("bug", _bugs())
@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_every_fix_part_is_necessary(bug, dev) -> None:
    for part in bug.fix_parts:
        seen = {s.expected(ALL_FIXES - {part}, dev) for s in bug.scenarios}
        assert seen - {Outcome.PASS}, f"removing only {part.value} fails no scenario on {dev}"


@pytest.mark.parametrize("bug", _bugs())
@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_record_matches_its_scenarios(bug, dev) -> None:
    assert all(s.expected(ALL_FIXES, dev) == Outcome.PASS for s in bug.scenarios)
    buggy = {s.expected(bug.buggy_variant, dev) for s in bug.scenarios}
    assert bug.buggy_outcome.on(dev) in buggy, f"no scenario shows the headline outcome on {dev}"
    assert all(o.is_failure or o == Outcome.PASS for o in buggy)


# The configuration axes that can matter to each bug (issue 20): the union over its scenarios'
# declared axes must cover them. Graph bugs replay at least two sizes, each at least twice with
# other lengths; wake bugs sleep at both levels and wake at once and staged; MoE-LoRA bugs
# send adapters in every state through the align and its consumers. `states`: the kinds of runner
# state (record.STATES) a bug's fix must be seen through (an empty set: none of them matters).
GRAPHS = {"capture_sizes": 2, "steps_per_size": 2}
WAKE = {"sleep_levels": {1, 2}, "wakes": {"all at once", "staged"}}
ADAPTERS = {"adapters": {"enabled", "disabled", "absent", "evicted"}}
REQUIRED_AXES = {
    "lora_dummy_run": {**GRAPHS, "graph_modes": {"NONE", "FULL"}},
    "lora_graph_capture": {**GRAPHS, "graph_modes": {"FULL", "PIECEWISE"}},
    "lazy_attn_state": {**GRAPHS, "graph_modes": {"PIECEWISE", "FULL_AND_PIECEWISE"}},
    "capture_first_call": {**GRAPHS, "graph_modes": {"PIECEWISE", "FULL", "FULL_AND_PIECEWISE"}},
    "spec_capture_state": {**GRAPHS, "graph_modes": {"FULL_AND_PIECEWISE"}},
    # its states (padding, one draft) are incidental: the hazard is the capture's prewarm
    "spec_prewarm_captured_state": {
        **GRAPHS,
        "graph_modes": {"FULL_AND_PIECEWISE"},
        "states": set(),
    },
    "block_table_wake": WAKE,
    "block_table_graph_wake": {**GRAPHS, **WAKE},
    "moe_align_grid": ADAPTERS,
    "moe_lora_consumer_grid": {**ADAPTERS, "graph_modes": {"FULL"}},
    # a graph captured before the sleep reads the buffers where they were: restored in place
    "level2_sleep_state": {
        **WAKE,
        "wakes": {"all at once", "staged", "staged, kv_cache first"},
        "states": {"graphs across a level-2 sleep"},
    },
    "partial_wake_forward": {
        **WAKE,
        "wakes": {"staged", "staged, kv_cache first"},
        "states": set(),
    },
    # stale bytes in a recycled block: new and running requests, mid-generation growth
    "kv_block_stale_nan": {
        "sleep_levels": {1, 2},
        "states": {
            "hybrid groups",
            "freed block reused by a new request",
            "freed block reused by a running request",
            "running request grows into a new block",
        },
    },
    "sleep_prefix_cache": {
        **WAKE,
        "states": {"prefix hit on blocks cached before a sleep", "a reserved null block"},
    },
    # padding rows and sentinels (issue 23): what pads a batch is a captured graph
    "pad_slot_negative_index": {
        "graph_modes": {"FULL", "PIECEWISE"},
        "states": {
            "padded by tokens",
            "padded count below the largest",
            "an eager dummy run while a request holds blocks",
        },
    },
    "spec_stale_pad_tail": {
        "graph_modes": {"FULL"},
        "states": {
            "padded by tokens",
            "padded by requests only",
            "a dummy run after a larger step",
        },
    },
    # padding rows exist only in graph replays (one size, two paddings)
    "moe_pad_nan_topk": {
        "graph_modes": {"PIECEWISE"},
        "steps_per_size": 2,
        "states": {"padded by tokens"},
    },
    "moe_pad_sentinel": {
        "graph_modes": {"FULL", "PIECEWISE"},
        "steps_per_size": 2,
        "states": {"padded by tokens", "non-local experts marked -1 per pair"},
    },
    # memos, aliases and two notions of one size (issue 24): a swap on the host, no graph
    "input_batch_swap_alias": {
        "graph_modes": {"NONE"},
        "states": {"restricted/unrestricted swap", "restricted/restricted swap"},
    },
    "kernel_block_size": {
        "graph_modes": {"NONE", "FULL_AND_PIECEWISE"},
        "states": {
            "a later KV group split",
            "hybrid groups",
            "split KV group replayed on capture metadata",
        },
    },
    # memos, aliases (issue 24): a hot-added adapter evicts one in flight, eager and replayed
    "lora_slot_memo": {
        "graph_modes": {"NONE", "FULL"},
        "adapters": {"enabled", "evicted"},
        "states": {"two adapters swap slots", "one adapter's slot changes"},
    },
    # a drafter's replay over the target's outputs: in both graph modes, prefill and decode
    "graph_output_alias": {
        "graph_modes": {"PIECEWISE", "FULL"},
        "steps_per_size": 2,
        "states": {"prompt logprobs on", "prompt logprobs off"},
    },
    # async scheduling and copy streams (issue 25): host/device order, eager steps
    "async_pinned_race": {
        "graph_modes": {"NONE"},
        "states": {
            "two steps in flight",
            "three steps in flight",
            "two restricted steps in flight",
        },
    },
    "async_output_lifetime": {
        "graph_modes": {"NONE"},
        "states": {
            "two steps in flight",
            "three steps in flight",
            "copy stream late",
            "main stream late",
        },
    },
    # async scheduling (issue 25): the scheduler one step ahead drives eager steps
    "async_placeholder_leak": {
        "graph_modes": {"NONE"},
        "states": {
            "resumed after preemption",
            "resumed at a later position",
            "two steps in flight",
            "a step that schedules nothing",
        },
    },
    "async_window_free": {
        "graph_modes": {"NONE"},
        "states": {
            "one draft",
            "several drafts",
            "rejections in a row",
            "two steps in flight",
            "window not block-aligned",
            "resumed after preemption",
        },
    },
    # ranks that must agree (issue 43): either rank idle while the other serves or drafts, and both
    "dp_zero_token_skip": {
        "graph_modes": {"NONE"},
        "states": {
            "one DP rank idle, its peer busy",
            "one DP rank idle, its peer drafting",
            "every DP rank idle at once",
            "a DP rank with nothing unfinished, its peer busy",
        },
    },
    # TP ranks that must sample alike: a rank accepting a draft its peer rejects (one draft and
    # several), steps that reject in a row after the ranks agreed, and a draft decided by the
    # sampling stream going on from the earlier steps (not restarted each step)
    "rank_rng_divergence": {
        "graph_modes": {"NONE"},
        "states": {
            "one draft",
            "several drafts",
            "rejections in a row",
            "TP ranks sample drafts' acceptance, seed unset",
            "the sampling stream goes on across verify steps",
        },
    },
    # a drafter's collectives among DP ranks near max_model_len: either rank past the limit
    # while the other drafts (from its first step too), both past it, and past it while the
    # peer idles
    "dp_drafter_boundary_hang": {
        "graph_modes": {"NONE"},
        "states": {
            "one DP rank past the drafter's limit, its peer drafting",
            "a DP rank past the drafter's limit at its first step",
            "every DP rank past the drafter's limit at once",
            "one DP rank idle, its peer busy",
        },
    },
    # EP ranks' graph buckets: batches in different buckets (the larger on either rank, an idle
    # rank's dummy step) and in one bucket, every capture size replayed, several steps a size
    "ep_graph_bucket_local": {
        "graph_modes": {"FULL"},
        "capture_sizes": 3,
        "steps_per_size": 3,
        "states": {
            "EP ranks' batches in different graph buckets",
            "EP ranks' batches in one graph bucket",
            "one DP rank idle, its peer busy",
        },
    },
    # a custom all-reduce's captured calls: a graph replayed inside the capture window and
    # after it, the window's first graph and later ones, and the eager path beside them
    "car_register_before_replay": {
        **GRAPHS,
        "graph_modes": {"NONE", "FULL"},
        "states": {
            "graph replayed inside the capture window",
            "graph replayed after the capture window",
            "the capture window's first graph and later ones",
            "eager all-reduce through the registered buffer",
        },
    },
    # the all-reduce's round under replay: one graph replayed in a row (the stale flag),
    # graphs alternating, eager calls between them
    "allreduce_flag_epoch": {
        **GRAPHS,
        "graph_modes": {"NONE", "FULL"},
        "states": {
            "one graph replayed several times in a row",
            "graphs replayed alternately",
            "eager all-reduce through the registered buffer",
            "the all-reduce's first call",
            "eager calls between replays, the replays outnumbering them",
        },
    },
    # Mamba align-mode prefix caching (issue 44): prompts around block boundaries, a budget one
    # prefill takes whole or two split mid-block, the EAGLE back-off on and off, a resume, the
    # split on chunks resuming mid-block
    "mamba_align_prefix_poison": {
        "graph_modes": {"NONE"},
        "states": {
            "prompt lengths around Mamba block boundaries",
            "two prefills sharing a step's token budget",
            "one prefill per step",
            "EAGLE back-off of the last cache position",
            "no EAGLE back-off",
            "prefix hit on a cached Mamba state",
            "a chunk resuming mid-block",
            "freed block reused by a new request",
        },
    },
    # the conv kernel's two final-state stores: short and long chunks, from a cached state and
    # a fresh one, a later sequence reading the cached block, and each sequence's own slot
    "conv_state_short_chunk": {
        "graph_modes": {"NONE"},
        "states": {
            "conv chunk shorter than its state",
            "conv chunk at least as long as its state",
            "prefill from a prefix-cached state",
            "prefill from a fresh state",
            "a second sequence reusing the prefix",
            "the own slot's conv state after the step",
        },
    },
    # weights reloaded under a graph captured before (issue 44): eager beside the replay, a
    # reload of the same values (which masks it) and of new ones, the reload of a level-2 wake
    "reload_derived_rebind": {
        **WAKE,
        "graph_modes": {"NONE", "FULL"},
        "states": {
            "graphs across a level-2 sleep",
            "weights reloaded with the same values",
            "weights reloaded with new values",
            "several derived tensors",
            "a derived tensor converted to another dtype",
        },
    },
    # a CPU tier's stores under a late compute stream (issue 44): in the step of the writes
    # and a step later (the host a step ahead), one block and several, eager and replayed,
    # then a prefix hit on them
    "offload_store_race": {
        "graph_modes": {"NONE", "FULL"},
        "states": {
            "store issued in the step of its KV writes",
            "store issued a step after its KV writes",
            "one block stored",
            "several blocks stored",
            "prefix hit in the CPU tier",
            "two steps in flight",
        },
    },
    # structured outputs (issue 44): guided and free rows mixed, guided after free, every row
    # guided, the scheduler's order unlike the batch's
    "grammar_bitmask_fill": {
        "graph_modes": {"NONE"},
        "states": {
            "guided and free rows in one batch",
            "guided rows after free rows",
            "every row guided",
            "the scheduler's order unlike the batch's",
            "one guided row",
            "three guided rows",
            "a request guided, then free in the same mask",
        },
    },
    # a drafter's lookahead slots (issue 44): sequences ending at and before a block boundary,
    # one and several drafts, a new request with a prefix hit and one without, its victim on
    # shared prefix blocks, the target eager and replayed, a sequence at max_model_len - k
    "draft_lookahead_alloc": {
        "graph_modes": {"NONE", "FULL"},
        "states": {
            "one draft",
            "several drafts",
            "sequence ends at a block boundary",
            "sequence ends just before a block boundary",
            "new request with a prefix hit",
            "running request on prefix-cache blocks",
            "a request joining in a replayed graph step",
            "blocks reused without prefix caching",
            "sequence at max_model_len - k beside a running request",
        },
    },
}


def _covered(bug) -> dict[str, object]:
    axes = [s.axes for s in bug.scenarios]
    return {
        "graph_modes": {m for a in axes for m in a.graph_modes},
        "capture_sizes": len({n for a in axes for n in a.capture_sizes}),
        "steps_per_size": max(a.steps_per_size for a in axes),
        "sleep_levels": {level for a in axes for level in a.sleep_levels},
        "wakes": {w for a in axes for w in a.wakes},
        "adapters": {s for a in axes for s in a.adapters},
        "states": {s for a in axes for s in a.states},
    }


def test_every_bug_has_required_axes() -> None:
    assert set(REQUIRED_AXES) == {bug.id for bug in BUGS}, "a bug without required axes"


@pytest.mark.parametrize("bug", _bugs())
def test_scenarios_cover_the_axes_that_matter(bug) -> None:
    covered = _covered(bug)
    for axis, need in REQUIRED_AXES[bug.id].items():
        have = covered[axis]
        ok = need <= have if isinstance(need, set) else have >= need
        assert ok, f"{bug.id}: axis {axis} covers {have}, needs {need}"


def test_axes_refuse_unknown_values() -> None:
    from harness.record import Axes

    with pytest.raises(ValueError, match="unknown"):
        Axes(graph_modes=("FULL_DECODE_ONLY",))
    with pytest.raises(ValueError, match="sleep_levels"):
        Axes(sleep_levels=(3,))
    with pytest.raises(ValueError, match="states"):
        Axes(states=("padded by luck",))


def _fuzz_targets() -> set[str]:
    """The bugs `.ci/fuzz-targets` times (its BUGS default)."""
    text = (Path(__file__).parents[1] / ".ci" / "fuzz-targets").read_text()
    listed = re.search(r"\$\{BUGS:-([^}]*)\}", text, re.S)
    assert listed, "no BUGS default in .ci/fuzz-targets"
    return set(listed.group(1).replace("\\\n", " ").split())


def test_every_bug_is_a_fuzz_target_or_its_record_says_why_not() -> None:
    """The definition of done's fuzz clause (docs/adding-a-bug.md, item 11): a bug the fuzzer
    finds is one of .ci/fuzz-targets' BUGS; any other says why in its record (`fuzz`), of a
    kind of FUZZ_REASONS, with the reason after it."""
    from harness.record import FUZZ_REASONS

    targets = _fuzz_targets()
    assert targets <= {bug.id for bug in BUGS}, targets - {bug.id for bug in BUGS}
    for bug in BUGS:
        if bug.id in targets:
            assert not bug.fuzz, f"{bug.id}: a fuzz target whose record says it is not"
            continue
        kind = next((k for k in FUZZ_REASONS if bug.fuzz.startswith(k)), None)
        assert kind, f"{bug.id}: not in .ci/fuzz-targets and its record says nothing of why"
        assert len(bug.fuzz) > len(kind) + 20, f"{bug.id}: a reason, not a word: {bug.fuzz!r}"
