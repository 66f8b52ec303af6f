"""Fuzz programs: a runner configuration and a sequence of operations, as JSON, run in a child.

`repro fuzz` (repro/fuzz.py) makes them; `run` (the child's function) builds a Worker, runs the
operations in order and checks the invariants after each: a step's graph replay equals its
eager run, the eager run equals the dense float64 reference (the draft attention too), a dummy
run equals the base model, no output holds poison (NaN), and a step writes the KV cache at its
real tokens' slots only (the sentinel rule: a padding token, slot -1, writes nothing). The
first operation that breaks one raises WrongResult naming it; a device fault ends the child
like any scenario's. What reads a step's hidden states is checked too, when configured: prompt
logprobs and a speculator's draft prefill logits against the reference, and the cache-only
layer's cache (extract) at every slot a real token wrote since the KV cache was last cleared.

A program: {"config": {...CONFIG keys}, "ops": [[name, *args], ...]} (a key of LATER_KEYS may be
missing: its first value; a learned-gate MoE needs LoRA off, the padded drafter no draft
attention); operations:
  ["add_lora", id, experts]   load adapter `id` (experts False: none for the experts: disabled)
  ["remove_lora", id]         evict it
  ["dummy", tokens, reqs]     a dummy run (profile, warm-up)
  ["capture"]                 capture_model
  ["step", [[lora_id, tokens, computed], ...], token_seed]   one step of these requests (a
                              fourth entry k: the request's allowed_token_ids, k seeded tokens)
  ["step", rows, token_seed, [[row, modulus, state], ...]]   a step with guided requests: the
                              scheduler's grammar bitmask (structured_output.py), one toy
                              grammar (allowed: t % modulus == state) per guided row, in the
                              scheduler's order (the list's); the other rows are free
  ["sleep", level]            the worker sleeps (1: weights offloaded, 2: discarded)
  ["wake", tags]              wake_up(tags): null (all), ["weights"] or ["kv_cache"]
  ["hot_add", id, experts]    last, after a step, every slot taken: add adapter `id` (the least
                              recently used evicted), then that step's batch again
  ["serve", tokens, seed]     while a tag sleeps: a request reaches the engine core (sleep and
                              wake go through it), one iteration of its loop (it must wait)
  ["generate", tokens, seed]  prefix caching on: a new request in row 0 of `tokens` seeded
                              tokens (at most 30; a hit needs 17: blocks of 4 and 16), its
                              prefill (the prefix cache's blocks reused) and one decode step,
                              then it finishes; its logits vs a reference that recomputes every
                              position. With prefix caching the requests finish before a sleep
                              (their blocks freed)
  ["reload", seed]            reload_weights(seed): a trainer's new checkpoint (seeded), then the
                              post-load processing again (with derived weights: derived again)
  ["submit", rows, token_seed]  config async N > 0 (steps in flight, at most N): an async
                              scheduling step of these requests (as step's rows, lora 0), eager,
                              sampled greedily on the device (execute_model_async's sampler),
                              its tokens downloaded on a copy stream that runs late; while steps
                              are in flight only submit and collect
  ["collect"]                 the oldest step in flight's tokens reach the host: each its
                              request's best allowed token by the float64 reference (within the
                              tolerance), never a disallowed one
  ["engine", [[prompt, max_tokens], ...], seed, k, budget, rejects]  config async > 0, nothing
                              in flight, no prefix caching (with reorder one request): every
                              row freed, then the async engine (async_engine.py: its scheduler
                              one step ahead, placeholders filled on the device) serves these
                              requests to the end, k drafts per decode, a token budget a step
                              (0: none), every draft of the launched steps `rejects` rejected
                              (a sliding window: config window); each launched step's logits
                              vs the reference (a run whose batch rows part from its KV rows,
                              which the engine's model cannot serve, ends unchecked). Config
                              engine_blocks N > 0 (not hybrid): the engine gets N free blocks
                              a group, the rest held back while it runs (its requests preempt
                              and resume; a budget fits each prompt with its max tokens)
  ["fresh", tokens, seed]     no prefix caching, nothing in flight: a new request in row 0 of
                              `tokens` seeded tokens, its prefill and one decode step, finished
                              (as generate): right after a KV wake its new pages hold the wake's
                              bytes (the cache is zeroed before any other operation reads it)
  ["offload", blocks, seed]   config offload (a CPU KV tier, one block size, the compute stream
                              late), nothing in flight: the tier emptied, a prompt of `blocks`
                              whole blocks and a token in row 0 (its blocks stored in the tier
                              in its step), finished; then a prompt of those blocks and two
                              tokens more hits the tier (its blocks loaded), its logits vs a
                              reference that recomputes every position
"""

from __future__ import annotations

import json
from dataclasses import replace

import torch

from harness.async_oracle import engine_problems
from harness.oracle import RTOL, close, expect_all, step_problems
from harness.record import Context
from harness.reference import draft_reference, recomputed_logits, step_reference
from harness.runner.async_engine import AsyncEngine
from harness.runner.async_scheduler import AsyncScheduler
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.engine import EngineCore
from harness.runner.input_batch import Request, decode_first_swaps, dummy_lengths
from harness.runner.model import ModelConfig
from harness.runner.model_runner import ModelOutput, RunnerConfig
from harness.runner.model_runner import runner_config as flat_config
from harness.runner.structured_output import ToyGrammar, grammar_bitmask
from harness.runner.worker import Worker

