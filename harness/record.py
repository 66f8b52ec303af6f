"""Bug records and scenarios as data (Defects4J-style): what each bug is and what it must show.

A record is importable without torch: the CLI reads records to check its arguments in a few
milliseconds. A bug's scenario functions live in its package's `scenarios` module (imported only
by the child that runs one), each named as its scenario; its docstring is the scenario's report.

A scenario's expectations are ordered rules: the first rule one of whose fix parts is missing
from the variant decides the outcome; when no rule fires the scenario must pass.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.outcome import ByDevice, Outcome


@dataclass(frozen=True, slots=True)
class Context:
    """What a scenario function receives in its child process."""

    fixes: Variant
    device: str  # "cpu" (Triton interpreter) or "cuda"
    seed: int = 0
    payload: str = ""  # what the parent handed over besides (a fuzz program, as JSON)
    dtype: str = "float32"  # the runner's dtype (repro run/check/matrix --dtype)
    # a scenario of ranks (Scenario.ranks > 1) runs once per rank, in a process of its own
    # (harness.ranks), torch.distributed's process group joined: this rank, of so many, and
    # the file its collectives are recorded in before they are issued (the runner's
    # harness.runner.parallel.Collectives writes it)
    rank: int = 0
    world_size: int = 1
    trace: str = ""


@dataclass(frozen=True, slots=True)
class Expect:
    """When any of `missing` is off, the scenario shows `outcome` (per device)."""

    missing: frozenset[Fix]
    outcome: ByDevice
    why: str = ""


# the runner's dtypes (harness.runner.model.DTYPES; float16 is not one: the decoder's integer
# weights put LoRA logits past float16's largest value, 65504)
DTYPES = ("float32", "bfloat16")
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE")
# wake_up() / wake_up([weights]) then wake_up([kv_cache]) / the KV cache first, then weights
WAKES = ("all at once", "staged", "staged, kv_cache first")
ADAPTER_STATES = ("enabled", "disabled", "absent", "evicted")  # disabled: no expert weights
FUZZ_REASONS = ("kernel level: ", "not drawn yet: ")  # BugRecord.fuzz's kinds
# the kinds of runner state a scenario walks: a request, a step or a config that makes it so
STATES = (
    # sleep and wake
    "graphs across a level-2 sleep",  # a graph captured before sleep(2) replayed after the wake
    "prefix hit on blocks cached before a sleep",  # a prompt repeated across a sleep, cache on
    # a sliding window's reserved null block (block 0 of each group: never free, never a
    # request's), the pool's one block always in use
    "a reserved null block",
    # KV blocks
    "running request grows into a new block",  # a decode step crosses into a block it is given
    "freed block reused by a running request",  # a running request is given a block another freed
    "freed block reused by a new request",  # a new request is given a block another freed
    "hybrid groups",  # a state group in group 0's blocks (RunnerConfig.cache.hybrid)
    "a later KV group split",  # a group after group 0 in kernel blocks under the manager's
    # a split group's steps replayed on the metadata built from the capture's dummy batches
    "split KV group replayed on capture metadata",
    # padding of a graph replay
    "padded by tokens",  # padding tokens (and so padding rows) behind the live ones
    "padded by requests only",  # the graph's tokens filled exactly, padding requests
    "live rows not first",  # padding rows before or among the live rows
    # a dummy run (an idle DP rank's step, a warm-up) of fewer tokens than the step before it
    "a dummy run after a larger step",
    # a dummy batch (every slot -1) run eagerly, no graph, between a running request's steps
    "an eager dummy run while a request holds blocks",
    "padded count below the largest",  # padded to a captured size under the largest
    # an expert-parallel rank's expert map marks another rank's experts -1: invalid ids per
    # (token, slot) pair, beside a valid one in the same row (a padding row is -1 throughout)
    "non-local experts marked -1 per pair",
    # LoRA slots
    "one adapter's slot changes",  # between steps of one batch, the other adapters' stay
    "two adapters swap slots",  # between steps of one batch, two in-flight adapters trade slots
    # sampling states
    "restricted/unrestricted swap",  # a row with allowed_token_ids swapped with one without
    "restricted/restricted swap",  # two rows with different allowed_token_ids swapped
    "prompt logprobs on",
    "prompt logprobs off",
    # async scheduling
    "two steps in flight",  # a step launched before the last one's output reached the host
    "three steps in flight",
    "two restricted steps in flight",  # two in flight, each with allowed_token_ids
    # streams.py's forced orders (RunnerConfig.scheduler.late_stream): the copy stream's work
    # reaches the device after the main stream's queued work, or the main stream's after the
    # copy stream's (the device behind the host)
    "copy stream late",
    "main stream late",
    "resumed after preemption",  # a preempted request scheduled again
    # a request scheduled again past position 0 after a step without it (skipped, or resumed
    # with its computed tokens kept)
    "resumed at a later position",
    "a step that schedules nothing",  # every request over the token budget: no launch
    "window not block-aligned",  # a sliding window that is no multiple of a block size
    # speculative decoding
    "one draft",  # one draft token per request and step
    "several drafts",
    "rejections in a row",  # drafts rejected by successive steps, each launched on the last
    # ranks (Scenario.ranks > 1)
    "one DP rank idle, its peer busy",  # zero scheduled tokens on one rank, tokens on another
    "every DP rank idle at once",  # zero scheduled tokens on every rank, requests unfinished
    "a DP rank with nothing unfinished, its peer busy",  # its requests ended; the loop goes on
    # zero scheduled tokens on one rank while the other's step runs the drafter after it: the
    # idle rank's dummy step must run the drafter's dummy steps too
    "one DP rank idle, its peer drafting",
    # each TP rank draws its own acceptance uniforms for the same drafts, the engine seed unset
    "TP ranks sample drafts' acceptance, seed unset",
    # a draft decided by whether the sampling generator's stream went on from earlier steps (a
    # generator seeded again every step repeats the first step's uniforms)
    "the sampling stream goes on across verify steps",
    # a batch past the drafter's limit (its longest sequence plus the drafts over
    # max_model_len: no drafts) on one DP rank while another's batch drafts, and on every rank
    "one DP rank past the drafter's limit, its peer drafting",
    "every DP rank past the drafter's limit at once",
    # a rank's batch past the drafter's limit at the rank's first step (a long prompt), before
    # its ranks have agreed on any draft step
    "a DP rank past the drafter's limit at its first step",
    # expert-parallel ranks' decode batches whose local counts fall in different graph buckets
    # (capture sizes), and in one bucket with different counts
    "EP ranks' batches in different graph buckets",
    "EP ranks' batches in one graph bucket",
    # a custom all-reduce's graphs (harness/runner/custom_allreduce.py): a graph replayed inside
    # the capture window, before its buffers are registered, and after it closes; the window's
    # first graph and its later ones; its eager (registered buffer) path
    "graph replayed inside the capture window",
    "graph replayed after the capture window",
    "the capture window's first graph and later ones",
    "eager all-reduce through the registered buffer",
    # a graph whose all-reduce is the only writer of the flags between two of its replays (the
    # same graph replayed in a row), and graphs replayed alternately (each replay's flags
    # overwritten by another's)
    "one graph replayed several times in a row",
    # the communicator's first call (its flags as allocated), and eager calls between replays
    # for long enough that the replays outnumber the host's calls since the capture
    "the all-reduce's first call",
    "eager calls between replays, the replays outnumbering them",
    "graphs replayed alternately",
    # a Mamba layer's align-mode prefix caching (harness/runner/mamba_align.py): the prompts'
    # lengths just past, inside and on block boundaries; the step's token budget taken by one
    # prefill or split between two; the last cacheable position backed off a block for EAGLE
    # or not; a later request resuming from a cached state; the split itself on chunks that
    # resume mid-block (upstream: a prefix hit finer than a block)
    "prompt lengths around Mamba block boundaries",
    "two prefills sharing a step's token budget",
    "one prefill per step",
    "EAGLE back-off of the last cache position",
    "no EAGLE back-off",
    "prefix hit on a cached Mamba state",
    "a chunk resuming mid-block",
    # the causal-conv1d kernel's two stores of a chunk's final conv state (kernels/
    # causal_conv1d.py): a chunk shorter than the state (width - 1 tokens) or not, from a cached
    # state (read from another slot than the one written) or a fresh one, and a sequence after
    # it that reuses the same cached prefix; each sequence's own slot, read as a later step
    # (a decode, a next chunk) would read it
    "conv chunk shorter than its state",
    "conv chunk at least as long as its state",
    "prefill from a prefix-cached state",
    "prefill from a fresh state",
    "a second sequence reusing the prefix",
    "the own slot's conv state after the step",
    # weight reloads (reload_weights: a trainer's update) under a graph captured before them,
    # and post-load processing that derives more than one tensor from the parameters
    "weights reloaded with the same values",
    "weights reloaded with new values",
    "several derived tensors",
    "a derived tensor converted to another dtype",
    # a CPU tier of the KV cache (kv_offload.py): its stores issued in the step that writes
    # the blocks or at the next step's start, of one block or several, and a new request's
    # prefix loaded from it
    "store issued in the step of its KV writes",
    "store issued a step after its KV writes",
    "one block stored",
    "several blocks stored",
    "prefix hit in the CPU tier",
    # structured outputs (structured_output.py): guided requests (a grammar's bitmask) and free
    # ones in one batch, a guided request in a row after a free one, every row guided, and the
    # scheduler's guided requests in an order unlike the batch's rows
    "guided and free rows in one batch",
    "guided rows after free rows",
    "every row guided",
    "the scheduler's order unlike the batch's",
    "one guided row",
    "three guided rows",
    "a request guided, then free in the same mask",
    # a drafter's lookahead slots (lookahead.py): a request's sequence ending at a block
    # boundary and just before one, a new request with a prefix hit, and a running request
    # whose blocks came from the prefix cache (a shared prefix); a sequence whose query block
    # would end at max_model_len, beside a running request
    "sequence ends at a block boundary",
    "sequence ends just before a block boundary",
    "new request with a prefix hit",
    "running request on prefix-cache blocks",
    "a request joining in a replayed graph step",
    "blocks reused without prefix caching",
    "sequence at max_model_len - k beside a running request",
)


@dataclass(frozen=True, slots=True)
class Axes:
    """The configurations a scenario runs, on the axes that can matter to its bug (empty: the
    axis does not apply). `repro info` shows them; values outside the vocabularies above are
    refused when the record is built."""

    graph_modes: tuple[str, ...] = ()
    capture_sizes: tuple[int, ...] = ()  # the graph sizes replayed
    steps_per_size: int = 0  # the most steps, of different lengths, replayed at one size
    sleep_levels: tuple[int, ...] = ()
    wakes: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()
    states: tuple[str, ...] = ()  # the kinds of runner state walked (STATES)

    def __post_init__(self) -> None:
        vocabularies = (
            ("graph_modes", GRAPH_MODES),
            ("sleep_levels", (1, 2)),
            ("wakes", WAKES),
            ("adapters", ADAPTER_STATES),
            ("states", STATES),
        )
        for name, vocabulary in vocabularies:
            unknown = set(getattr(self, name)) - set(vocabulary)
            if unknown:
                raise ValueError(f"axis {name}: unknown {sorted(unknown)}; known: {vocabulary}")

    def lines(self) -> list[str]:
        """One `axis: values` line per axis set."""
        shown = {
            "graph modes": ", ".join(self.graph_modes),
            "capture sizes": ", ".join(map(str, self.capture_sizes)),
            "steps per size": str(self.steps_per_size) if self.steps_per_size else "",
            "sleep levels": ", ".join(map(str, self.sleep_levels)),
            "wake": ", ".join(self.wakes),
            "adapters": ", ".join(self.adapters),
            "states": ", ".join(self.states),
        }
        return [f"{axis}: {values}" for axis, values in shown.items() if values]


@dataclass(frozen=True, slots=True)
class Scenario:
    """Function `name` of the bug's scenarios module: (Context) -> one-line summary, raising
    WrongResult on a divergence."""

    name: str
    expects: tuple[Expect, ...]
    timeout_s: float = 120.0
    axes: Axes = Axes()
    # the failure's signature (Defects4J's trigger cause): a regular expression the evidence of
    # the documented failure matches (the tensor that differs, the message); a run of the
    # right class without it failed for another reason (empty: the class alone). cpu_signature
    # holds on the CPU only: the frame the interpreter faults in, which a GPU's asynchronous
    # fault report does not name
    signature: str = ""
    cpu_signature: str = ""
    # the processes it runs as (harness.ranks): 1, the scenario child itself; N > 1, N spawned
    # rank processes over torch.distributed, the child their coordinator (one run, one outcome)
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"scenario {self.name}: ranks must be at least 1, got {self.ranks}")

    def expected(self, fixes: Variant, device: str) -> Outcome:
        for rule in self.expects:
            if rule.missing - fixes:
                return rule.outcome.on(device)
        return Outcome.PASS

    def signed(self, evidence: str, device: str) -> bool:
        """The evidence shows this scenario's documented failure (its signatures)."""
        both = not self.signature or re.search(self.signature, evidence) is not None
        cpu = device != "cpu" or not self.cpu_signature
        return both and (cpu or re.search(self.cpu_signature, evidence) is not None)

    def documented(self, device: str) -> frozenset[Outcome]:
        """The failure classes this scenario's record names on `device` (for --symptom)."""
        return frozenset(r.outcome.on(device) for r in self.expects) - {Outcome.PASS}


