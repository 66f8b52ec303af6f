"""Pytest wiring: device selection, one marker per registered bug, one GPU per xdist worker.

Order matters: the worker's CUDA_VISIBLE_DEVICES and the Triton interpreter switch are set in
pytest_configure, before any test module imports torch's CUDA state or a kernel module.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from hypothesis import settings

from harness import device as devices
from harness.outcome import ENV_ORACLE
from harness.servers import ENV_SERVER

DEVICE_KEY = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        choices=devices.CHOICES,
        default=None,
        help="cpu (Triton interpreter), cuda, or auto (default: $REPRO_DEVICE, "
        "else auto = cuda when available)",
    )
    parser.addoption(
        "--upstream-sample",
        type=int,
        default=1,
        metavar="N",
        help="run one in N of upstream's GPU parametrizations (tests/test_upstream_*.py), "
        "every N-th of each test in collection order; default 1: all of them (the nightly "
        "job), .ci/gpu's per-push run takes a sample",
    )
    parser.addoption(
        "--leave-to-matrix",
        action="store_true",
        help="deselect the scenario verdict tests whose cell `repro matrix --each-part` runs "
        "(fixed, buggy, each part's removal: the same class and signature, checked there); "
        "the others (a relative's parts removed) still run. .ci/gpu, whose matrix step runs "
        "every cell twice",
    )


def pytest_configure(config: pytest.Config) -> None:
    # A developer's warm server (repro serve) must not serve the tests: they start their own.
    os.environ[ENV_SERVER] = "off"
    os.environ.pop(ENV_ORACLE, None)  # oracles always raise in tests (repro detectors sets it)
    # A shell without job control starts `cmd &` with SIGINT ignored, and an ignored signal stays
    # ignored across exec: the interrupt tests' children would never see the SIGINT they are sent.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    devices.pin_xdist_worker(os.environ.get("PYTEST_XDIST_WORKER"))
    device = devices.resolve(config.getoption("--device"))
    if device == "cuda" and not devices.cuda_available():
        raise pytest.UsageError("--device cuda: no CUDA device is available here")
    devices.activate(device)
    config.stash[DEVICE_KEY] = device
    if device == "cuda" and getattr(config.option, "maxschedchunk", 0) is None:
        # xdist's load scheduling sends each worker a quarter of its share at first, in
        # collection order; at most two tests waiting on a worker instead, so that the
        # slowest, which go first (_slowest_first), land on different workers
        config.option.maxschedchunk = 1
    # Property sweeps: few derandomized examples through the CPU interpreter, more on a GPU.
    examples = {"cpu": 8, "cuda": 150}[device]
    settings.register_profile(
        "repro", max_examples=examples, deadline=None, derandomize=True, database=None
    )
    settings.load_profile("repro")
    from repro.registry import BUGS

    for bug in BUGS:
        config.addinivalue_line("markers", f"{bug.id}: regression tests of {bug.upstream}")


def pytest_report_header(config: pytest.Config) -> str:
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    return f"repro device: {config.stash[DEVICE_KEY]} (CUDA_VISIBLE_DEVICES={gpu})"


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    _sample_upstream(config, items)
    _leave_to_matrix(config, items)
    if config.stash[DEVICE_KEY] == "cuda":
        cpu_job = pytest.mark.skip(reason="drives --device cpu only: the CPU job runs it")
        for item in items:  # a cpu_job module's tests that take the device run on both
            if "cpu_job" in item.keywords and "device" not in getattr(item, "fixturenames", ()):
                item.add_marker(cpu_job)
    else:
        skip = pytest.mark.skip(reason="needs a CUDA GPU; this run's device is cpu")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    result = yield  # every other plugin's: pytest-split keeps this part's tests
    _slowest_first(config, items)
    return result


SLOW_S = 2.0


def _slowest_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An xdist worker on a GPU: the tests that took SLOW_S or more in the GPU job's last run
    (the durations file pytest-split reads, .test_durations) run first, the longest first; the
    others keep their order. In collection order the longest (upstream's split-KV cases, 50-58 s
    on an H200) come near the end: .ci/gpu's part 2 took 218 s for 141 s of tests a worker (12
    workers, 2026-11-29). Every worker orders alike, as xdist requires: the same file, a stable
    sort."""
    if config.stash[DEVICE_KEY] != "cuda" or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    path = Path(
        getattr(config.option, "durations_path", None) or config.rootpath / ".test_durations"
    )
    try:
        seconds = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # no durations: collection order
    slow = [item for item in items if seconds.get(item.nodeid, 0) >= SLOW_S]
    slow.sort(key=lambda item: -seconds[item.nodeid])
    first = {item.nodeid for item in slow}
    items[:] = slow + [item for item in items if item.nodeid not in first]


def _sample_upstream(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--upstream-sample N: keep every N-th GPU case of each upstream test function (the first
    included), deselect the others; the project's own tests always run."""
    every = config.getoption("--upstream-sample")
    if every < 1:
        raise pytest.UsageError(f"--upstream-sample {every}: must be 1 or more")
    if every == 1:
        return
    seen: dict[str, int] = {}
    keep, drop = [], []
    for item in items:
        upstream = item.path.name.startswith("test_upstream_") and "gpu" in item.keywords
        function = item.nodeid.split("[")[0]
        index = seen[function] = seen.get(function, -1) + 1
        (drop if upstream and index % every else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _leave_to_matrix(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--leave-to-matrix: deselect test_scenario_shows_expected_outcome's cells that the
    matrix's --each-part run holds."""
    if not config.getoption("--leave-to-matrix"):
        return
    from repro.matrix import variants

    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        ran = item.originalname == "test_scenario_shows_expected_outcome" and params[
            "fixes"
        ] in variants(params["bug"], each_part=True)
        (drop if ran else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> str:
    """The run's device: 'cpu' (kernels through Triton's interpreter) or 'cuda'."""
    return pytestconfig.stash[DEVICE_KEY]


@pytest.fixture(scope="session")
def isolator(device: str):
    """Children forked from one server per worker, shared by the tests that only run jobs (a
    scenario's verdict, a fuzz program's): a server's start once, not once a test. On a GPU the
    csrc build happens first."""
    from harness.isolate import Isolator

    if device == "cuda":
        from kernels import csrc

        for name in csrc.EXTENSIONS:
            csrc.load(name)
    with Isolator() as iso:
        yield iso