MAX_ENGINE_REQS, MAX_PROMPT, MAX_OUTPUT, MAX_DRAFTS = 3, 8, 6, 2  # an engine op's requests
ENGINE_STEPS = 64  # the engine's steps at most (its requests finish well before)
# a scarce engine pool (config engine_blocks), blocks a group: a request alone fits it, its
# optimistic count at most its prompt, its outputs and two steps' drafts (18 tokens, blocks of 4)
ENGINE_BLOCKS = 5

# config key -> the values a program may hold (repro/fuzz.py draws from these)
CONFIG = {
    "mode": tuple(m.name for m in CUDAGraphMode),
    "sizes": ((4,), (8,), (4, 8), (4, 16), (4, 8, 16)),
    "backend": ("paged", "flashmla"),
    "draft": (False, True),
    "tables_in_graph": (False, True),
    "lora": (True, False),
    "max_loras": (2, 3),
    "specialize": (False, True),
    # the attention's kernel blocks: the KV manager's (4, 16), or each group's halved (2, 8)
    "kernel_blocks": ("manager", "half"),
    "window": (0, 8),  # a sliding window over the last tokens (0: none)
    # layer 1's MoE: routed by token id (hash), or by a learned gate (no expert LoRA: LoRA
    # off), its padding rows marked -1 by the gate (gate_skip: VLLM_MOE_SKIP_PADDING)
    "moe": ("hash", "gate", "gate_skip"),
    # a speculator's draft prefill on the target's hidden states: none, in the target's FULL
    # graphs (prefill), or in graphs of its own sharing the target's output pool (padded)
    "speculator": ("none", "prefill", "padded"),
    "extract": (False, True),  # a cache-only layer stores each token's final hidden state
    "prompt_logprobs": (False, True),  # each step's log-softmax of every token's logits
    # the backend reorders a mixed batch decodes-first by row swaps (MLA's, FlashInfer's)
    "reorder": (False, True),
    # the KV manager's prefix cache (generate reuses a prompt's cached blocks): not with the
    # block tables gathered in graphs (a capture writes row 0's blocks) nor a sliding window
    "prefix_caching": (False, True),
    # post-load processing derives tensors the forward reads (ModelConfig.derived_weights)
    "derived": (False, True),
    # async scheduling: at most this many steps in flight (submit, collect), and the async
    # engine (0: off; the sampler's copy stream runs late: the order a race loses)
    "async": (0, 1, 2, 3),
    # a CPU KV tier (kv_offload.py) on blocks of one size (4: the tier needs one), its stores
    # issued in the step; the compute stream late (the device behind the host): not with
    # prefix caching, the padded drafter nor the draft attention
    "offload": (False, True),
    # a hybrid runner (a state group in group 0's blocks; new blocks zeroed: kv_block_stale_nan)
    # whose split-KV decode (backend flashmla) loads whole pages (TRTLLM's): no draft
    # attention, no CPU tier
    "hybrid": (False, True),
    # the async engine's pool: at most this many free blocks a group (0: the whole pool), the
    # rest held back while an engine operation runs: its requests preempt and resume
    "engine_blocks": (0, ENGINE_BLOCKS),
}
# keys added since programs were first kept: a program without one holds its first value
LATER_KEYS = (
    "kernel_blocks",
    "window",
    "moe",
    "speculator",
    "extract",
    "prompt_logprobs",
    "reorder",
    "prefix_caching",
    "derived",
    "async",
    "offload",
    "hybrid",
    "engine_blocks",
)
MAX_MODEL_LEN, MAX_TOKENS, MAX_REQS = 32, 32, 8
MAX_ALLOWED = 8  # a restricted request's allowed_token_ids, at most
MAX_MODULUS = 5  # a guided request's toy grammar allows one token id in `modulus`, at least
BLOCK_SIZES = (4, 16)
HYBRID_KV_BLOCKS = 80  # per group: every row's state block and pages fit in group 0
OFFLOAD_BLOCK, OFFLOAD_CPU_BLOCKS, MAX_OFFLOAD_BLOCKS = 4, 256, 6  # the tier's; an op's prompt


def with_defaults(config: dict) -> dict:
    """`config` with each of LATER_KEYS it lacks at its first value."""
    return {**{key: CONFIG[key][0] for key in LATER_KEYS}, **config}


def runner_config(ctx: Context, config: dict) -> RunnerConfig:
    config = with_defaults(config)
    flashmla = config["backend"] == "flashmla"
    half = config["kernel_blocks"] == "half"
    blocks = (OFFLOAD_BLOCK,) * 2 if config["offload"] else BLOCK_SIZES
    return flat_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        model=ModelConfig(
            max_loras=config["max_loras"],
            learned_gate=config["moe"] != "hash",
            skip_padding=config["moe"] == "gate_skip",
            derived_weights=config["derived"],
        ),
        max_num_tokens=MAX_TOKENS,
        max_num_reqs=MAX_REQS,
        cudagraph_mode=CUDAGraphMode[config["mode"]],
        cudagraph_sizes=tuple(config["sizes"]),
        enable_lora=config["lora"],
        specialize_active_lora=config["specialize"],
        decode_backend="trtllm" if config["hybrid"] and flashmla else config["backend"],
        hybrid=config["hybrid"],
        num_kv_blocks=HYBRID_KV_BLOCKS if config["hybrid"] else 64,
        draft_attention=flashmla and config["draft"],
        max_model_len=MAX_MODEL_LEN,
        tables_in_graph=config["tables_in_graph"],
        block_sizes=blocks,
        kernel_block_sizes=tuple(b // 2 for b in blocks) if half else (),
        sliding_window=config["window"],
        draft_prefill=config["speculator"] != "none",
        draft_graphs=config["speculator"] == "padded",
        extract_hidden_states=config["extract"],
        prompt_logprobs=config["prompt_logprobs"],
        reorder_batch=config["reorder"],
        enable_prefix_caching=config["prefix_caching"],
        async_output=config["async"] > 0,
        stream_delay=config["async"] > 0 or config["offload"],
        cpu_offload_blocks=OFFLOAD_CPU_BLOCKS if config["offload"] else 0,
    )


