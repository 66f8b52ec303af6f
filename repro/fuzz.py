"""`repro fuzz`: a stateful differential fuzzer of the miniature runner. It reads no scenario.

Hypothesis draws programs (repro/program.py: a runner configuration and a sequence of
operations valid for the state they leave: adapters loaded, captured or not, which tags sleep);
each program runs in an isolated child, like a scenario, which checks the invariants after
every operation. A failure (any class from wrong_result on: a device fault is a finding) is
shrunk (the operations up to the one that broke, then operations, sleep/wake pairs and
requests dropped, a plainer configuration), keeping its outcome class, then confirmed by one
more run. With parts switched off, a finding must pass on the fixed runner: one the fixed
runner shares is a defect of the runner or of the oracle, and ends the search with 125.

Exit codes: 0 nothing found within the budget; 1 a counterexample (printed shrunk, with its
evidence and one command that replays it); 125 cannot test; 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import device as devices
from harness.fixes import ALL_FIXES, UsageError, Variant, describe, parse_fix
from harness.isolate import Isolator, Job
from harness.outcome import EXIT_ABSENT, EXIT_CANNOT_TEST, EXIT_PRESENT, Outcome
from repro import registry

TARGET = "repro.program:run"
EXAMPLE_TIMEOUT_S = 240.0
MAX_OPS = 10
SHRINK_S = 90.0  # at most this long shrinking after a find (then the smallest so far)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from repro.common import dtype_option

    f = sub.add_parser(
        "fuzz",
        help="stateful differential fuzzer of the runner: exit 0 nothing found, 1 found",
        description=__doc__.split("\n\n")[1],
    )
    f.add_argument("bug", nargs="*", help="the variant options apply to these bugs' parts")
    f.add_argument("--variant", choices=("fixed", "buggy"), help="default fixed")
    f.add_argument("--without", action="append", default=[], metavar="PART")
    f.add_argument("--device", help="cpu, cuda or auto (default: $REPRO_DEVICE, else auto)")
    dtype_option(f)
    f.add_argument("--budget", type=float, default=60.0, help="seconds of search (default 60)")
    f.add_argument(
        "--seed",
        default="0",
        help="Hypothesis' seed, or a range A-B: one search per seed and a table (default 0)",
    )
    f.add_argument(
        "--shrink",
        type=float,
        default=SHRINK_S,
        help=f"seconds of shrinking (default {SHRINK_S:g})",
    )
    f.add_argument("--json", metavar="FILE", help="write the finding (or none) as JSON")
    f.add_argument(
        "--shard",
        metavar="K/N",
        help="search only every N-th seed of --seed's range from the K-th (CI's runners)",
    )
    f.add_argument("--replay", metavar="PROGRAM", help="run one program (JSON, or @FILE) once")
    f.set_defaults(run=cmd_fuzz)


def variant(args: argparse.Namespace) -> Variant:
    """The fixes of the run: all, or the named bugs' parts off (--variant buggy), or --without
    parts (with bugs named: theirs only)."""
    bugs = [registry.get(b) for b in args.bug]
    parts = {p for b in bugs for p in b.fix_parts}
    without = {parse_fix(name) for name in args.without}
    if args.variant == "buggy" and not bugs:
        raise UsageError("--variant buggy needs a bug: its parts are the ones switched off")
    if args.variant == "buggy" and without:
        raise UsageError("use one of --variant buggy or --without PART")
    if bugs and without - parts:
        stray = ", ".join(sorted(p.value for p in without - parts))
        raise UsageError(f"--without {stray}: not a part of {', '.join(args.bug)}")
    return ALL_FIXES - (parts if args.variant == "buggy" else without)


def _program(text: str) -> dict:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as e:
            raise UsageError(f"--replay {text}: {e.strerror}") from None
    try:
        program = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--replay: not JSON: {e}") from None
    if not isinstance(program, dict) or set(program) != {"config", "ops"}:
        raise UsageError('--replay: a program is {"config": {...}, "ops": [...]}')
    from repro.program import invalid

    why = invalid(program)
    if why:
        raise UsageError(f"--replay: not a valid program: {why}")
    return program


# How often each configuration value is drawn (repeats weigh; the first is where shrinking
# goes): graphs, LoRA and captures more often than their absence, as they hold more state;
# FULL_AND_PIECEWISE (upstream's default mode), the lazily planned decode backend and uniform
# decode steps most: only they together reach the FULL decode graphs' attention state. Chosen
# by counting, without running any, the programs drawn before the first that reaches it, over
# seeds 0-29: at most 15 with these weights, 49 with FULL_AND_PIECEWISE and FULL equal, one
# backend in two and one decode step in two (and at most 28 against 36 before the first that
# replays a graph which gathers the block tables after a KV wake).
WEIGHTED = {
    "mode": ("FULL_AND_PIECEWISE", "FULL", "PIECEWISE", "NONE") + ("FULL_AND_PIECEWISE",) * 2,
    "backend": ("flashmla", "paged", "flashmla"),
    "lora": (False, True, True),
}
# set by _draw_async, _draw_offload, _draw_hybrid, _draw_engine_states
DRAWN_LAST = ("async", "offload", "hybrid", "engine_blocks")
DECODE = (True, True, False)  # a step is a uniform decode batch, or a mixed one
SETUP_CAPTURE = (True, True, True, False)  # the set-up captures (else a later operation may)


def programs():
    """The Hypothesis strategy of programs (imported lazily: usage errors stay fast): one drawn
    integer seeds the program's own generator (`draw_program`). Hypothesis drawing every choice
    itself made its first 50 examples of a search "small" (each choice after a random prefix at
    its simplest) and most of the rest copies of parts of earlier ones: on a search of a few
    hundred programs, the first that reached lazy_attn_state's FULL decode attention came
    after 90 on seed 0 though one program in nine reaches it. A drawn seed keeps the programs
    of a search independent, and Hypothesis the seeds (--seed), their order and the tests."""
    from hypothesis import strategies as st

    return st.integers(0, 2**32 - 1).map(lambda n: draw_program(random.Random(n)))


def draw_program(rng: random.Random) -> dict:
    """A configuration, a set-up (adapters, a dummy run, a capture: each drawn or not), then
    operations valid in the state the earlier ones left."""
    from repro.program import CONFIG

    # keys drawn later, by their own draws (after the operations), take no value here: a
    # seed's configuration and operations stay the ones it drew before they were added
    config = {
        key: rng.choice(WEIGHTED.get(key, values))
        for key, values in CONFIG.items()
        if key not in DRAWN_LAST
    }
    config["sizes"] = list(config["sizes"])
    if config["backend"] != "paged":  # the split-KV decode has no window (program.invalid)
        config["window"] = 0
    state = {"active": [], "asleep": set(), "captured": False}
    ops: list[list] = []
    if config["lora"]:
        for _ in range(rng.randint(0, config["max_loras"])):
            ops.append(_add_lora(rng, state))
    if rng.random() < 0.5:
        ops.append(_dummy(rng, config))
    if config["mode"] != "NONE" and rng.choice(SETUP_CAPTURE):
        ops.append(["capture"])
        state["captured"] = True
    for _ in range(rng.randint(2, MAX_OPS)):
        ops.append(_operation(rng, config, state))
    _draw_readers(rng, config, ops)
    return {"config": config, "ops": ops}


def _draw_readers(rng: random.Random, config: dict, ops: list[list]) -> None:
    """The keys drawn after the operations (none changes which operations are valid), so a
    seed draws the configuration and operations it drew before them, these keys added: the
    MoE's router (a learned gate only with LoRA off), the speculator's draft prefill, the
    cache-only layer, prompt logprobs, a backend that reorders the batch, requests
    restricted by allowed_token_ids, requests that reach the engine after a partial wake,
    and a tail: an adapter added past the slots between two steps of one batch."""
    from repro.program import MAX_ALLOWED, MAX_MODEL_LEN

    config["moe"] = "hash" if config["lora"] else rng.choice(("hash", "gate", "gate_skip"))
    config["speculator"] = rng.choice(("none", "prefill", "padded"))
    if config["speculator"] == "padded" and config["draft"] and config["backend"] == "flashmla":
        config["speculator"] = "prefill"  # the padded drafter's graphs or the draft attention
    config["extract"] = rng.random() < 0.5
    config["prompt_logprobs"] = rng.random() < 0.5
    config["reorder"] = rng.random() < 0.5
    for op in ops:  # a request in four restricted by allowed_token_ids
        for row in op[1] if op[0] == "step" else ():
            if rng.random() < 0.25:
                row.append(rng.randint(1, MAX_ALLOWED))
    # after a partial wake, a request reaches the engine (one in 2)
    asleep = _after_wakes(
        ops,
        lambda asleep: (
            ["serve", rng.randint(1, 8), rng.randint(0, 99)]
            if asleep and rng.random() < 0.5
            else None
        ),
    )
    active = []
    for op in ops:
        if op[0] == "add_lora":
            active.append(op[1])
        elif op[0] == "remove_lora":
            active.remove(op[1])
    # one LoRA program in two, awake at its end, ends with a hot add: the slots filled, a
    # decode batch of every slot's adapter (and base requests), the add, the batch again
    if config["lora"] and not asleep and rng.random() < 0.5:
        state = {"active": active}
        while len(active) < config["max_loras"]:
            ops.append(_add_lora(rng, state))
        rows = [[lora, 1, rng.randint(0, MAX_MODEL_LEN - 1)] for lora in active]
        rows += [[0, 1, rng.randint(0, MAX_MODEL_LEN - 1)] for _ in range(rng.randint(0, 2))]
        rng.shuffle(rows)
        ops.append(["step", rows, rng.randint(0, 99)])
        ops.append(["hot_add", 9, rng.random() < 0.5])  # (the draw's adapters are 1 to 8)
    _draw_prefix_caching(rng, config, ops)
    _draw_reload(rng, config, ops)
    _draw_guided(rng, ops)
    _draw_async(rng, config, ops)
    _draw_offload(rng, config, ops)
    _draw_smaller_after_larger(rng, config, ops)
    _draw_hybrid(rng, config, ops)
    _draw_engine_states(rng, config, ops)


ASYNC = (0, 0, 0, 1, 2, 3)  # async scheduling in one program in two: steps in flight, at most


def _draw_async(rng: random.Random, config: dict, ops: list[list]) -> None:
    """Async scheduling (one program in two, every one with a sliding window; steps in flight 1
    to 3): one to three runs at idle places, each the async engine (not with prefix caching;
    one request with a backend that reorders; four in five with a window) or steps submitted
    and collected, never more than config async in flight,
    all collected at its end. With the async sampler a guided step keeps no restricted
    request. Drawn last: the program's earlier draws stay."""
    # with a sliding window always (its frees in the engine: one program in six has one)
    config["async"] = rng.choice(ASYNC[-3:] if config["window"] else ASYNC)
    if not config["async"]:
        return
    for op in ops:
        if op[0] == "step" and len(op) == 4:
            op[1] = [row[:3] for row in op[1]]
    for _ in range(rng.randint(1, 3)):
        places = _idle_places(ops)
        if not places:
            return
        at = rng.choice(places)
        engine = not config["prefix_caching"] and rng.random() < (0.8 if config["window"] else 0.5)
        if engine:  # a backend that reorders: one request (nothing to swap)
            ops[at:at] = [_engine(rng, one=config["reorder"])]
        else:
            ops[at:at] = _in_flight(rng, config)


