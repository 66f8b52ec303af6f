"""Device resolution and GPU pinning of xdist workers (env read without initializing CUDA)."""

from __future__ import annotations

import os

import pytest

from harness import device as devices


@pytest.mark.parametrize(
    ("visible", "worker", "pinned"),
    [
        ("0,1,2,3", "gw0", "0"),
        ("0,1,2,3", "gw5", "1"),
        ("4,6", "gw1", "6"),
        ("GPU-abc,GPU-def", "gw2", "GPU-abc"),
    ],
)
def test_worker_gets_one_gpu_of_the_callers_list(monkeypatch, visible, worker, pinned) -> None:
    monkeypatch.setattr(devices, "_machine_gpus", lambda: [str(i) for i in range(8)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices.pin_xdist_worker(worker) == pinned
    assert os.environ["CUDA_VISIBLE_DEVICES"] == pinned


def test_no_worker_or_no_gpu_leaves_env_alone(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.pin_xdist_worker("gw0") is None
    assert devices.pin_xdist_worker(None) is None
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_resolve(monkeypatch) -> None:
    monkeypatch.delenv(devices.ENV_DEVICE, raising=False)
    assert devices.resolve("cpu") == "cpu"
    assert devices.resolve("auto") == ("cuda" if devices.cuda_available() else "cpu")
    monkeypatch.setenv(devices.ENV_DEVICE, "cpu")
    assert devices.resolve(None) == "cpu"
    with pytest.raises(ValueError, match="device must be one of"):
        devices.resolve("tpu")


def test_run_uses_the_interpreter_exactly_on_cpu(device) -> None:
    assert (os.environ.get("TRITON_INTERPRET") == "1") == (device == "cpu")


def _collect(*args: str):
    import subprocess
    import sys

    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=120)


def _collected(*args: str) -> list[str]:
    done = _collect(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.cpu_job  # it collects with --device cpu: the same on a GPU machine (40 s there)
def test_upstream_sample_keeps_every_nth_gpu_case_of_each_upstream_test() -> None:
    """.ci/gpu's per-push sample: one in N of upstream's GPU cases, per test function, the first
    kept; the CPU cases and the project's own tests untouched; N < 1 refused."""
    path = "tests/test_upstream_align.py"
    every = _collected(path, "--device", "cpu")
    sample = _collected(path, "--device", "cpu", "--upstream-sample", "4")
    gpu = {n for n in every if "cuda" in n or "81920" in n}  # its GPU-marked cases
    by_test: dict[str, list[str]] = {}
    for name in every:
        by_test.setdefault(name.split("[")[0], []).append(name)
    kept = {n for names in by_test.values() for i, n in enumerate(names) if i % 4 == 0}
    assert len(gpu) > 8 and len(sample) < len(every)
    assert set(sample) == (set(every) - gpu) | (kept & gpu)
    refused = _collect(path, "--upstream-sample", "0")
    assert refused.returncode == 4 and "must be 1 or more" in refused.stderr
