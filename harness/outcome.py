"""Outcome classes, and the classifier of a finished child (report, exit status, signal, stderr).

A scenario child writes a JSON report as its last act: status "pass", "wrong_result" (an oracle
found a divergence), "skipped", "exception" (type, message, origin; see harness.child), or
"ranks" (the coordinator of a scenario's ranks classified them already: outcome, detail; see
harness.ranks). A
child that dies first leaves no report; then the exit status, the signal and the stderr text
decide. The verdict of `repro check` (git bisect run's exit codes) is computed here too.
"""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass


class Outcome(enum.Enum):
    PASS = "pass"
    WRONG_RESULT = "wrong_result"
    DEVICE_ASSERT = "device_assert"
    ILLEGAL_ADDRESS = "illegal_address"
    CRASH = "crash"
    TIMEOUT = "timeout"
    SANITIZER_ERROR = "sanitizer_error"
    # ranks that disagree on their collectives (harness.ranks): one waits in a collective
    # another issued differently, or will never issue
    COLLECTIVE_MISMATCH = "collective_mismatch"
    EXCEPTION = "exception"  # a Python exception raised by the code under test
    ERROR = "error"  # the harness or the scenario broke, or the project does not import
    SKIPPED = "skipped"  # cannot run here (no GPU, no compiler), or interrupted

    @property
    def is_failure(self) -> bool:
        """The scenario ran and the code under test failed (the bug, or a crash/hang of it)."""
        return self not in (Outcome.PASS, Outcome.ERROR, Outcome.SKIPPED)


@dataclass(frozen=True, slots=True)
class ByDevice:
    """An expected outcome per device."""

    cpu: Outcome
    cuda: Outcome

    @classmethod
    def both(cls, outcome: Outcome) -> ByDevice:
        return cls(outcome, outcome)

    def on(self, device: str) -> Outcome:
        return self.cuda if device == "cuda" else self.cpu


class WrongResult(AssertionError):
    """Raised by an oracle: the output diverged from the reference (message = evidence)."""


# "off": oracles print divergences instead of raising them, so that only another detector can
# fail the run (repro detectors). Set per job only: children never inherit it from the caller.
ENV_ORACLE = "REPRO_ORACLE"


class Skip(Exception):
    """Raised by a scenario that cannot run here (message = why)."""


@dataclass(frozen=True, slots=True)
class ChildExit:
    """Everything the parent knows about a finished child."""

    returncode: int | None  # None: killed by the parent at its time limit
    timed_out: bool
    report: dict | None
    stderr: str
    sanitizer: bool = False


@dataclass(frozen=True, slots=True)
class Classified:
    outcome: Outcome
    evidence: str


# Patterns over exception messages and stderr, first match wins.
# NOTE: every torch CUDA error ends "Compile with TORCH_USE_CUDA_DSA to enable device-side
# assertions", so match the assert itself, not the phrase. Where a CUDA kernel of torch asserts
# on a bad index (embedding, index_select), its CPU kernel raises "index out of range in self":
# the CPU analogue of the same device-side assert.
_DEVICE_ASSERT = re.compile(
    r"device-side assert triggered|Assertion `.*` failed|CUDA_ERROR_ASSERT|"
    r"IndexError: index out of range in self"
)
# cudaErrorInvalidAddressSpace (717): a load or store through an address in no memory space a
# thread may use (a wild pointer beyond the global window): on an H100 some runs of one scenario
# that reads a poisoned plan fault with it instead of cudaErrorIllegalAddress.
_ILLEGAL_ADDRESS = re.compile(
    r"illegal memory access|CUDA_ERROR_ILLEGAL_ADDRESS|misaligned address|"
    r"unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED|"
    r"operation not supported on global/shared address space|CUDA_ERROR_INVALID_ADDRESS_SPACE"
)
# memcheck, initcheck, synccheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N
# hazards displayed (E errors, W warnings)" (warnings alone are not errors)
_SANITIZER_ERRORS = re.compile(
    r"=+ (?:ERROR SUMMARY: ([1-9]\d*) error|RACECHECK SUMMARY: .*?\(([1-9]\d*) error)"
)
_HOST_FAULTS = {signal.SIGSEGV, signal.SIGBUS}
# A device assert prints its line (the device's printf, on the child's stdout), then traps. The
# trap is read back as cudaErrorAssert, or on a shared GPU at times as the generic
# cudaErrorLaunchFailure (H100, 2 of 800 asserting runs at 16 children at once, during a GPU-wide
# stall): the printed line decides.
_DEVICE_ASSERT_PRINTED = re.compile(
    r"^.*block: \[\d+,\d+,\d+\], thread: \[\d+,\d+,\d+\] Assertion `.*$", re.MULTILINE
)


