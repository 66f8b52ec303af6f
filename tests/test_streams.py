"""The stream model (harness/runner/streams.py): a race's two orders on either device. With the
delay on, the host's write to a copy's pinned source, or the main stream's write to a copy's
device source (a reuse), wins over the copy; an event waited before the write makes the copy
see the old bytes. The CPU tests run everywhere; the same orders on a GPU are `gpu` tests."""

from __future__ import annotations

import weakref

import pytest
import torch

from harness.runner.streams import Streams

# the stream model is the ground both races stand on: part of each one's guard
pytestmark = [pytest.mark.async_pinned_race, pytest.mark.async_output_lifetime]
OLD, NEW = 1, 2


def _upload(device: str, delay: bool, wait_first: bool) -> list[int]:
    """A pinned host tensor uploaded, then rewritten by the host."""
    streams = Streams(device, delay)
    src = streams.pinned(torch.full((3,), OLD))
    dst = torch.zeros(3, dtype=src.dtype, device=device)
    copied = streams.h2d(dst, src)
    if wait_first:
        copied.synchronize()
    src.fill_(NEW)
    copied.synchronize()
    return dst.tolist()


def _download(device: str, delay: bool, wait_first: bool) -> list[int]:
    """A device tensor downloaded, then rewritten on the main stream (its memory reused)."""
    streams = Streams(device, delay)
    src = torch.full((3,), OLD, device=device)
    dst = streams.pinned(torch.zeros(3, dtype=src.dtype))
    copied = streams.d2h(dst, src)
    if wait_first:
        copied.synchronize()
    streams.on_main(None, src.fill_, NEW)
    copied.synchronize()
    return dst.tolist()


def _main_after_upload(device: str) -> list[int]:
    """Main-stream work that waits for a (delayed) upload reads what it uploaded."""
    streams = Streams(device, delay=True)
    src = streams.pinned(torch.full((3,), OLD))
    dst = torch.zeros(3, dtype=src.dtype, device=device)
    out = torch.zeros_like(dst)
    streams.on_main(streams.h2d(dst, src), out.copy_, dst)
    streams.synchronize()
    return out.tolist()


@pytest.mark.parametrize("copy", [_upload, _download], ids=["upload", "download"])
def test_cpu_delayed_copy_loses_to_the_next_write(copy) -> None:
    assert copy("cpu", delay=True, wait_first=False) == [NEW] * 3


@pytest.mark.parametrize("copy", [_upload, _download], ids=["upload", "download"])
def test_cpu_event_waited_first_copies_the_old_bytes(copy) -> None:
    assert copy("cpu", delay=True, wait_first=True) == [OLD] * 3


@pytest.mark.parametrize("copy", [_upload, _download], ids=["upload", "download"])
def test_cpu_without_the_delay_a_copy_runs_at_once(copy) -> None:
    """The winning order: nothing is deferred."""
    assert copy("cpu", delay=False, wait_first=False) == [OLD] * 3


def test_cpu_main_stream_work_waits_for_the_delayed_copy() -> None:
    assert _main_after_upload("cpu") == [OLD] * 3


def test_cpu_queued_copy_does_not_keep_its_source_alive() -> None:
    """A deferred copy is bound to an alias of its source's storage, not to the tensor: the
    tensor dies (an allocator may hand its memory out) while the copy is still queued."""
    streams = Streams("cpu", delay=True)
    src, dst = torch.full((3,), OLD), torch.zeros(3, dtype=torch.int64)
    died = []
    weakref.finalize(src, died.append, True)
    copied = streams.d2h(dst, src)
    del src
    assert died and not copied.query()
    copied.synchronize()
    assert dst.tolist() == [OLD] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("copy", [_upload, _download], ids=["upload", "download"])
def test_gpu_delayed_copy_loses_to_the_next_write(copy) -> None:
    assert copy("cuda", delay=True, wait_first=False) == [NEW] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("copy", [_upload, _download], ids=["upload", "download"])
def test_gpu_event_waited_first_copies_the_old_bytes(copy) -> None:
    assert copy("cuda", delay=True, wait_first=True) == [OLD] * 3


@pytest.mark.gpu
def test_gpu_main_stream_work_waits_for_the_delayed_copy() -> None:
    assert _main_after_upload("cuda") == [OLD] * 3