def _idle_places(ops: list[list]) -> list[int]:
    """Awake places (`_awake_places`) with no step in flight, not right before a sleep (with
    prefix caching a prompt served before it goes with it)."""
    waiting = [0]  # steps in flight before each operation
    for op in ops:
        waiting.append(waiting[-1] + {"submit": 1, "collect": -1}.get(op[0], 0))
    after = lambda i: [op[0] for op in ops[i:] if op[0] != "reload"][:1]
    before_sleep = lambda i: after(i) == ["sleep"]
    return [i for i in _awake_places(ops) if not waiting[i] and not before_sleep(i)]


def _draw_offload(rng: random.Random, config: dict, ops: list[list]) -> None:
    """A CPU KV tier (one program in two without prefix caching, the padded drafter or the
    draft attention): one or two prompts whose blocks another prompt's step stored, at idle
    places. Drawn last: the earlier draws stay."""
    from repro.program import MAX_OFFLOAD_BLOCKS

    draft = config["draft"] and config["backend"] == "flashmla"
    config["offload"] = (
        not config["prefix_caching"]
        and config["speculator"] != "padded"
        and not draft
        and rng.random() < 0.5
    )
    if not config["offload"]:
        return
    for _ in range(rng.randint(1, 2)):
        places = _idle_places(ops)
        if not places:
            return
        at = rng.choice(places)
        ops[at:at] = [["offload", rng.randint(1, MAX_OFFLOAD_BLOCKS), rng.randint(0, 99)]]