def describe(op: list) -> str:
    """One operation as a line of text."""
    name, *args = op
    if name in ("step", "submit"):
        reqs = ", ".join(
            f"lora {r[0]} x{r[1]} @{r[2]}" + (f" allowing {r[3]}" if len(r) == 4 else "")
            for r in args[0]
        )
        guided = "".join(f", guided {g}" for g in args[2:])
        return f"{name} [{reqs}]{guided}"
    return f"{name}({', '.join(json.dumps(a) for a in args)})"


def _allowed(gen: torch.Generator, vocab: int, count: int) -> tuple[int, ...]:
    """A request's allowed_token_ids: `count` tokens of the vocabulary, seeded."""
    return tuple(sorted(torch.randperm(vocab, generator=gen)[:count].tolist()))


def _poisoned(label: str, out: ModelOutput) -> list[str | None]:
    """NaN in an output: a read of poison (never valid data here)."""
    found = []
    for name in ("hidden_states", "logits", "draft"):
        t = getattr(out, name)
        if t is not None and t.isnan().any():
            found.append(
                f"{label}: {name} holds NaN (poison read) in {int(t.isnan().sum())} places"
            )
    return found


class _Unaligned(Exception):
    """The async engine scheduled a step whose batch rows are not its requests' KV rows."""