@dataclass(frozen=True, slots=True)
class Fold:
    """A fold rule (repro/fold.py): in `files`, the `names` carry `part`'s switch (a Triton
    constexpr, a launcher's keyword, a field of a kernel's switches), so the checkout removes
    each parameter, field and keyword so named and folds every other use to the part's value.
    Only where the `Fix.PART in fixes` pattern does not reach."""

    part: Fix
    names: tuple[str, ...]
    files: tuple[str, ...]


FIDELITY_GRADES = ("faithful", "simplified", "inspired", "inferred")


@dataclass(frozen=True, slots=True)
class Fidelity:
    """How closely a record models upstream (DESIGN.md section 15), graded by what was read:
    `faithful` (the headline PR's mechanism as upstream describes it), `simplified` (`what`
    says how), `inspired` (`what` says from what), `inferred` (no upstream report of this
    hazard: `what` is the project's reasoning). A symptom upstream never reported is named in
    `what` as inferred, whatever the grade."""

    grade: str
    evidence: str  # what was read: PR text, diff, test, issue (numbers)
    not_verified: str  # what could not be checked
    what: str = ""

    def __post_init__(self) -> None:
        if self.grade not in FIDELITY_GRADES:
            raise ValueError(f"fidelity {self.grade!r}: one of {', '.join(FIDELITY_GRADES)}")
        if self.grade != "faithful" and not self.what:
            raise ValueError(f"a {self.grade} record says what is {self.grade}")