def _draw_smaller_after_larger(rng: random.Random, config: dict, ops: list[list]) -> None:
    """With a speculator and a capture (one such program in two): a larger batch of prefills
    past the largest graph (eager), then a decode step of one or two requests (a replay padded
    by requests), at an idle place after the capture. Drawn last: the earlier draws stay."""
    from repro.program import MAX_MODEL_LEN, MAX_TOKENS

    captures = [i for i, op in enumerate(ops) if op[0] == "capture"]
    if config["speculator"] == "none" or not captures or rng.random() < 0.5:
        return
    places = [i for i in _idle_places(ops) if i > captures[0]]
    if not places:
        return
    larger, total = [], 0
    while total <= max(config["sizes"]) or len(larger) < 2:
        n = rng.randint(2, 8)
        if total + n > MAX_TOKENS or len(larger) == 4:
            break
        larger.append([0, n, rng.randint(0, MAX_MODEL_LEN - n)])
        total += n
    smaller = [[0, 1, rng.randint(0, MAX_MODEL_LEN - 1)] for _ in range(rng.randint(1, 2))]
    at = rng.choice(places)
    ops[at:at] = [["step", larger, rng.randint(0, 99)], ["step", smaller, rng.randint(0, 99)]]


def _draw_hybrid(rng: random.Random, config: dict, ops: list[list]) -> None:
    """A hybrid runner (one program in two without a CPU tier or the draft attention; with
    backend flashmla its decode loads whole pages): without prefix caching, a sleep and a
    wake (level drawn) at an idle place if the program has none, and a fresh request right
    after each wake that leaves the worker awake. Drawn last: the earlier draws stay."""
    from repro.program import MAX_MODEL_LEN

    draft = config["draft"] and config["backend"] == "flashmla"
    config["hybrid"] = not config["offload"] and not draft and rng.random() < 0.5
    if not config["hybrid"] or config["prefix_caching"]:
        return
    if not any(op[0] == "sleep" for op in ops):
        places = _idle_places(ops)
        if not places:
            return
        at = rng.choice(places)
        ops[at:at] = [["sleep", rng.choice([1, 2])], ["wake", None]]
    _after_wakes(
        ops,
        lambda asleep: (
            None if asleep else ["fresh", rng.randint(2, MAX_MODEL_LEN - 2), rng.randint(0, 99)]
        ),
    )


