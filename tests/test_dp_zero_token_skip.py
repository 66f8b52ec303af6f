"""dp_zero_token_skip (vLLM #28774): a DP rank with zero tokens must join the step's
token-count all-reduce. The scenario runs as two rank processes (harness/ranks.py); the
buggy runner's ranks disagree on their collectives, which the trace oracle names in seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests import procs

pytestmark = [pytest.mark.dp_zero_token_skip, pytest.mark.distributed, pytest.mark.cpu_job]


def _ranks_of(tag: str) -> list[int]:
    """The run's rank processes: children of a scenario child (the coordinator) of a fork
    server, forked or spawned."""
    tagged = procs.tagged(tag)
    servers = {p for p in tagged if "harness.forkserver" in procs.cmdline(p)}
    coordinators = {p for p in tagged if procs.parent_of(p) in servers}
    return [p for p in tagged if procs.parent_of(p) in coordinators]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_a_run_of_ranks_killed_from_outside_leaves_no_rank(how) -> None:
    tag = procs.new_tag()
    env = {**os.environ, procs.TAG: tag}
    argv = ("run", "dp_zero_token_skip", "--variant", "fixed", "--device", "cpu")
    proc = subprocess.Popen(procs.repro_command(*argv), env=env, stdout=subprocess.PIPE, text=True)
    ranks = procs.wait_until(lambda: len(_ranks_of(tag)) == 2 and _ranks_of(tag), 90)
    assert ranks, "no rank process appeared"
    time.sleep(0.5)  # the ranks are importing or joining their group
    proc.send_signal(getattr(signal, how))
    proc.communicate(timeout=60)
    assert procs.survivors(tag) == [], f"left alive after {how}"
