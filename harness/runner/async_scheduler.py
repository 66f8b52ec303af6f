"""A scheduler one step ahead (upstream: AsyncScheduler); async_engine.py drives the runner
with it.

The engine schedules and launches step N+1 before it processes step N's output: the scheduler
counts a request's tokens optimistically (`num_computed_tokens` includes the tokens in flight,
`num_in_flight_tokens` says how many), and a token sampled by the step in flight is a
PLACEHOLDER that the worker fills on the device (async_inputs.py). A request that needs a block
when none is free preempts the last running one (its blocks freed, its count reset to 0); a
preempted request resumes, once its outputs reached the host, by prefilling every host token
again. A running request's batch row is its KV-cache row: rows close up when one leaves. A token
budget (upstream: max_num_scheduled_tokens) skips a running request whose step does not fit what
the requests before it left: it is scheduled again in a later step, past position 0.

Speculative decoding: a decode step schedules the sampled token and `num_spec_tokens` drafts
(both on the device: async_engine.py); the host learns what the verification accepted with the
step's output, and the count rolls back by the rejected drafts (the next step, already
launched, starts that much earlier on the device: async_inputs.py). With a sliding window, each
decode first frees the blocks that left the window: where the fix part of async_window_free
lives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import triton

from harness.fixes import Fix, Variant
from harness.runner.async_inputs import PLACEHOLDER, ScheduledRequest
from harness.runner.kv_cache import KVCache


@dataclass(eq=False)
class EngineRequest:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    output: list[int] = field(default_factory=list)  # tokens the host has processed
    num_computed_tokens: int = 0  # scheduled so far (optimistic: in-flight tokens included)
    num_in_flight_tokens: int = 0  # scheduled, not processed yet
    num_in_flight_steps: int = 0  # steps in flight that hold it (each emits a token or more)
    num_preemptions: int = 0

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
    def __init__(
        self,
        kv_cache: KVCache,
        fixes: Variant,
        num_spec_tokens: int = 0,
        max_num_scheduled_tokens: int = 0,  # the token budget of a step (0: none)
    ) -> None:
        self.kv, self.fixes, self.num_spec_tokens = kv_cache, fixes, num_spec_tokens
        self.max_num_scheduled_tokens = max_num_scheduled_tokens
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []  # index = batch row = KV-cache row
        self.finished: list[EngineRequest] = []

    def add_request(self, req_id: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        self.waiting.append(EngineRequest(req_id, prompt, max_tokens))

    def schedule(self) -> StepPlan:
        """Every running request that still owes an output and fits the token budget's rest
        (its blocks first: preempting from the back when none is free), then waiting ones
        while their tokens and blocks fit, unless this step preempted."""
        plan, preempted = StepPlan([], []), False
        budget = self.max_num_scheduled_tokens or float("inf")
        for req in list(self.running):
            if (
                req not in self.running
                or len(req.output) + req.num_in_flight_steps >= req.max_tokens
                or self._end(req) - req.num_computed_tokens > budget  # skipped for this step
            ):
                continue
            while not self._fits(self.running.index(req), self._end(req)):
                preempted = True
                self._preempt(self.running[-1])
                if req not in self.running:
                    break
            else:
                budget -= self._end(req) - req.num_computed_tokens
                self._add(plan, req)
        while self.waiting and not preempted:
            req = self.waiting[0]
            if (
                req.num_in_flight_steps
                or self._end(req) > budget
                or not self._fits(len(self.running), self._end(req))
            ):
                break
            budget -= self._end(req)
            self.running.append(self.waiting.pop(0))
            self._add(plan, req)
        return plan

    def _end(self, req: EngineRequest) -> int:
        """Where the request's next step ends: a prefill of every host token, or a decode of
        its sampled token and, when its last step is in flight (its drafts on the device),
        the drafts."""
        if req.num_computed_tokens == 0:
            return len(req.prompt) + len(req.output)
        drafts = self.num_spec_tokens if req.num_in_flight_steps else 0
        return req.num_computed_tokens + 1 + drafts

    def _add(self, plan: StepPlan, req: EngineRequest) -> None:
        start, end, row = req.num_computed_tokens, self._end(req), self.running.index(req)
        if start and self.kv.sliding_window:
            computed = req.num_computed_tokens
            if Fix.ASYNC_WINDOW_FREE_PROCESSED in self.fixes:
                # fix: async_window_free_processed -- drafts in flight may be rejected yet
                computed -= req.num_in_flight_tokens
            self.kv.remove_skipped_blocks(row, computed)
        self.kv.ensure_blocks(row, end)  # upstream: allocate_slots
        ids = tuple(req.host_token(p) for p in range(start, end))
        plan.requests.append(req)
        plan.scheduled.append(ScheduledRequest(req.req_id, start, ids))
        req.num_computed_tokens = end
        req.num_in_flight_tokens += end - start
        req.num_in_flight_steps += 1

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

    def update_from_output(
        self, plan: StepPlan, emitted: list[list[int]], rejected: list[int]
    ) -> list[str]:
        """Step `plan`'s tokens reach the host (a preempted request keeps its own); each
        request's count rolls back by its rejected drafts; returns the requests that
        finished."""
        done = []
        for req, s, tokens, back in zip(
            plan.requests, plan.scheduled, emitted, rejected, strict=True
        ):
            if req in self.finished:  # a step scheduled before the host saw it finish
                continue
            req.num_in_flight_tokens -= len(s.token_ids)
            req.num_in_flight_steps -= 1
            req.output = (req.output + tokens)[: req.max_tokens]
            if req.num_computed_tokens:  # upstream: num_computed_tokens -= num_rejected
                req.num_computed_tokens -= back
            if len(req.output) == req.max_tokens:
                if req in self.running:
                    self._leave(req)
                else:  # preempted while its last step was in flight
                    self.waiting.remove(req)
                self.finished.append(req)
                done.append(req.req_id)
        return done