def _draw_engine_states(rng: random.Random, config: dict, ops: list[list]) -> None:
    """The states the engine's runs reach, drawn again for the engine operations already drawn
    (drawn last: the earlier draws stay): under a sliding window, rollbacks over the blocks
    it freed (`_rollback_engine`); else, four such programs in five without a hybrid runner
    (its rows' state blocks go uncounted) or a backend that reorders (one request, which a
    scarce pool never preempts), a scarce pool (config engine_blocks) that two or three
    requests outgrow (`_scarce_engine`)."""
    from repro.program import ENGINE_BLOCKS

    config["engine_blocks"] = 0
    engines = [op for op in ops if op[0] == "engine"]
    if config["window"]:
        for op in engines:
            op[1:] = _rollback_engine(rng, one=config["reorder"])[1:]
    elif engines and not config["hybrid"] and not config["reorder"] and rng.random() < 0.8:
        config["engine_blocks"] = ENGINE_BLOCKS
        for op in engines:
            op[1:] = _scarce_engine(rng)[1:]


def _rollback_engine(rng: random.Random, one: bool = False) -> list:
    """An engine's run under a sliding window of 8 whose rollbacks reach behind the blocks the
    window freed: one or two requests of the longest prompt (their counts pass the window and
    a block by the first decode), three or four tokens, two drafts a decode, most steps' drafts
    rejected (a rollback of two where the window's start just passed a block's end)."""
    from repro.program import MAX_DRAFTS, MAX_PROMPT

    count, max_tokens = 1 if one else rng.randint(1, 2), rng.randint(3, 4)
    rejects = [i for i in range(12) if rng.random() < 0.7]
    return [
        "engine",
        [[MAX_PROMPT, max_tokens]] * count,
        rng.randint(0, 99),
        MAX_DRAFTS,
        0,
        rejects,
    ]


def _scarce_engine(rng: random.Random) -> list:
    """An engine's run on a scarce pool (config engine_blocks): two or three long requests of
    two or three tokens whose blocks outgrow it (the last running one preempted, resumed in a
    later step), a budget one time in three (fitting a preempted request's prefill again),
    rejected steps."""
    from repro.program import MAX_DRAFTS, MAX_PROMPT

    count, max_tokens = rng.randint(2, 3), rng.randint(2, 3)
    reqs = [[rng.randint(6, MAX_PROMPT), max_tokens] for _ in range(count)]
    k = rng.choice((0, 1, *[MAX_DRAFTS] * 2))
    budget = 0
    if rng.random() < 1 / 3:
        least = max(n + m for n, m in reqs)
        budget = rng.randint(least, least + 4)
    rejects = [i for i in range(12) if rng.random() < 0.4]
    return ["engine", reqs, rng.randint(0, 99), k, budget, rejects]


def _in_flight(rng: random.Random, config: dict) -> list[list]:
    """Steps submitted and collected (a collect only when a step is in flight, a submit while
    fewer than config async are): two to six submits, every one collected by the end."""
    from repro.program import MAX_ALLOWED

    ops, waiting = [], 0
    for _ in range(rng.randint(2, 6)):
        while waiting and (waiting == config["async"] or rng.random() < 0.3):
            ops.append(["collect"])
            waiting -= 1
        rows = [[0, *r[1:]] for r in _batch(rng, config, [])]
        restricted = rng.random() < 0.5  # a step in two restricts some of its requests
        for row in rows if restricted else ():
            if rng.random() < 0.5:  # by allowed_token_ids
                row.append(rng.randint(1, MAX_ALLOWED))
        ops.append(["submit", rows, rng.randint(0, 99)])
        waiting += 1
    return ops + [["collect"]] * waiting


def _engine(rng: random.Random, one: bool = False) -> list:
    """The async engine's run: requests (longer prompts more often: a window's frees), two
    drafts a decode most often, a token budget one time in two, rejected steps."""
    from repro.program import MAX_DRAFTS, MAX_ENGINE_REQS, MAX_OUTPUT, MAX_PROMPT

    budget, max_tokens = rng.random() < 0.6, rng.randint(1, MAX_OUTPUT)
    count = 1 if one else 2 if budget else rng.randint(1, MAX_ENGINE_REQS)
    # one max_tokens (the requests finish together; with a budget the second's own): the
    # engine's rows are its KV rows, which a request skipped before a scheduled one breaks
    reqs = [[rng.randint(rng.choice((1, 4)), MAX_PROMPT), max_tokens] for _ in range(count)]
    if budget and count == 2:
        reqs[1][1] = rng.randint(1, max_tokens)
    k = rng.choice((0, 1, *[MAX_DRAFTS] * 2))
    if budget:
        least = max(max(n for n, _ in reqs), 1 + k)
        budget = rng.randint(least, least + 4)
    rejects = [i for i in range(12) if rng.random() < 0.4]
    return ["engine", reqs, rng.randint(0, 99), k, budget, rejects]