class Machine:
    """The worker and what the program did to it (the step's token ids are seeded)."""

    def __init__(self, ctx: Context, config: dict) -> None:
        self.ctx, self.config = ctx, config
        self.worker = Worker(runner_config(ctx, config))
        self.engine = EngineCore(self.worker)  # sleep, wake and requests that arrive between
        self.runner = self.worker.model_runner
        # the cache-only layer's slots a step's real token wrote -> the hidden state it wrote
        self.extracted: dict[int, torch.Tensor] = {}
        self.in_flight: list = []  # async steps submitted, not collected: oldest first
        self.poisoned = False  # the KV cache holds a wake's bytes
        self.clear_kv()

    def clear_kv(self) -> None:
        """Zero K/V: the context of requests whose earlier steps the program did not run. A
        dummy run reads the cache too: it matches the base model only while the cache is
        clean."""
        for cache in (*self.runner.kv_cache.k_caches, *self.runner.kv_cache.v_caches):
            cache.zero_()
        self.kv_clean, self.poisoned = True, False
        self.extracted.clear()  # the cache-only layer's cache woke as 0xFF bytes too

    def apply(self, op: list) -> list[str | None]:
        name, *args = op
        if self.poisoned and name not in ("wake", "serve", "sleep", "fresh"):
            self.clear_kv()  # the engine drops what the KV cache held (wake left 0xFF bytes)
        return getattr(self, f"op_{name}")(*args) or []

    def op_fresh(self, tokens: int, token_seed: int) -> list[str | None]:
        """A new request from position 0 (its pages new blocks: right after a KV wake they hold
        the wake's bytes, which only a step's unused slots may still hold), as generate."""
        poisoned, self.poisoned = self.poisoned, False
        problems = self.op_generate(tokens, token_seed)
        self.poisoned = poisoned  # the rest of the cache: zeroed before the next operation
        return problems

    def op_add_lora(self, lora_id: int, experts: bool) -> None:
        self.runner.add_lora(lora_id, seed=self.ctx.seed + 10 + lora_id, experts=experts)

    def op_remove_lora(self, lora_id: int) -> None:
        self.runner.remove_lora(lora_id)

    def op_capture(self) -> None:
        self.runner.capture_model()
        if self.config["tables_in_graph"]:
            # the captured gather computes real slots for the dummy batch (block-table row 0)
            # and its K/V lands there: a later dummy run reads it (found by seed 4, fixed runner)
            self.kv_clean = False
            self.extracted.clear()  # and the cache-only layer's states

    def op_sleep(self, level: int) -> None:
        kv = self.runner.kv_cache
        if kv.prefix_caching:  # the engine sleeps idle: its requests finished (blocks freed)
            for row in list(kv.blocks):
                kv.free(row)
        self.engine.sleep(level)

    def op_reload(self, seed: int) -> None:
        self.runner.reload_weights(seed)

    def op_generate(self, tokens: int, token_seed: int) -> list[str | None]:
        """A new request in row 0 (the prefix cache's blocks of its prompt reused), its prefill
        and one decode step: each step's logits vs the reference that recomputes every
        position (a reused block holding other bytes cannot agree with it)."""
        gen = torch.Generator().manual_seed(token_seed)
        vocab = self.runner.model.config.vocab_size
        prompt = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
        new, steps = self.runner.generate([prompt], 2)
        self.kv_clean = False
        self.extracted.clear()  # its slots were written outside the steps' record
        hits = steps[0][0][0].num_computed_tokens
        return [
            close(
                f"generate step {i} (prompt of {tokens}, {hits} tokens from the prefix cache) "
                "logits vs recomputed reference",
                logits,
                recomputed_logits(self.runner, [prompt + new[0][:i]]),
            )
            for i, (_, logits) in enumerate(steps)
        ]

    def op_wake(self, tags: list[str] | None) -> None:
        self.engine.wake_up(tags)
        if tags is None or "kv_cache" in tags:
            self.poisoned = True  # zeroed before the next operation but fresh reads the cache

    def op_serve(self, tokens: int, token_seed: int) -> list[str | None]:
        """A request reaches the engine while a tag sleeps, and one iteration of its loop: the
        request must wait (nothing runs while a tag's memory is released)."""
        gen = torch.Generator().manual_seed(token_seed)
        vocab = self.runner.model.config.vocab_size
        self.engine.add_request(torch.randint(0, vocab, (tokens,), generator=gen).tolist())
        ran = self.engine.step()
        if ran is not None:
            return [f"the engine ran {len(ran.requests)} requests while a tag sleeps"]
        return []

    def op_dummy(self, tokens: int, reqs: int) -> list[str | None]:
        before = self.kv_snapshot()
        out = self.runner.execute_model(dummy_run=True, num_tokens=tokens, num_reqs=reqs)
        dummy = [Request(f"d{r}", (0,) * n) for r, n in enumerate(dummy_lengths(tokens, reqs))]
        problems = _poisoned("dummy run", out) + self.kv_written_outside(before, [])
        if not self.kv_clean:
            return problems
        hidden, logits = step_reference(self.runner, dummy, dummy=True)
        return [
            close("dummy run hidden states vs base model", out.hidden_states, hidden),
            close("dummy run logits vs base model", out.logits, logits),
            *problems,
        ]

    def caches(self) -> list[tuple[str, int, torch.Tensor]]:
        """Each cache a step writes through a slot mapping: (name, its group, the cache)."""
        kv = self.runner.kv_cache
        groups = len(kv.k_caches)
        found = [
            (f"{'KV'[i // groups]} cache group {i % groups}", i % groups, cache)
            for i, cache in enumerate((*kv.k_caches, *kv.v_caches))
        ]
        if self.runner.cache_only is not None:  # group 0's slot mapping
            found.append(("the cache-only layer's cache", 0, self.runner.cache_only.kv_cache))
        return found

    def kv_snapshot(self) -> list[torch.Tensor]:
        self.held = self.blocks_held()  # a hybrid runner zeroes the blocks a step is given
        return [cache.clone() for _, _, cache in self.caches()]

    def blocks_held(self) -> set[tuple[int, int]]:
        """(group, block) of every block a request row holds."""
        kv = self.runner.kv_cache
        return {(g, b) for ids in kv.blocks.values() for g, bs in enumerate(ids) for b in bs}

    def kv_written_outside(self, before: list[torch.Tensor], shape) -> list[str | None]:
        """The sentinel rule: the slots a step changed are its real tokens' (graph padding
        tokens carry slot -1 and write nothing; a stale or wrapped slot overwrites another's).
        A dummy run (shape []) writes none."""
        kv = self.runner.kv_cache
        problems = []
        # a hybrid runner's own writes: its state blocks (group 0's) and the blocks the step
        # was given, zeroed whole (kv_block_stale_nan's fix)
        ours = {(0, b) for b in kv.state_blocks.values()}
        if kv.hybrid and shape:
            ours |= self.blocks_held() - self.held
        for old, (name, g, new) in zip(before, self.caches(), strict=True):
            mine = {kv.slot(g, row, c + p) for row, (_, n, c) in enumerate(shape) for p in range(n)}
            size = kv.block_sizes[g]
            if name != "the cache-only layer's cache":
                mine |= {b * size + p for gg, b in ours if gg == g for p in range(size)}
            old, new = old.flatten(0, 1), new.flatten(0, 1)
            changed = ((old != new) & ~(old.isnan() & new.isnan())).flatten(1).any(1)
            stray = sorted(set(changed.nonzero().flatten().tolist()) - mine)
            if stray:
                problems.append(
                    f"the {'step' if shape else 'dummy run'} wrote {name} at slots {stray[:6]}, "
                    f"none of them a real token's (slot -1 read as a slot?)"
                )
        return problems

    def op_hot_add(self, lora_id: int, experts: bool) -> list[str | None]:
        """An adapter added while every slot is taken (the least recently used evicted), then
        the previous step's batch again: its adapters' slots may have moved."""
        self.op_add_lora(lora_id, experts)
        return self.op_step(*self.last_step)

    def requests(self, rows: list[list[int]], token_seed: int):
        """A step's requests (token ids seeded), the rows the runner serves them in (a backend
        that reorders swaps decodes first), and its shape [(lora, tokens, computed)] in them."""
        gen = torch.Generator().manual_seed(token_seed)
        vocab = self.runner.model.config.vocab_size
        requests = [
            Request(f"r{row}", tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()), a, c)
            for row, (a, n, c, *_) in enumerate(rows)
        ]
        requests = [
            q if len(r) == 3 else replace(q, allowed_token_ids=_allowed(gen, vocab, r[3]))
            for q, r in zip(requests, rows, strict=True)
        ]
        ordered = list(requests)
        if self.runner.config.attention.reorder_batch:
            for i, j in decode_first_swaps([len(q.token_ids) == 1 for q in ordered]):
                ordered[i], ordered[j] = ordered[j], ordered[i]
        shape = [(q.lora_id, len(q.token_ids), q.num_computed_tokens) for q in ordered]
        return requests, ordered, shape

    def execute(self, requests: list[Request], **kwargs) -> ModelOutput:
        """A synchronous step; with async scheduling's sampler (config async) the host then
        waits for its streams (the allowed-token-ids mask is applied after its upload)."""
        out = self.runner.execute_model(requests, **kwargs)
        if self.runner.async_sampler is not None:
            self.runner.async_sampler.streams.synchronize()
        return out

    def op_submit(self, rows: list[list[int]], token_seed: int) -> list[str | None]:
        """An async scheduling step (eager: the emulated streams queue host work that a graph
        replay of the next step would overtake, which a GPU's stream order forbids); its
        tokens are checked when collected, against the reference computed now."""
        requests, ordered, shape = self.requests(rows, token_seed)
        before = self.kv_snapshot()
        out = self.runner.execute_model(requests, use_cudagraph=False)
        pending = self.runner.async_sampler.sample(out.logits, out.req_ids)
        self.kv_clean = False
        self.extracted.clear()  # the cache-only layer's writes are not recorded here
        logits = step_reference(self.runner, ordered)[1]
        pairs = zip(ordered, logits, strict=True)
        want = {q.req_id: (q.allowed_token_ids, row) for q, row in pairs}
        self.in_flight.append((rows, want, pending))
        return self.kv_written_outside(before, shape)

    def op_collect(self) -> list[str | None]:
        """The oldest step in flight's tokens: each request's best allowed token (within the
        tolerance of the float64 reference's logits; a near tie may go either way)."""
        rows, want, pending = self.in_flight.pop(0)
        tokens = pending.get_output()
        problems = []
        for req_id, token in zip(pending.req_ids, tokens, strict=True):
            allowed, logits = want[req_id]
            ok = list(allowed) if allowed is not None else list(range(logits.shape[0]))
            top = ok[int(logits[ok].argmax())]
            best = float(logits[top])
            atol = 2 * RTOL[self.runner.model.dtype] * max(float(logits.abs().max()), 1.0)
            if token not in ok:
                problems.append(
                    f"request {req_id} of a step in flight {rows} sampled token {token}, not "
                    f"one of its allowed {allowed}"
                )
            elif float(logits[token]) < best - atol:
                problems.append(
                    f"request {req_id} of a step in flight {rows} sampled token {token} (logit "
                    f"{float(logits[token]):.4f}), not its best allowed one ({top}: {best:.4f})"
                )
        return problems

    def op_engine(self, reqs, token_seed: int, k: int, budget: int, rejects) -> list[str | None]:
        """The async engine serves `reqs` ([prompt length, max tokens]) to their ends from
        freed rows (on a scarce pool: config engine_blocks): every launched step's logits vs
        the float64 reference of the host's final tokens (async_oracle)."""
        kv = self.runner.kv_cache
        for row in list(kv.blocks):
            kv.free(row)
        # a scarce pool (config engine_blocks): each group's free list's head only (the
        # blocks taken next); the rest held back until the engine is done
        keep = with_defaults(self.config)["engine_blocks"] or None
        held = [ids[:-keep] if keep else [] for ids in kv.free_lists]
        kv.free_lists = [ids[len(h) :] for ids, h in zip(kv.free_lists, held, strict=True)]
        gen = torch.Generator().manual_seed(token_seed)
        vocab = self.runner.model.config.vocab_size
        scheduler = AsyncScheduler(kv, self.ctx.fixes, k, budget)
        for i, (n, max_tokens) in enumerate(reqs):
            prompt = tuple(torch.randint(0, vocab, (n,), generator=gen).tolist())
            scheduler.add_request(f"e{i}", prompt, max_tokens)
        engine = AsyncEngine(self.runner, scheduler, reject_steps=tuple(rejects))
        schedule = scheduler.schedule

        def aligned():
            """The engine's model: a step's batch rows are its requests' KV rows. A running
            request skipped before one scheduled (its last token in flight, or the budget)
            breaks it: the run ends, unchecked (the draw rarely makes one)."""
            plan = schedule()
            rows = [scheduler.running.index(q) for q in plan.requests]
            if rows != list(range(len(rows))):
                raise _Unaligned
            return plan

        scheduler.schedule = aligned
        self.kv_clean = False
        self.extracted.clear()
        try:
            engine.run(max_steps=ENGINE_STEPS)
        except _Unaligned:
            for row in list(kv.blocks):
                kv.free(row)
            return []
        finally:
            for ids, h in zip(kv.free_lists, held, strict=True):
                ids[:0] = h  # the held blocks queue up behind the free ones
        unfinished = [q.req_id for q in scheduler.waiting + scheduler.running]
        if unfinished:
            return [f"the async engine left {unfinished} unfinished after {ENGINE_STEPS} steps"]
        return engine_problems(self.runner, engine)

    def op_offload(self, blocks: int, token_seed: int) -> list[str | None]:
        """A prompt's whole blocks stored in the CPU tier by its step, then a prompt sharing
        them hits the tier: its logits vs the reference that recomputes every position (a
        block stored before the step wrote it holds other bytes)."""
        tier, kv = self.runner.offload, self.runner.kv_cache
        tier.finish_stores()  # the tier emptied: what earlier programs' steps stored goes
        tier.cached.clear()
        tier.known.clear()
        tier.free_blocks = list(range(OFFLOAD_CPU_BLOCKS))[::-1]
        gen = torch.Generator().manual_seed(token_seed)
        vocab = self.runner.model.config.vocab_size
        first = torch.randint(0, vocab, (blocks * OFFLOAD_BLOCK + 3,), generator=gen).tolist()
        prompt = first[: blocks * OFFLOAD_BLOCK + 1]
        shared = first[: blocks * OFFLOAD_BLOCK] + first[-2:]
        kv.free(0)
        tier.get_computed_blocks(0, prompt)
        self.execute([Request("a", tuple(prompt))])
        kv.free(0)
        hit = tier.get_computed_blocks(0, shared)
        out = self.execute([Request("c", tuple(shared[hit:]), 0, hit)])
        logits = out.logits.clone()
        kv.free(0)
        self.kv_clean = False
        self.extracted.clear()
        return [
            close(
                f"a prompt's logits after {hit} tokens from the CPU tier (of {blocks} blocks "
                "another prompt's step stored) vs recomputed reference",
                logits,
                recomputed_logits(self.runner, [shared]),
            )
        ]

    def op_step(self, rows: list[list[int]], token_seed: int, *guided) -> list[str | None]:
        self.last_step = (rows, token_seed, *guided)
        vocab = self.runner.model.config.vocab_size
        requests, ordered, shape = self.requests(rows, token_seed)
        # the scheduler's bitmask of the guided rows, in its order; each row's disallowed tokens
        grammar, forbidden = None, {}
        if guided:
            states = [(f"r{row}", ToyGrammar(m, st), st) for row, m, st in guided[0]]
            grammar = grammar_bitmask(states, vocab)
            for req_id, g, st in states:
                forbidden[req_id] = set(range(vocab)) - set(g.allowed(st, vocab))
        before = self.kv_snapshot()
        out = self.execute(requests, grammar=grammar)
        self.kv_clean = False
        replay = None
        replay_drafts = None
        if out.desc is not None:  # a graph served it: keep its outputs, then run eagerly
            clone = lambda t: None if t is None else t.clone()
            replay = ModelOutput(
                *(clone(t) for t in (out.hidden_states, out.logits, out.draft)),
                prompt_logprobs=clone(out.prompt_logprobs),
            )
            replay_drafts = self.draft_logits(len(requests))
            # in the rows the replay ran them in (swapping again would move the KV rows back)
            out = self.execute(ordered, use_cudagraph=False, grammar=grammar)
        label = "eager" if replay is None else "replayed"
        reference = step_reference(self.runner, ordered)
        problems = []
        mask = self.runner.sampling.mask_cpu.new_zeros(len(ordered), vocab)
        for row, q in enumerate(ordered):
            if q.allowed_token_ids is not None:
                mask[row] = True
                mask[row, list(q.allowed_token_ids)] = False
            if q.req_id in forbidden:
                mask[row, sorted(forbidden[q.req_id])] = True
        if mask.any():  # disallowed tokens at -inf: compared as such, the rest as numbers
            for name, o in (("eager", out), ("replayed", replay)):
                if o is not None and not torch.equal(o.logits.isneginf().cpu(), mask):
                    problems.append(
                        f"{name} logits: -inf outside the requests' disallowed tokens "
                        f"(allowed_token_ids {[q.allowed_token_ids for q in ordered]}, "
                        f"grammars {guided[0] if guided else None}), or a disallowed token "
                        "left finite"
                    )
            unmasked = lambda o: (
                None
                if o is None
                else replace(o, logits=o.logits.masked_fill(mask.to(o.logits.device), 0.0))
            )
            out_checked, replay_checked = unmasked(out), unmasked(replay)
            reference = (reference[0], reference[1].masked_fill(mask, 0.0))
        else:
            out_checked, replay_checked = out, replay
        problems += step_problems(label, out_checked, reference, replay_checked)
        problems += _poisoned("eager", out) + (_poisoned("replay", replay) if replay else [])
        problems += self.kv_written_outside(before, shape)
        problems += self.readers_problems(shape, out, replay, reference[0], replay_drafts)
        if out.draft is not None:
            lens = [c + n for _, n, c in shape]
            want = draft_reference(self.runner, out.hidden_states, lens)
            problems.append(close("eager draft vs reference", out.draft, want))
            if replay is not None and replay.draft is not None:
                problems.append(close("draft replay vs eager", replay.draft, out.draft))
        return problems

    def draft_logits(self, num_reqs: int) -> torch.Tensor | None:
        speculator = self.runner.speculator
        return None if speculator is None else speculator.draft_logits[:num_reqs].clone()

    def readers_problems(self, shape, out, replay, hidden, replay_drafts) -> list[str | None]:
        """What reads the step's hidden states: prompt logprobs and the draft prefill's logits
        (the draft model is the identity on the shared LM head, no LoRA) vs the float64
        reference (a replay's too); the cache-only layer's cache at every slot a real token
        wrote, since the cache was last cleared, holds the last state written there."""
        head = self.runner.model.head.detach().double().cpu()
        problems = []
        if out.prompt_logprobs is not None:
            want = torch.log_softmax(hidden @ head.T, -1)
            problems.append(close("eager prompt logprobs vs reference", out.prompt_logprobs, want))
            if replay is not None:
                got = replay.prompt_logprobs
                problems.append(close("replayed prompt logprobs vs reference", got, want))
        drafts = self.draft_logits(len(shape))
        if drafts is not None:
            last = torch.tensor([n for _, n, _ in shape]).cumsum(0) - 1
            want = hidden[last] @ head.T
            problems.append(close("eager draft prefill logits vs reference", drafts, want))
            if replay_drafts is not None:
                label = "replayed draft prefill logits vs reference"
                problems.append(close(label, replay_drafts, want))
        if self.runner.cache_only is not None:
            kv, row_start, states = self.runner.kv_cache, 0, out.hidden_states.clone()
            for row, (_, n, c) in enumerate(shape):
                for p in range(n):
                    self.extracted[kv.slot(0, row, c + p)] = states[row_start + p]
                row_start += n
            slots = sorted(self.extracted)
            got = self.runner.cache_only.extract(slots)
            want = torch.stack([self.extracted[slot] for slot in slots])
            label = f"the cache-only layer's states at the {len(slots)} slots real tokens wrote"
            problems.append(close(label, got, want))
        return problems


