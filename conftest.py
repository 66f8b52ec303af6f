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
    if config.stash[DEVICE_KEY] == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this run's device is cpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> str:
    """The run's device: 'cpu' (kernels through Triton's interpreter) or 'cuda'."""
    return pytestconfig.stash[DEVICE_KEY]