def _draw_guided(rng: random.Random, ops: list[list]) -> None:
    """Guided requests beside free ones: one step in three gets toy grammars for some of its
    rows (all of them one time in four), in a scheduler order of their own. Drawn last: the
    program's earlier draws stay."""
    from repro.program import MAX_MODULUS

    for op in ops:
        if op[0] == "step" and rng.random() < 1 / 3:
            rows = list(range(len(op[1])))
            rng.shuffle(rows)
            count = len(rows) if rng.random() < 0.25 else rng.randint(1, max(1, len(rows) - 1))
            guided = []
            for row in rows[:count]:
                modulus = rng.randint(2, MAX_MODULUS)
                guided.append([row, modulus, rng.randrange(modulus)])
            op.append(guided)


def _after_wakes(ops: list[list], make) -> set[str]:
    """Put after each wake in `ops` the operation `make(tags still asleep)` returns (None:
    none); the tags asleep at the end."""
    out, asleep = [], set()
    for op in ops:
        out.append(op)
        if op[0] == "sleep":
            asleep = {"weights", "kv_cache"}
        elif op[0] == "wake":
            asleep -= set(op[1] or asleep)
            added = make(asleep)
            if added is not None:
                out.append(added)
    ops[:] = out
    return asleep


def _awake_places(ops: list[list], start: int = 0) -> list[int]:
    """Where an operation may go into `ops` (from `start`): the worker awake, not between a
    hot add and its batch."""
    places, asleep = [], set()
    end = len(ops) - 2 if ops and ops[-1][0] == "hot_add" else len(ops)
    for i, op in enumerate(ops[: end + 1]):
        if not asleep and i >= start:
            places.append(i)
        if op[0] == "sleep":
            asleep = {"weights", "kv_cache"}
        elif op[0] == "wake":
            asleep -= set(op[1] or asleep)
    return places


def _draw_reload(rng: random.Random, config: dict, ops: list[list]) -> None:
    """Derived weights (one program in two) and, then, a weight reload of a new checkpoint
    at an awake place after the capture (when there is one: its graphs are replayed after
    it), one to two of them. Drawn last: the program's earlier draws stay."""
    config["derived"] = rng.random() < 0.5
    if not config["derived"]:
        return
    captures = [i for i, op in enumerate(ops) if op[0] == "capture"]
    for _ in range(rng.randint(1, 2)):
        places = _awake_places(ops, captures[0] + 1 if captures else 0)
        if places:
            at = rng.choice(places)
            ops[at:at] = [["reload", rng.randint(1, 9)]]


def _draw_prefix_caching(rng: random.Random, config: dict, ops: list[list]) -> None:
    """Prefix caching (one program in two that may have it: no tables in graphs, no window):
    each sleep's wake is followed by a prompt served before it (a prefix hit on blocks cached
    before the sleep); a program without a sleep gets a sleep and a wake (level drawn) at an
    awake place, before any hot add's batch. Drawn last: the program's earlier draws stay."""
    from repro.program import MAX_MODEL_LEN

    config["prefix_caching"] = (
        not config["tables_in_graph"] and not config["window"] and rng.random() < 0.5
    )
    if not config["prefix_caching"]:
        return
    if not any(op[0] == "sleep" for op in ops):
        at = rng.choice(_awake_places(ops))
        ops[at:at] = [["sleep", rng.choice([1, 2])], ["wake", None]]
    served, asleep, prompt = [], set(), None
    for op in ops:
        if op[0] == "sleep":
            prompt = ["generate", rng.randint(17, MAX_MODEL_LEN - 2), rng.randint(0, 99)]
            served.append(prompt)
            asleep = {"weights", "kv_cache"}
        served.append(op)
        if op[0] == "wake":
            asleep -= set(op[1] or asleep)
            if not asleep:
                served.append(list(prompt))
    ops[:] = served


def _add_lora(rng: random.Random, state: dict) -> list:
    lora = min(set(range(1, 9)) - set(state["active"]))
    state["active"].append(lora)
    return ["add_lora", lora, rng.random() < 0.5]  # False: no expert weights (disabled)


def _dummy(rng: random.Random, config: dict) -> list:
    from repro.program import MAX_REQS

    tokens = rng.randint(1, max(config["sizes"]))
    return ["dummy", tokens, rng.randint(1, min(tokens, MAX_REQS))]