def _gpu_error(text: str) -> Outcome | None:
    if _DEVICE_ASSERT.search(text):
        return Outcome.DEVICE_ASSERT
    if _ILLEGAL_ADDRESS.search(text):
        return Outcome.ILLEGAL_ADDRESS
    return None


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _fault_report(text: str) -> str:
    """Python's faulthandler verdict, the faulting frame and the innermost frames outside
    installed packages (the kernel or scenario line); else the output's tail."""
    at = text.find("Fatal Python error")
    if at < 0:
        return _tail(text)
    block = text[at:].splitlines()
    frames = [line.strip() for line in block if line.strip().startswith("File ")]
    ours = [f for f in frames if "site-packages" not in f and "<frozen" not in f]
    return "\n".join([block[0], *frames[:1], *ours[:3]])


_NOT_TESTABLE = {
    "import": "the project does not import",
    "build": "a build failed",
    "scenario": "the scenario or the harness broke",
}


# the coordinator of ranks writes each rank's stacks under this header (harness.ranks)
_RANK_STACKS = re.compile(r"^=== rank (\d+) stacks ===$", re.MULTILINE)


def _stacks(text: str, frames: int = 4) -> str:
    """The innermost frames of the last stack dump in `text` (faulthandler prints most recent
    call first): where a hung child was, each rank's where it ran ranks; else the output's
    tail."""
    sections = list(_RANK_STACKS.finditer(text))
    if sections:
        ends = [m.start() for m in sections[1:]] + [len(text)]
        return "\n".join(
            f"rank {m.group(1)}:\n  "
            + _first_stack(text[m.end() : end], frames).replace("\n", "\n  ")
            for m, end in zip(sections, ends, strict=True)
        )
    at = text.rfind("(most recent call first):")
    if at < 0:
        return _tail(text)
    lines = [line.strip() for line in text[at:].splitlines()[1:] if line.strip()]
    return "\n".join(lines[:frames])


def _first_stack(text: str, frames: int) -> str:
    at = text.find("(most recent call first):")
    if at < 0:
        return "(no stack dumped)"
    lines = [line.strip() for line in text[at:].splitlines()[1:] if line.strip()]
    return "\n".join(lines[:frames])


def _from_report(report: dict) -> Classified:
    status = report.get("status")
    if status == "ranks":
        try:
            outcome = Outcome(report.get("outcome"))
        except ValueError:
            return Classified(Outcome.ERROR, f"ranks: unknown outcome {report.get('outcome')!r}")
        return Classified(outcome, report.get("detail", ""))
    if status == "pass":
        return Classified(Outcome.PASS, report.get("detail", ""))
    if status == "wrong_result":
        return Classified(Outcome.WRONG_RESULT, report.get("detail", ""))
    if status == "skipped":
        return Classified(Outcome.SKIPPED, report.get("detail", ""))
    message = f"{report.get('type', '?')}: {report.get('message', '')}"
    if report.get("where"):
        message += f"\nraised at {report['where']}"
    gpu = _gpu_error(message)
    if gpu is not None:
        return Classified(gpu, message)
    origin = report.get("origin", "scenario")
    if origin == "code":
        return Classified(Outcome.EXCEPTION, message)
    return Classified(Outcome.ERROR, f"{_NOT_TESTABLE.get(origin, origin)}: {message}")


