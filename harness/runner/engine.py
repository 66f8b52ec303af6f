"""The engine core around a worker: the scheduler's pause, the requests waiting for it, and one
iteration of the busy loop (upstream: EngineCore, and DPEngineCoreProc for data parallelism).

sleep(level) pauses scheduling, then puts the worker to sleep (level 0: the pause only);
wake_up(tags) wakes the worker's tags and resumes scheduling. An idle rank of a data-parallel
group runs a dummy batch on every iteration while the engines run (its peers serve, or a pause
needs the ranks' consensus), to stay in step with its peers' collectives. The fix part of
vLLM #44483 lives here: no resume, and no forward, dummy included, while a tag still sleeps.
DataParallelEngine is one rank's loop among real ranks (harness.ranks): the ranks agree each
iteration whether any has unfinished requests, then each runs its scheduled step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.fixes import Fix
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelOutput, ModelRunner
from harness.runner.worker import Worker


@dataclass(frozen=True, slots=True)
class EngineStep:
    """What one iteration ran: the scheduled requests' step, or a dummy batch (no requests)."""

    requests: list[Request]
    output: ModelOutput


class EngineCore:
    def __init__(self, worker: Worker, idle_dp_rank: bool = False) -> None:
        """`idle_dp_rank`: a rank of a data-parallel group whose peers serve requests."""
        self.worker, self.fixes = worker, worker.fixes
        self.idle_dp_rank = idle_dp_rank
        self.paused = False  # the scheduler's pause: no request is scheduled
        self.waiting: list[tuple[int, ...]] = []

    def add_request(self, token_ids: Sequence[int]) -> None:
        self.waiting.append(tuple(token_ids))

    def sleep(self, level: int = 1) -> None:
        self.paused = True
        if self.idle_dp_rank:
            # NOTE: a data-parallel pause completes by the ranks' consensus (an all-reduce in
            # the loop): the pause kicks the idle ranks into one more iteration
            self._iterate(consensus=True)
        if level:
            self.worker.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.worker.wake_up(tags)
        if Fix.FULLY_AWAKE_GATE in self.fixes and self.worker.is_sleeping:
            return  # fix: fully_awake_gate -- a partial wake: a tag's memory is still released
        self.paused = False

    def step(self) -> EngineStep | None:
        """One iteration of the busy loop (None: nothing ran)."""
        return self._iterate(consensus=False)

    def _iterate(self, consensus: bool) -> EngineStep | None:
        if self.waiting and not self.paused:
            return self._schedule()
        if not self.idle_dp_rank or (self.paused and not consensus):
            return None
        if Fix.FULLY_AWAKE_GATE in self.fixes and self.worker.is_sleeping:
            # fix: fully_awake_gate -- whatever kicked the loop, no dummy forward while asleep
            return None
        return EngineStep([], self.worker.execute_dummy_batch())

    def _schedule(self) -> EngineStep:
        """Every waiting request's prefill, in one step (earlier requests are forgotten)."""
        requests = [Request(f"req{i}", tokens) for i, tokens in enumerate(self.waiting)]
        self.waiting = []
        self.worker.model_runner.kv_cache.reset()
        return EngineStep(requests, self.worker.execute_model(requests))


class DataParallelEngine:
    """The busy loop of one data-parallel rank around its runner (upstream: the DP engine
    core's loop, or an external launcher's): each iteration the ranks first agree how many
    requests are unfinished across them (an all-reduce of one count: the loop runs while any
    has one), then the rank runs the step its scheduler made, however many tokens it holds
    (zero: a request waits, e.g. under async scheduling or for its grammar), and ends it."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.collectives = runner, runner.collectives

    def step(self, requests: list[Request], unfinished: int) -> tuple[ModelOutput, int]:
        """The step's output and the unfinished requests across the ranks."""
        # a host tensor, as upstream's ParallelConfig.has_unfinished_dp
        count = torch.tensor([unfinished], dtype=torch.int32)
        self.collectives.all_reduce(count, "dp")
        out = self.runner.execute_model(requests, use_cudagraph=False)
        self.collectives.end_step()
        return out, int(count.item())