def _operation(rng: random.Random, config: dict, state: dict) -> list:
    active, asleep = state["active"], state["asleep"]
    if asleep:
        tags = rng.choice([None, *sorted(asleep)])
        asleep -= set(asleep) if tags is None else {tags}
        return ["wake", None if tags is None else [tags]]
    names = ["step", "step", "capture", "add_lora", "dummy", "remove_lora", "sleep"]
    if state["captured"] or config["mode"] == "NONE":
        names.remove("capture")
    if not config["lora"] or len(active) == config["max_loras"]:
        names.remove("add_lora")
    if not active:
        names.remove("remove_lora")
    name = rng.choice(names)
    if name == "step":
        return ["step", _batch(rng, config, active), rng.randint(0, 99)]
    if name == "capture":
        state["captured"] = True
        return ["capture"]
    if name == "add_lora":
        return _add_lora(rng, state)
    if name == "remove_lora":
        lora = rng.choice(active)
        active.remove(lora)
        return ["remove_lora", lora]
    if name == "dummy":
        return _dummy(rng, config)
    state["asleep"] = {"weights", "kv_cache"}
    return ["sleep", rng.choice([1, 2])]


def _batch(rng: random.Random, config: dict, active: list) -> list[list[int]]:
    """Requests [lora, tokens, computed]: uniform decode or mixed; mostly within the largest
    graph."""
    from repro.program import MAX_MODEL_LEN, MAX_REQS, MAX_TOKENS

    decode = rng.choice(DECODE)
    limit = MAX_TOKENS if rng.randint(0, 3) == 3 else max(config["sizes"])
    rows, total = [], 0
    for _ in range(rng.randint(1, MAX_REQS)):
        n = 1 if decode else rng.randint(1, 8)
        if total + n > limit:
            break
        lora = rng.choice([0, *active])
        rows.append([lora, n, rng.randint(0, MAX_MODEL_LEN - n)])
        total += n
    return rows or [[0, 1, 0]]


class _OutOfTime(BaseException):
    """Raised in the test body when the budget is spent (Hypothesis lets it through)."""


@dataclass
class Search:
    """What the search saw: programs run, the first find (then the smallest failing one)."""

    isolator: Isolator
    fixes: Variant
    device: str
    budget_s: float
    shrink_s: float = SHRINK_S
    dtype: str = "float32"  # the runner's
    started: float = field(default_factory=time.monotonic)
    examples: int = 0
    to_find: int = 0  # programs run up to the find
    found_after_s: float | None = None
    outcome: Outcome | None = None
    best: tuple[dict, str] | None = None  # (program, evidence)
    broken: str | None = None  # the harness broke: why
    on_fixed: dict = field(default_factory=dict)  # program -> the fixed runner's failure class

    def job(self, program: dict, fixes: Variant | None = None) -> Job:
        payload = json.dumps(program, separators=(",", ":"))
        return Job(
            "fuzz",
            f"example-{self.examples}",
            TARGET,
            self.fixes if fixes is None else fixes,
            self.device,
            EXAMPLE_TIMEOUT_S,
            0,
            payload=payload,
            dtype=self.dtype,
        )

    def attempt(self, program: dict) -> str | None:
        """The evidence when `program` is valid and still shows the finding's class."""
        from repro.program import invalid

        if invalid(program) or time.monotonic() - self.started > self.shrink_deadline:
            return None
        self.examples += 1
        result = self.isolator.run(self.job(program))
        return result.evidence if result.outcome == self.outcome else None

    @property
    def shrink_deadline(self) -> float:
        return (self.found_after_s or 0.0) + self.shrink_s

    def run(self, program: dict):
        """Hypothesis' test body: run one program; the first failure ends the search."""
        if time.monotonic() - self.started > self.budget_s or self.broken or self.best:
            raise _OutOfTime
        self.examples += 1
        result = self.isolator.run(self.job(program))
        if result.outcome in (Outcome.ERROR, Outcome.SKIPPED):
            self.broken = f"{result.outcome.value}: {result.evidence.strip()[:2000]}"
        elif result.outcome.is_failure and self.fixed_fails(program):
            self.broken = (
                f"the fixed runner fails this program too ({self.fixed_fails(program)}): a defect "
                "of the runner or of the fuzzer's oracle, not of the parts switched off:\n"
                f"repro fuzz --device {self.device}{_dtype_words(self.dtype)} --replay "
                f"{shlex.quote(json.dumps(program, separators=(',', ':')))}\n{result.evidence}"
            )
        elif result.outcome.is_failure:
            self.outcome, self.found_after_s = result.outcome, time.monotonic() - self.started
            self.best, self.to_find = (program, result.evidence), self.examples
        if self.broken or self.best:
            raise _OutOfTime

    def fixed_fails(self, program: dict) -> str | None:
        """With parts switched off, a finding must be theirs: the class the fixed runner
        shows for `program` (None: it passes, or nothing is switched off)."""
        if self.fixes == ALL_FIXES:
            return None
        key = json.dumps(program, sort_keys=True)
        if key not in self.on_fixed:
            result = self.isolator.run(self.job(program, ALL_FIXES))
            self.on_fixed[key] = result.outcome.value if result.outcome.is_failure else None
        return self.on_fixed[key]


