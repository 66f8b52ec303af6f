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


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]
COPIES = pytest.mark.parametrize("copy", [_upload, _download], ids=["upload", "download"])


@pytest.mark.parametrize("device", DEVICES)
@COPIES
def test_delayed_copy_loses_to_the_next_write(device, copy) -> None:
    assert copy(device, delay=True, wait_first=False) == [NEW] * 3


@pytest.mark.parametrize("device", DEVICES)
@COPIES
def test_event_waited_first_copies_the_old_bytes(device, copy) -> None:
    assert copy(device, delay=True, wait_first=True) == [OLD] * 3


@COPIES
def test_cpu_without_the_delay_a_copy_runs_at_once(copy) -> None:
    """The winning order: nothing is deferred. (On a GPU it is the real race: either order.)"""
    assert copy("cpu", delay=False, wait_first=False) == [OLD] * 3


@pytest.mark.parametrize("device", DEVICES)
def test_main_stream_work_waits_for_the_delayed_copy(device) -> None:
    assert _main_after_upload(device) == [OLD] * 3


@pytest.mark.parametrize("device", DEVICES)
def test_queued_copy_does_not_keep_its_source_alive(device) -> None:
    """A deferred copy is bound to an alias of its source's storage, not to the tensor: the
    tensor dies (an allocator may hand its memory out) while the copy is still queued."""
    streams = Streams(device, delay=True)
    src = torch.full((3,), OLD, device=device)
    dst = streams.pinned(torch.zeros(3, dtype=torch.int64))
    died = []
    weakref.finalize(src, died.append, True)
    copied = streams.d2h(dst, src)
    del src
    assert died and not copied.query()
    copied.synchronize()
    assert dst.tolist() == [OLD] * 3


@pytest.mark.gpu
def test_gpu_a_host_sync_does_not_run_the_delayed_copy() -> None:
    """The delay is the host's: a device-wide sync (as CUDA's lazy module loading makes, or a
    synchronous copy) neither runs the queued copy nor lets it overtake the host's next write.
    A spin kernel on the copy stream fails here: the sync waits for it to run out."""
    streams = Streams("cuda", delay=True)
    src = streams.pinned(torch.full((3,), OLD))
    dst = torch.zeros(3, dtype=src.dtype, device="cuda")
    copied = streams.h2d(dst, src)
    torch.cuda.synchronize()
    assert not copied.query() and dst.tolist() == [0] * 3
    src.fill_(NEW)
    copied.synchronize()
    assert dst.tolist() == [NEW] * 3
