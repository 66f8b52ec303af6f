"""The classifier on synthetic child exits, and the bisect exit-code mapping."""

from __future__ import annotations

import signal

import pytest

from harness.outcome import ChildExit, Outcome, classify, exit_code

# torch 2.11's text for an illegal address: it also mentions device-side assertions.
TORCH_IMA = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


TERMINATE_ILLEGAL = (
    "terminate called after throwing an instance of 'c10::AcceleratorError'\n"
    "  what():  CUDA error: an illegal memory access was encountered\n"
)
LAUNCH_FAILURE = {
    "status": "exception",
    "type": "AcceleratorError",
    "message": "CUDA error: unspecified launch failure",
    "origin": "code",
}
PRINTED_ASSERT = (
    "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1515: indexSelectSmallIndex: block: [0,0,0], "
    "thread: [1,0,0] Assertion `srcIndex < srcSelectDimSize` failed."
)


def exited(code: int | None, report: dict | None = None, stderr: str = "", **kw) -> ChildExit:
    return ChildExit(code, code is None, report, stderr, **kw)


@pytest.mark.parametrize(
    ("child", "outcome"),
    [
        (exited(0, {"status": "pass"}), Outcome.PASS),
        (exited(0, {"status": "wrong_result", "detail": "x"}), Outcome.WRONG_RESULT),
        (exited(0, {"status": "skipped", "detail": "no gpu"}), Outcome.SKIPPED),
        (
            exited(
                0,
                {
                    "status": "exception",
                    "type": "RuntimeError",
                    "message": "CUDA error: device-side assert triggered",
                },
            ),
            Outcome.DEVICE_ASSERT,
        ),
        (
            exited(
                0,
                {
                    "status": "exception",
                    "type": "RuntimeError",
                    "message": "CUDA error: an illegal memory access was encountered",
                },
            ),
            Outcome.ILLEGAL_ADDRESS,
        ),
        (
            exited(
                0,
                {
                    "status": "exception",
                    "type": "RuntimeError",
                    "message": "Triton Error [CUDA]: misaligned address",
                },
            ),
            Outcome.ILLEGAL_ADDRESS,
        ),
        (  # seen on an H100: spec_capture_state's poisoned plan, some runs (cudaError 717)
            exited(
                0,
                {
                    "status": "exception",
                    "type": "AcceleratorError",
                    "message": "CUDA error: operation not supported on global/shared address "
                    "space\nSearch for `cudaErrorInvalidAddressSpace'",
                    "origin": "code",
                },
            ),
            Outcome.ILLEGAL_ADDRESS,
        ),
        (
            exited(0, {"status": "exception", "type": "ValueError", "message": "bad shape"}),
            Outcome.ERROR,
        ),
        (
            exited(0, {"status": "exception", "type": "ValueError", "origin": "code"}),
            Outcome.EXCEPTION,
        ),
        (
            exited(0, {"status": "exception", "type": "SyntaxError", "origin": "import"}),
            Outcome.ERROR,
        ),
        (
            exited(0, {"status": "exception", "type": "BuildError", "origin": "build"}),
            Outcome.ERROR,
        ),
        (
            exited(0, {"status": "exception", "type": "KeyError", "origin": "scenario"}),
            Outcome.ERROR,
        ),
        (
            exited(
                0,
                {
                    "status": "exception",
                    "type": "IndexError",
                    "message": "index out of range in self",
                },
            ),
            Outcome.DEVICE_ASSERT,
        ),
        (
            exited(
                0,
                {"status": "exception", "type": "IndexError", "message": "list index out of range"},
            ),
            Outcome.ERROR,
        ),
        (exited(-signal.SIGSEGV), Outcome.ILLEGAL_ADDRESS),
        (exited(-signal.SIGBUS), Outcome.ILLEGAL_ADDRESS),
        (exited(-signal.SIGABRT), Outcome.CRASH),
        # a CUDA error thrown where C++ cannot pass it on (a destructor): terminate, abort
        (exited(-signal.SIGABRT, None, TERMINATE_ILLEGAL), Outcome.ILLEGAL_ADDRESS),
        (exited(-signal.SIGKILL, None, TERMINATE_ILLEGAL), Outcome.CRASH),
        (exited(-signal.SIGKILL), Outcome.CRASH),
        (exited(-signal.SIGALRM), Outcome.TIMEOUT),  # the child's own time limit
        (exited(None), Outcome.TIMEOUT),
        (exited(1, None, "Traceback...\nImportError: no module"), Outcome.ERROR),
        (exited(1, None, "/k.cu:12: Assertion `idx < n` failed."), Outcome.DEVICE_ASSERT),
        # an assert's trap read back as the generic launch failure: the printed line decides
        (exited(0, LAUNCH_FAILURE, PRINTED_ASSERT), Outcome.DEVICE_ASSERT),
        (exited(0, LAUNCH_FAILURE, "warning: something else"), Outcome.ILLEGAL_ADDRESS),
        (exited(0, None), Outcome.ERROR),
        # a report of pass is not trusted when the process then died
        (exited(-signal.SIGABRT, {"status": "pass"}), Outcome.CRASH),
        (
            exited(99, {"status": "pass"}, "========= ERROR SUMMARY: 3 errors", sanitizer=True),
            Outcome.SANITIZER_ERROR,
        ),
        (
            exited(0, {"status": "pass"}, "========= ERROR SUMMARY: 0 errors", sanitizer=True),
            Outcome.PASS,
        ),
        (
            exited(
                99,
                {"status": "pass"},
                "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)",
                sanitizer=True,
            ),
            Outcome.SANITIZER_ERROR,
        ),
        (
            exited(
                0,
                {"status": "pass"},
                "========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warnings)",
                sanitizer=True,
            ),
            Outcome.PASS,
        ),
    ],
)
def test_classify(child: ChildExit, outcome: Outcome) -> None:
    assert classify(child).outcome == outcome