@dataclass(frozen=True, slots=True)
class BugRecord:
    id: str  # also the pytest marker; never reused
    title: str
    upstream: str  # PR link
    symptom: str
    root_cause: str
    trigger: str
    fix_parts: tuple[Fix, ...]
    buggy_outcome: ByDevice  # the headline failure upstream users saw
    scenarios: tuple[Scenario, ...]
    package: str  # the record's package; its scenario functions are in PACKAGE.scenarios
    # where each fix part sits upstream (file and function, in words: no upstream code here)
    anchors: tuple[tuple[Fix, str], ...] = ()
    history: str = ""  # the bug's relatives and follow-ups upstream
    # switches that travel as names (constexprs, launcher keywords): `repro checkout` folds them
    folds: tuple[Fold, ...] = ()
    fidelity: Fidelity | None = None  # how true to upstream it is (every registered record has one)
    # the fuzzer (repro fuzz drives the runner): "" when it finds the bug (one of .ci/fuzz-targets'
    # BUGS); else why not, FUZZ_REASONS' kind first: "kernel level: ..." (no runner path reaches
    # the fault) or "not drawn yet: ..." (a runner path does; the programs lack its operation)
    fuzz: str = ""

    @property
    def buggy_variant(self) -> Variant:
        return ALL_FIXES - frozenset(self.fix_parts)

    def scenario(self, name: str) -> Scenario:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise KeyError(name)

    def usual_s(self, scenario: str, device: str) -> float | None:
        """The scenario's usual seconds on `device` (a whole child, as `repro check` runs it on
        the machine its record names), or None when not recorded."""
        return _usual(self.package).get(device, {}).get(scenario)

    def hang_shown(self, scenario: Scenario, device: str, limit_s: float) -> bool:
        """Whether a timeout at `limit_s` shows the code under test hanging: the record
        documents a timeout, or the limit is the record's own or HANG_FACTOR times the usual
        seconds. Else the limit was too tight to tell."""
        if Outcome.TIMEOUT in scenario.documented(device):
            return True
        usual = self.usual_s(scenario.name, device)
        enough = (
            scenario.timeout_s if usual is None else min(scenario.timeout_s, HANG_FACTOR * usual)
        )
        return limit_s >= enough

    def tight(self, scenario: Scenario, device: str, limit_s: float) -> str | None:
        """Why a timeout at `limit_s` could not count (one phrase), or None when it would."""
        if self.hang_shown(scenario, device, limit_s):
            return None
        usual = self.usual_s(scenario.name, device)
        if usual is None:
            return f"its usual time on {device} is not recorded"
        return f"usually {usual:.1f}s on {device}"

    def target(self, scenario: Scenario) -> str:
        """Importable name of the scenario function, for the child."""
        return f"{self.package}.scenarios:{scenario.name}"

    def docs(self) -> dict[str, str]:
        """Scenario docstrings, read from the source without importing it (no torch)."""
        path = Path(sys.modules[self.package].__file__).with_name("scenarios.py")
        try:
            tree = ast.parse(path.read_text(), str(path))
        except (OSError, SyntaxError) as e:
            return {s.name: f"(cannot read {path.name}: {e})" for s in self.scenarios}
        found = {
            node.name: (ast.get_docstring(node) or "").strip()
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
        }
        return {s.name: found.get(s.name, "(no such function)") for s in self.scenarios}


# A timeout is the code under test hanging only at a limit of at least this many times the
# scenario's usual seconds (or at the record's own limit); under it, the limit was too tight to
# tell: cannot test. The usual seconds ship with the record (USUAL_FILE in its package, per
# device: `repro bench --usual --write` measures them).
HANG_FACTOR = 5.0
USUAL_FILE = "usual.json"


@functools.cache
def _usual(package: str) -> dict:
    path = Path(sys.modules[package].__file__).with_name(USUAL_FILE)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


MUTANT_KINDS = ("boundary", "partial", "wrong_row", "ordering", "unused_state")  # + external


@dataclass(frozen=True, slots=True)
class Mutant:
    """A small plausible regression of the fixed code at or next to a fix site: one textual
    edit (`old` occurs exactly once in `file`, relative to the tree's root)."""

    name: str
    part: Fix | None  # the fix part it breaks (None: a regression of your own, --catalogue)
    kind: str  # one of MUTANT_KINDS
    file: str
    old: str
    new: str
    why: str  # one line: the regression it stands for
    devices: tuple[str, ...] = ("cpu", "cuda")  # where its code runs (csrc: cuda only)
    equivalent: str = ""  # why it changes nothing observable (then it is not scored)