def run(ctx: Context) -> str:
    """The child's function: the program in ctx.payload, invariants after every operation."""
    program = json.loads(ctx.payload)
    machine = Machine(ctx, program["config"])
    for i, op in enumerate(program["ops"]):
        found = [p for p in machine.apply(op) if p]
        if found:
            head = f"operation {i} ({describe(op)}) broke an invariant:"
            expect_all([head, *found])
    return f"{len(program['ops'])} operations, every invariant held"


def invalid(program: dict) -> str | None:
    """Why `program` is not one `repro fuzz` could draw (None: valid). Pure Python: the
    parent checks shrunk programs and --replay input with it, before a child runs them."""
    config, ops = program.get("config"), program.get("ops")
    if not isinstance(config, dict) or not set(CONFIG) - set(LATER_KEYS) <= set(config):
        return f"config needs the keys {sorted(CONFIG)} ({', '.join(LATER_KEYS)} optional)"
    if set(config) - set(CONFIG):
        return f"config keys unknown: {sorted(set(config) - set(CONFIG))}"
    config = with_defaults(config)
    for key, values in CONFIG.items():
        value = tuple(config[key]) if isinstance(config[key], list) else config[key]
        if value not in values:
            return f"config {key}={config[key]!r}: one of {values}"
    if config["window"] and config["backend"] != "paged":
        return "a sliding window needs the paged backend (the split-KV decode has none)"
    if config["moe"] != "hash" and config["lora"]:
        return "the learned gate serves no expert LoRA: lora off"
    if config["speculator"] == "padded" and config["draft"] and config["backend"] == "flashmla":
        return "the padded drafter's graphs replace the draft attention's: one of them"
    draft = config["draft"] and config["backend"] == "flashmla"
    if config["hybrid"] and (config["offload"] or draft):
        return "a hybrid runner: no CPU tier, no draft attention"
    padded = config["speculator"] == "padded"
    if config["offload"] and (config["prefix_caching"] or padded or draft):
        # the late compute stream holds the forward's launches only: the padded drafter's
        # graphs and the draft attention run outside it (NaN, or a wild read, on the fixed
        # runner: an emulation limit, not drawn)
        return "a CPU tier: not with prefix caching, the padded drafter nor the draft attention"
    if config["prefix_caching"] and (config["tables_in_graph"] or config["window"]):
        return "prefix caching: not with tables_in_graph nor a sliding window"
    if config["engine_blocks"] and (not config["async"] or config["hybrid"]):
        # a hybrid runner's new row takes a state block the scheduler does not count
        return "a scarce engine pool (engine_blocks): async > 0, not a hybrid runner"
    active, asleep, captured, in_flight = [], set(), False, 0
    ops = ops if isinstance(ops, list) else [None]
    for i, op in enumerate(ops):
        why = _invalid_op(op, config, active, asleep, captured)
        if not why and isinstance(op, list):
            why = _invalid_async(op, config, in_flight)
        if why:
            return f"operation {i} {op!r}: {why}"
        in_flight += {"submit": 1, "collect": -1}.get(op[0], 0)
        name = op[0]
        if name == "hot_add":
            full = config["lora"] and len(active) == config["max_loras"]
            after_step = i > 0 and ops[i - 1][0] == "step"
            if i != len(ops) - 1 or not after_step or not full or op[1] in active:
                return (
                    f"operation {i} {op!r}: a hot add is last, after a step, every slot "
                    "taken, of an adapter not active"
                )
        if name == "add_lora":
            active.append(op[1])
        elif name == "remove_lora":
            active.remove(op[1])
        elif name == "capture":
            captured = True
        elif name == "sleep":
            asleep = {"weights", "kv_cache"}
        elif name == "wake":
            asleep -= set(op[1] or asleep)
    return None