def test_a_printed_assert_names_its_line_in_the_evidence() -> None:
    evidence = classify(exited(0, LAUNCH_FAILURE, f"x\n{PRINTED_ASSERT}\ny")).evidence
    assert evidence.startswith("AcceleratorError: CUDA error: unspecified launch failure")
    assert evidence.endswith(PRINTED_ASSERT)


@pytest.mark.parametrize(
    ("outcomes", "code"),
    [
        ([Outcome.PASS, Outcome.PASS], 0),
        ([Outcome.PASS, Outcome.WRONG_RESULT], 1),
        ([Outcome.ERROR, Outcome.ILLEGAL_ADDRESS], 1),
        ([Outcome.TIMEOUT], 1),
        ([Outcome.PASS, Outcome.ERROR], 125),
        ([Outcome.SKIPPED], 125),
        ([], 125),
    ],
)
def test_exit_code_for_bisect(outcomes: list[Outcome], code: int) -> None:
    assert exit_code(outcomes) == code
    assert 0 <= code < 128


@pytest.mark.parametrize(
    ("outcomes", "counted", "code"),
    [
        ([Outcome.EXCEPTION], [True], 1),
        ([Outcome.CRASH], [False], 125),  # flaky, or not the documented symptom
        ([Outcome.CRASH, Outcome.WRONG_RESULT], [False, True], 1),
        ([Outcome.ERROR, Outcome.WRONG_RESULT], [True, True], 1),
        ([Outcome.PASS, Outcome.PASS], [False, False], 0),
    ],
)
def test_only_counted_failures_are_present(outcomes, counted, code) -> None:
    assert exit_code(outcomes, counted) == code


def test_exception_messages_say_where_and_why() -> None:
    report = {
        "status": "exception",
        "type": "ValueError",
        "message": "LoRA id 0 is not active",
        "origin": "code",
        "where": "harness/runner/lora.py:38 in slot",
    }
    evidence = classify(exited(0, report)).evidence
    assert evidence == (
        "ValueError: LoRA id 0 is not active\nraised at harness/runner/lora.py:38 in slot"
    )
    report.update(origin="import", type="SyntaxError")
    assert classify(exited(0, report)).evidence.startswith("the project does not import:")