def search(search: Search, seed: int) -> None:
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed

    @hypothesis_seed(seed)
    @settings(
        database=None,
        max_examples=10**6,
        deadline=None,
        verbosity=Verbosity.quiet,
        phases=(Phase.generate,),  # shrinking: minimize(), operation-aware and cheaper
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(programs())
    def body(program: dict) -> None:
        search.run(program)

    with contextlib.suppress(_OutOfTime):  # the finding (if any) is in search.best
        body()
    if search.best is not None:
        first = search.best
        search.best = minimize(search, *search.best)
        if search.best[0] != first[0] and search.fixed_fails(search.best[0]):
            search.best = first  # shrunk onto a program the fixed runner fails too


# configuration values a shrunk program tries, one at a time (the plainest runner)
SIMPLEST = {
    "draft": False,
    "tables_in_graph": False,
    "specialize": False,
    "backend": "paged",
    "sizes": [4],
    "max_loras": 2,
    "speculator": "none",
    "extract": False,
    "prompt_logprobs": False,
}


def _drop_guided(step: list, row: int) -> list:
    """A step's grammars (none, or a list of one) after its request `row` is dropped."""
    if len(step) < 4:
        return []
    kept = [[r - (r > row), m, st] for r, m, st in step[3] if r != row]
    return [kept] if kept else []


def minimize(s: Search, program: dict, evidence: str) -> tuple[dict, str]:
    """Shrinking, operation-aware: the prefix up to the operation the oracle names (or the
    shortest failing prefix, by binary search), then each operation dropped, each step's
    requests dropped (and their allowed_token_ids), the configuration made plainer; each
    candidate kept when it is valid and still shows the class, until the shrink deadline."""

    def tried(ops: list) -> str | None:
        return s.attempt({"config": program["config"], "ops": ops})

    ops = program["ops"]
    failing = re.search(r"^operation (\d+) \(", evidence, re.M)  # the oracle names it
    if failing and int(failing.group(1)) + 1 < len(ops):
        found = tried(ops[: int(failing.group(1)) + 1])
        if found is not None:
            ops, evidence = ops[: int(failing.group(1)) + 1], found
    low, high = 1, len(ops)
    while low < high:  # the shortest prefix that still fails (assumed monotone; checked)
        mid = (low + high) // 2
        found = tried(ops[:mid])
        if found is None:
            low = mid + 1
        else:
            high, evidence = mid, found
    ops = ops[:high]
    for i in reversed(range(len(ops))):
        if i >= len(ops):
            continue
        end = i + 1  # a sleep goes with the wakes (and requests served) that follow it
        while ops[i][0] == "sleep" and end < len(ops) and ops[end][0] in ("wake", "serve"):
            end += 1
        found = tried(ops[:i] + ops[end:])
        if found is not None:
            ops, evidence = ops[:i] + ops[end:], found
    for i, op in enumerate(ops):
        if op[0] != "step":
            continue
        for row in reversed(range(len(op[1]))):
            rows = ops[i][1][:row] + ops[i][1][row + 1 :]
            candidate = [*ops[:i], ["step", rows, op[2], *_drop_guided(ops[i], row)], *ops[i + 1 :]]
            found = tried(candidate) if rows else None
            if found is not None:
                ops, evidence = candidate, found
        if len(ops[i]) == 4:  # the grammars dropped
            candidate = [*ops[:i], ops[i][:3], *ops[i + 1 :]]
            found = tried(candidate)
            if found is not None:
                ops, evidence = candidate, found
        for row in range(len(ops[i][1])):  # a restricted request's allowed_token_ids dropped
            if len(ops[i][1][row]) == 4:
                rows = [*ops[i][1][:row], ops[i][1][row][:3], *ops[i][1][row + 1 :]]
                candidate = [*ops[:i], ["step", rows, *ops[i][2:]], *ops[i + 1 :]]
                found = tried(candidate)
                if found is not None:
                    ops, evidence = candidate, found
    config = program["config"]
    for key, simplest in SIMPLEST.items():
        if config.get(key, simplest) != simplest:
            candidate = {"config": {**config, key: simplest}, "ops": ops}
            found = s.attempt(candidate)
            if found is not None:
                config, evidence = candidate["config"], found
    return {"config": config, "ops": ops}, evidence


def replay_command(args: argparse.Namespace, device: str, program: dict) -> str:
    words = ["repro", "fuzz", *args.bug]
    if args.variant:
        words += ["--variant", args.variant]
    for part in args.without:
        words += ["--without", part]
    words += ["--device", device, *_dtype_words(args.dtype).split()]
    words += ["--replay", json.dumps(program, separators=(",", ":"))]
    return shlex.join(words)


def _dtype_words(dtype: str) -> str:
    return "" if dtype == "float32" else f" --dtype {dtype}"


def _seeds(text: str) -> list[int]:
    try:
        first, _, last = text.partition("-")
        seeds = list(range(int(first), int(last or first) + 1))
    except ValueError:
        seeds = []
    if not seeds:
        raise UsageError(f"--seed takes N or A-B (A <= B), got {text!r}")
    return seeds


def cmd_fuzz(args: argparse.Namespace) -> int:
    from repro.common import device_choice, parse_shard, prepare, time_limit

    fixes = variant(args)
    program = _program(args.replay) if args.replay is not None else None
    seeds = _seeds(args.seed)
    shard = parse_shard(args.shard)
    if shard is not None:
        seeds = seeds[shard[0] - 1 :: shard[1]]
        if not seeds:
            raise UsageError(f"--shard {args.shard}: --seed {args.seed} has no seed for this part")
    for name in ("budget", "shrink"):
        value = getattr(args, name)
        if not 0 < value < float("inf") and not (name == "shrink" and value == 0):
            raise UsageError(f"--{name} takes seconds > 0, got {value}")
    device = devices.resolve(device_choice(args.device))
    if args.json:
        from repro.common import writable

        writable(args.json, "--json")
    cap = time_limit(args)
    where = device if args.dtype == "float32" else f"{device} {args.dtype}"
    label = f"fuzz [{describe(fixes, _parts(args))}, {where}]"
    docs, codes = [], []
    with Isolator() as isolator:
        isolator.warm(device)
        why_not = prepare(isolator, device)
        if why_not:
            print(f"{label}: cannot test: {why_not}")
            return EXIT_CANNOT_TEST
        for seed in [None] if program is not None else seeds:
            budget = min(args.budget, cap or args.budget)
            s = Search(isolator, fixes, device, budget, args.shrink, dtype=args.dtype)
            if program is not None:
                s.examples = s.to_find = 1
                first = isolator.run(s.job(program))
                s.outcome, s.best = first.outcome, (program, first.evidence)
                s.found_after_s = first.seconds if first.outcome.is_failure else None
            else:
                search(s, seed)
            again = None
            if s.best and s.outcome.is_failure:
                again = isolator.run(s.job(s.best[0]))
            code, doc = _report(args, label, device, seed, s, again)
            codes.append(code)
            docs.append(doc)
    if len(docs) > 1:
        _table(label, docs)
    if args.json:
        from repro import results

        payload = docs[0] if len(docs) == 1 else {"label": label, "runs": docs}
        results.replace(args.json, json.dumps(payload, indent=1) + "\n")
    return max(codes, key=lambda c: (c == EXIT_CANNOT_TEST, c))


def _table(label: str, docs: list[dict]) -> None:
    from repro.common import print_table

    rows = [("seed", "found", "class", "seconds to find", "programs to find", "operations")]
    for d in docs:
        found = d["found"]
        rows.append(
            (
                str(d["seed"]),
                "yes" if found else "no",
                d.get("outcome", "-"),
                f"{d['found_after_s']:.1f}" if found else f"> {d['seconds']:.0f}",
                str(d.get("programs_to_find", d["examples"])),
                str(len(d["program"]["ops"])) if found else "-",
            )
        )
    print(f"\n{label}:")
    print_table(rows)


def _parts(args: argparse.Namespace) -> tuple:
    return tuple(p for b in args.bug for p in registry.get(b).fix_parts)


def _report(args, label: str, device: str, seed, s: Search, again) -> tuple[int, dict]:
    from repro import common

    elapsed = time.monotonic() - s.started
    doc = {
        "label": label,
        "device": device,
        "seed": seed,
        "examples": s.examples,
        "seconds": round(elapsed, 1),
        "found": False,
    }
    if s.broken or (
        s.outcome is not None and not s.outcome.is_failure and s.outcome != Outcome.PASS
    ):
        why = s.broken or f"{s.outcome.value}: {s.best[1] if s.best else ''}"
        print(f"{label}: cannot test: {why.splitlines()[0] if why else ''}")
        print(common.evidence_lines(why))
        code = EXIT_CANNOT_TEST
    elif s.best is None or not s.outcome.is_failure:
        print(f"{label}: nothing found: {s.examples} programs in {elapsed:.0f}s (seed {seed})")
        code = EXIT_ABSENT
    else:
        from repro.program import describe as describe_op

        program, evidence = s.best
        confirmed = again is not None and again.outcome == s.outcome
        print(
            f"{label}: FOUND {s.outcome.value} after {s.found_after_s:.1f}s "
            f"(program {s.to_find}; shrunk to {len(program['ops'])} operations in "
            f"{s.examples - s.to_find} more runs)"
        )
        print(f"  config: {json.dumps(program['config'])}")
        for i, op in enumerate(program["ops"]):
            print(f"  {i:2d}. {describe_op(op)}")
        print(common.evidence_lines(evidence, "    "))
        command = replay_command(args, device, program)
        print(f"  replay: {command}")
        code = EXIT_PRESENT if confirmed else EXIT_CANNOT_TEST
        if not confirmed:
            seen = again.outcome.value if again else "not run"
            print(f"{label}: cannot test: flaky: the shrunk program gave {seen} on a second run")
        doc.update(
            found=True,
            outcome=s.outcome.value,
            found_after_s=round(s.found_after_s, 1),
            programs_to_find=s.to_find,
            program=program,
            evidence=evidence,
            replay=command,
            confirmed=confirmed,
        )
    sys.stdout.flush()
    return code, doc