def _invalid_op(op, config, active, asleep, captured) -> str | None:
    arity = {"add_lora": 2, "remove_lora": 1, "dummy": 2, "capture": 0, "step": 2, "sleep": 1}
    arity.update(wake=1, serve=2, hot_add=2, generate=2, reload=1, submit=2, collect=0, engine=5)
    arity.update(offload=2, fresh=2)
    guided = isinstance(op, list) and len(op) == 4 and op[0] == "step"
    if guided:
        op, guided_rows = op[:3], op[3]  # its grammars: checked at the end
    if not isinstance(op, list) or not op or op[0] not in arity or len(op) != arity[op[0]] + 1:
        return f"an operation is [name, *args] with name one of {sorted(arity)}"
    name, *args = op
    if name == "serve":
        ok = asleep and 1 <= args[0] <= MAX_TOKENS
        return None if ok else "a request served while a tag sleeps, of 1 to 32 tokens"
    if asleep and name != "wake":
        return "the worker sleeps: only wake (or serve)"
    if name in ("hot_add", "collect"):  # its place in the program: checked by invalid()
        return None
    if name == "engine":
        return _invalid_engine(*args)
    if name == "fresh":
        ok = not config["prefix_caching"] and 1 <= args[0] <= MAX_MODEL_LEN - 2
        return None if ok else "fresh: no prefix caching, a prompt of 1 to 30 tokens"
    if name == "offload":
        ok = config["offload"] and 1 <= args[0] <= MAX_OFFLOAD_BLOCKS and isinstance(args[1], int)
        return None if ok else f"a CPU tier (config offload), 1 to {MAX_OFFLOAD_BLOCKS} blocks"
    if name == "reload":
        return None if isinstance(args[0], int) and args[0] >= 0 else "a checkpoint's seed"
    if name == "generate":
        ok = config["prefix_caching"] and 1 <= args[0] <= MAX_MODEL_LEN - 2
        return None if ok else "generate needs prefix caching, a prompt of 1 to 30 tokens"
    if name == "wake":
        tags = asleep if args[0] is None else set(args[0])
        return None if asleep and tags <= asleep else "tags that do not sleep"
    if name == "sleep":
        return None if args[0] in (1, 2) else "level 1 or 2"
    if name == "capture":
        return "captured twice, or mode NONE" if captured or config["mode"] == "NONE" else None
    if name == "add_lora":
        full = len(active) >= config["max_loras"] or not config["lora"]
        return "no free slot (or LoRA off), or active" if full or args[0] in active else None
    if name == "remove_lora":
        return None if args[0] in active else "not active"
    if name == "dummy":
        tokens, reqs = args
        return None if 1 <= reqs <= min(tokens, MAX_REQS) and tokens <= MAX_TOKENS else "sizes"
    rows = args[0]
    if name == "submit" and any(r[0] for r in rows if isinstance(r, list) and r):
        return "a submitted step's requests are lora 0's"
    if not isinstance(rows, list) or not all(
        isinstance(r, list) and len(r) in (3, 4) for r in rows
    ):
        return "requests are [lora, tokens, computed] or [lora, tokens, computed, allowed]"
    if not rows or len(rows) > MAX_REQS or sum(r[1] for r in rows) > MAX_TOKENS:
        return f"1 to {MAX_REQS} requests, {MAX_TOKENS} tokens at most"
    for lora, n, computed, *allowed in rows:
        if (lora and lora not in active) or n < 1 or not 0 <= computed <= MAX_MODEL_LEN - n:
            return f"request [{lora}, {n}, {computed}]: inactive adapter or lengths"
        if allowed and not 1 <= allowed[0] <= MAX_ALLOWED:
            return f"request {[lora, n, computed, *allowed]}: 1 to {MAX_ALLOWED} allowed tokens"
    return _invalid_guided(guided_rows, len(rows)) if guided else None