def _from_exit(code: int, stderr: str) -> Classified:
    if code < 0:
        sig = signal.Signals(-code)
        if sig == signal.SIGALRM:  # harness.lifetime: the child's own time limit
            return Classified(Outcome.TIMEOUT, f"killed by its own time limit\n{_tail(stderr)}")
        if sig in _HOST_FAULTS:
            return Classified(
                Outcome.ILLEGAL_ADDRESS,
                f"killed by {sig.name} (host memory fault)\n{_fault_report(stderr)}",
            )
        gpu = _gpu_error(stderr) if sig == signal.SIGABRT else None
        if gpu is not None:  # a device error thrown where C++ cannot pass it on: terminate
            line = next((ln for ln in stderr.splitlines() if _gpu_error(ln) is not None), "")
            return Classified(gpu, f"killed by SIGABRT after the device's error: {line.strip()}\n"
                              f"{_fault_report(stderr)}")  # fmt: skip
        return Classified(Outcome.CRASH, f"killed by {sig.name}\n{_fault_report(stderr)}")
    gpu = _gpu_error(stderr)
    if gpu is not None:
        return Classified(gpu, f"exit {code} without report\n{_tail(stderr)}")
    return Classified(Outcome.ERROR, f"exit {code} without report\n{_tail(stderr)}")


def classify(child: ChildExit) -> Classified:
    """One outcome for any way a child can end."""
    if child.timed_out:
        return Classified(
            Outcome.TIMEOUT, f"no exit within the time limit\n{_stacks(child.stderr)}"
        )
    errors = _SANITIZER_ERRORS.search(child.stderr) if child.sanitizer else None
    if errors:
        return Classified(
            Outcome.SANITIZER_ERROR,
            f"compute-sanitizer: {errors.group(1) or errors.group(2)} errors\n"
            f"{_tail(child.stderr, 12)}",
        )
    clean_exit = child.returncode == 0
    if child.report is not None and (clean_exit or child.report.get("status") != "pass"):
        found = _from_report(child.report)
        printed = _DEVICE_ASSERT_PRINTED.search(child.stderr)
        if found.outcome == Outcome.ILLEGAL_ADDRESS and printed:
            return Classified(
                Outcome.DEVICE_ASSERT,
                f"{found.evidence}\nthe device printed an assertion first:\n{printed.group(0)}",
            )
        return found
    assert child.returncode is not None
    if clean_exit:
        return Classified(Outcome.ERROR, f"exit 0 without report\n{_tail(child.stderr)}")
    return _from_exit(child.returncode, child.stderr)


# git bisect run: 0 good, 1 bad, 125 skip (cannot test), 2 usage error; never >= 128.
EXIT_ABSENT, EXIT_PRESENT, EXIT_USAGE, EXIT_CANNOT_TEST = 0, 1, 2, 125
EXIT_INTERRUPTED = 130  # matrix only; run and check say 125


def exit_code(outcomes: Iterable[Outcome], counted: Iterable[bool] | None = None) -> int:
    """1 if a counted scenario failed; else 125 if any failed, errored or was skipped (or none
    ran); else 0. `counted[i]` (default: all) says whether scenario i's failure shows the bug:
    confirmed by a second run, and under --symptom of a documented class."""
    outcomes = list(outcomes)
    counted = [True] * len(outcomes) if counted is None else list(counted)
    if any(o.is_failure and c for o, c in zip(outcomes, counted, strict=True)):
        return EXIT_PRESENT
    if not outcomes or any(o != Outcome.PASS for o in outcomes):
        return EXIT_CANNOT_TEST
    return EXIT_ABSENT
