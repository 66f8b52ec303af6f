"""A scheduler one step ahead (upstream: AsyncScheduler), and the engine loop that drives the
runner with it.

The engine schedules and launches step N+1 before it processes step N's output: the scheduler
counts a request's tokens optimistically (`num_computed_tokens` includes the tokens in flight,
`num_in_flight_tokens` says how many), and a token sampled by the step in flight is a
PLACEHOLDER that the worker fills on the device (async_inputs.py). A request that needs a block
when none is free preempts the last running one (its blocks freed, its count reset to 0); a
preempted request resumes, once its outputs reached the host, by prefilling every host token
again. A running request's batch row is its KV-cache row: rows close up when one leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from harness.runner.async_inputs import PLACEHOLDER, ScheduledRequest, TokenRows
from harness.runner.input_batch import Request
from harness.runner.kv_cache import KVCache
from harness.runner.model_runner import ModelRunner


@dataclass(eq=False)
class EngineRequest:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    output: list[int] = field(default_factory=list)  # sampled tokens the host has processed
    num_computed_tokens: int = 0  # scheduled so far (optimistic: in-flight tokens included)
    num_in_flight_tokens: int = 0  # scheduled, not processed yet
    num_in_flight_outputs: int = 0  # sampled by steps in flight
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt and outputs, those in flight included."""
        return len(self.prompt) + len(self.output) + self.num_in_flight_outputs

    def host_token(self, position: int) -> int:
        """The host's token at `position`, PLACEHOLDER while it is in flight."""
        tokens = self.prompt + tuple(self.output)
        return tokens[position] if position < len(tokens) else PLACEHOLDER


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One scheduled step: its requests in batch rows, and what each schedules."""

    requests: list[EngineRequest]
    scheduled: list[ScheduledRequest]


class AsyncScheduler:
    def __init__(self, kv_cache: KVCache) -> None:
        self.kv = kv_cache
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []  # index = batch row = KV-cache row
        self.finished: list[EngineRequest] = []

    def add_request(self, req_id: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        self.waiting.append(EngineRequest(req_id, prompt, max_tokens))

    def schedule(self) -> StepPlan:
        """Every running request that still owes an output (its blocks first: preempting from
        the back when none is free), then waiting ones while their blocks fit, unless this
        step preempted."""
        plan, preempted = StepPlan([], []), False
        for req in list(self.running):
            if (
                req not in self.running
                or len(req.output) + req.num_in_flight_outputs >= req.max_tokens
            ):
                continue
            while not self._fits(self.running.index(req), req.num_tokens):
                preempted = True
                self._preempt(self.running[-1])
                if req not in self.running:
                    break
            else:
                self._add(plan, req)
        while self.waiting and not preempted:
            req = self.waiting[0]
            if req.num_in_flight_outputs or not self._fits(len(self.running), req.num_tokens):
                break
            self.running.append(self.waiting.pop(0))
            self._add(plan, req)
        return plan

    def _add(self, plan: StepPlan, req: EngineRequest) -> None:
        start, end = req.num_computed_tokens, req.num_tokens
        self.kv.ensure_blocks(self.running.index(req), end)  # upstream: allocate_slots
        ids = tuple(req.host_token(p) for p in range(start, end))
        plan.requests.append(req)
        plan.scheduled.append(ScheduledRequest(req.req_id, start, ids))
        req.num_computed_tokens = end
        req.num_in_flight_tokens += end - start
        req.num_in_flight_outputs += 1

    def _fits(self, row: int, num_tokens: int) -> bool:
        """Whether every group has the free blocks that `num_tokens` tokens in `row` need."""
        owned = self.kv.blocks.get(row, [[] for _ in self.kv.block_sizes])
        return all(
            triton.cdiv(num_tokens, size) - len(owned[g]) <= len(self.kv.free_lists[g])
            for g, size in enumerate(self.kv.block_sizes)
        )

    def _preempt(self, req: EngineRequest) -> None:
        """Free the request's blocks and queue it first; it prefills again from position 0."""
        self._leave(req)
        req.num_computed_tokens, req.num_preemptions = 0, req.num_preemptions + 1
        self.waiting.insert(0, req)

    def _leave(self, req: EngineRequest) -> None:
        """The request leaves the running rows: its blocks freed, the rows after it close up."""
        row = self.running.index(req)
        self.kv.free(row)
        for later in range(row + 1, len(self.running)):
            self.kv.swap_rows(later - 1, later)
        self.running.remove(req)

    def update_from_output(self, plan: StepPlan, sampled: list[int]) -> list[str]:
        """Step `plan`'s sampled tokens reach the host (a preempted request keeps its own);
        returns the requests that finished."""
        done = []
        for req, s, token in zip(plan.requests, plan.scheduled, sampled, strict=True):
            req.num_in_flight_tokens -= len(s.token_ids)
            req.num_in_flight_outputs -= 1
            req.output.append(token)
            if len(req.output) == req.max_tokens:
                if req in self.running:
                    self._leave(req)
                else:  # preempted while its last step was in flight
                    self.waiting.remove(req)
                self.finished.append(req)
                done.append(req.req_id)
        return done


class AsyncEngine:
    """The engine loop one step ahead: schedule and launch step N+1, then process step N."""

    def __init__(self, runner: ModelRunner, scheduler: AsyncScheduler) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.rows = TokenRows(runner.fixes, runner.device)
        self.in_flight: tuple[StepPlan, torch.Tensor] | None = None
        self.steps: list[tuple[list[Request], torch.Tensor]] = []  # each step's inputs, logits

    def step(self) -> None:
        plan = self.scheduler.schedule()
        sampled = self.in_flight[1] if self.in_flight else None
        requests, fill = self.rows.prepare(plan.scheduled, sampled)
        launched = None
        if requests:
            out = self.runner.execute_model(requests, use_cudagraph=False, prev_sampled=fill)
            self.steps.append((requests, out.logits.clone()))
            launched = (plan, out.logits.argmax(-1))  # the sampled tokens stay on the device
        if self.in_flight is not None:
            for req_id in self.scheduler.update_from_output(*self._host(self.in_flight)):
                self.rows.forget(req_id)
        self.in_flight = launched

    @staticmethod
    def _host(in_flight: tuple[StepPlan, torch.Tensor]) -> tuple[StepPlan, list[int]]:
        plan, sampled = in_flight
        return plan, sampled.tolist()

    def run(self, max_steps: int) -> None:
        """Step until every request finished (or `max_steps`)."""
        for _ in range(max_steps):
            if not (self.scheduler.waiting or self.scheduler.running or self.in_flight):
                return
            self.step()