def _invalid_async(op: list, config: dict, in_flight: int) -> str | None:
    """Async scheduling's operations: at most config async steps in flight, only submit and
    collect while any is; the engine with nothing in flight, no reorder, no prefix caching;
    (with the async sampler) a guided step has no restricted request."""
    name = op[0]
    if name in ("submit", "collect", "engine") and not config["async"]:
        return "async scheduling's operations need config async > 0"
    if name == "submit" and in_flight >= config["async"]:
        return f"at most {config['async']} steps in flight"
    if name == "collect" and not in_flight:
        return "no step in flight"
    if in_flight and name not in ("submit", "collect"):
        return "steps in flight: only submit or collect"
    if name == "engine" and (
        (config["reorder"] and len(op[1]) > 1)  # one request: nothing to swap
        or config["prefix_caching"]
    ):
        return "the async engine: not with prefix caching, one request with reorder"
    if name == "engine" and config["engine_blocks"] and not _invalid_engine(*op[1:]):
        return _invalid_scarce(op[1:])
    if config["async"] and name == "step" and len(op) == 4 and any(len(r) == 4 for r in op[1]):
        return "with the async sampler a guided step has no restricted request"
    return None


def _invalid_engine(reqs, seed, k, budget, rejects) -> str | None:
    """An engine op: 1 to MAX_ENGINE_REQS requests [prompt 1..MAX_PROMPT, max tokens
    1..MAX_OUTPUT], 0 to MAX_DRAFTS drafts, a budget of 0 (none) or one every prompt and
    every decode (1 + k tokens) fits, rejected steps' indices (distinct, >= 0)."""
    ok = (
        isinstance(reqs, list)
        and 1 <= len(reqs) <= MAX_ENGINE_REQS
        and all(
            isinstance(r, list)
            and len(r) == 2
            and 1 <= r[0] <= MAX_PROMPT
            and 1 <= r[1] <= MAX_OUTPUT
            for r in reqs
        )
        and isinstance(seed, int)
        and k in range(MAX_DRAFTS + 1)
        and isinstance(rejects, list)
        and all(isinstance(i, int) and 0 <= i < ENGINE_STEPS for i in rejects)
        and len(set(rejects)) == len(rejects)
    )
    if not ok:
        return (
            f"the engine serves 1 to {MAX_ENGINE_REQS} [prompt <= {MAX_PROMPT}, max tokens <= "
            f"{MAX_OUTPUT}], 0 to {MAX_DRAFTS} drafts, distinct rejected steps"
        )
    if (budget and budget < max(max(r[0] for r in reqs), 1 + k)) or budget > MAX_TOKENS:
        return "a budget (0: none) that fits every prompt and every decode"
    return None


def _invalid_scarce(engine: list) -> str | None:
    """An engine op on a scarce pool: a budget fits a preempted request's prefill again (its
    prompt and outputs: no chunked prefill here). (Every request fits the pool alone:
    ENGINE_BLOCKS.)"""
    reqs, budget = engine[0], engine[3]
    if budget and budget < max(n + max_tokens for n, max_tokens in reqs):
        return "a scarce pool: a budget (0: none) that fits a preempted request's prefill again"
    return None


def _invalid_guided(guided, num_rows: int) -> str | None:
    """A step's grammars: [[row, modulus, state], ...], distinct rows of the step, modulus 2 to
    MAX_MODULUS, 0 <= state < modulus."""
    ok = (
        isinstance(guided, list)
        and guided
        and all(
            isinstance(g, list)
            and len(g) == 3
            and 0 <= g[0] < num_rows
            and 2 <= g[1] <= MAX_MODULUS
            and 0 <= g[2] < g[1]
            for g in guided
        )
    )
    if not ok or len({g[0] for g in guided}) != len(guided):
        return f"guided rows are distinct [row, modulus 2 to {MAX_MODULUS}, state < modulus]"
    return None
