"""Pytest wiring: device selection, one marker per registered bug, one GPU per xdist worker.

Order matters: the worker's CUDA_VISIBLE_DEVICES and the Triton interpreter switch are set in
pytest_configure, before any test module imports torch's CUDA state or a kernel module.
"""

from __future__ import annotations

import os
import signal

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _sample_upstream(config, items)
    _leave_to_matrix(config, items)
    if config.stash[DEVICE_KEY] == "cuda":
        cpu_job = pytest.mark.skip(reason="drives --device cpu only: the CPU job runs it")
        for item in items:  # a cpu_job module's tests that take the device run on both
            if "cpu_job" in item.keywords and "device" not in getattr(item, "fixturenames", ()):
                item.add_marker(cpu_job)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this run's device is cpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
