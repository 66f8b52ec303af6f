"""A Mamba layer's prefix caching in "align" mode (upstream: mamba_cache_mode="align"), with
the scheduler's chunked prefill that must keep it consistent.

The layer (`MambaMixer`): each token's embedding through a causal convolution of width
WINDOW + 1 (a Triton kernel, kernels/causal_conv1d.py; its conv state: the last WINDOW inputs)
and a decaying linear recurrence (its ssm state); a request's logits are the recurrence's last
value through a head. A chunk of a prefill starts from the state at its first token, read from
one slot, and ends with the state at its last, written to the entry of its last token (another
slot when the chunk starts at a block boundary: a cached prefix block is read, not written;
vLLM #56196's kernel wrote a chunk shorter than the conv state back where it read it).

The state group (`AlignStates`): slots of state, a request's block-table entry p for its tokens
[p * block, (p + 1) * block). A chunk reads its initial state from the entry holding its start
and writes its final state into the entry holding its last token (a new slot when that entry
has none: the entries it skipped stay null). After the step, every entry of a whole block the
request has passed is hashed (upstream: MambaManager.cache_blocks) as the state at exactly
(p + 1) * block tokens; a later request whose prompt shares those tokens resumes from that slot.
The hash is only true when the chunk that wrote the entry ended on the block's boundary: the
scheduler's split (`aligned_split`, upstream: Scheduler._mamba_block_aligned_split) keeps chunk
ends there. With EAGLE the last cacheable position is backed off by one block; past it the
unfixed split accepts any chunk end (vLLM #51113).

`MambaAlignEngine` runs waves of requests: each wave's prefills share one token budget per step
(chunked prefill, first come first served), each request admitted with its prefix hit. A
request a wave keeps (not finished) goes on in a later wave with a longer prompt from where it
stopped (a multi-turn session's next turn): when its prompt ended mid-block, its next chunk
resumes mid-block from the state its own entry holds, the engine's one way to the mid-block
starts that upstream's finer prefix hits make.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.runner.kv_cache import block_hashes
from harness.runner.mamba import WINDOW
from kernels.causal_conv1d import STATE_LEN, causal_conv1d

assert WINDOW == STATE_LEN, "the conv state the kernel keeps is mamba.py's window"
POISON = float("nan")  # a slot no chunk wrote: NaN wherever it is read


def aligned_split(
    start: int,
    num_new: int,
    num_tokens: int,
    block: int,
    eagle: bool,
    fixes: Variant = ALL_FIXES,
) -> int:
    """How many of `num_new` tokens (what the budget allows) a prefill at `start` of a prompt of
    `num_tokens` schedules this step, so that the Mamba states its chunks leave are the ones
    their block-table entries will be hashed as; 0: none this step (deferred)."""
    last_cache = num_tokens - num_tokens % block
    if eagle:  # full attention prunes its last hit block: the last chunk keeps a whole block
        last_cache = max(last_cache - block, 0)
    end = start + num_new
    if end < last_cache:
        end = start + num_new // block * block
    elif start < last_cache < end:
        end = last_cache  # the last cacheable state is written
    # else: past the last cacheable position, the chunk the budget cut
    if Fix.MAMBA_ALIGN_PAST_LAST_CACHE in fixes and end < num_tokens:
        # fix: mamba_align_past_last_cache -- past the last cacheable position too, no chunk
        # but the prompt's last ends mid-block (else deferred): its entry would be passed
        end = max(end // block * block, start)
    if Fix.MAMBA_ALIGN_PAST_LAST_CACHE in fixes and start % block:
        # fix: mamba_align_past_last_cache -- a chunk resuming mid-block (a hit finer than a
        # block upstream) stops at its block's end: that entry's state is the boundary's
        end = min(end, (start // block + 1) * block)
    return end - start


@dataclass(frozen=True, slots=True)
class MixerWeights:
    embedding: torch.Tensor  # [vocab, channels]
    conv: torch.Tensor  # [channels, WINDOW + 1], the last column weighs the current token
    decay: torch.Tensor  # [channels], in (0, 1)
    head: torch.Tensor  # [channels, vocab]


def mixer_weights(vocab: int, channels: int, device: str, seed: int = 0) -> MixerWeights:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    decay = 0.5 + 0.4 * torch.rand(channels, generator=gen)
    weights = (rand(vocab, channels), rand(channels, WINDOW + 1), decay, rand(channels, vocab))
    return MixerWeights(*(w.to(device) for w in weights))


class AlignStates:
    """The state group's slots, the requests' block-table entries into them, and the prefix
    cache of whole blocks (hash of the tokens up to a boundary -> the slot of its state)."""

    def __init__(self, num_slots: int, channels: int, block: int, device: str) -> None:
        self.block = block
        self.conv = torch.full((num_slots, channels, WINDOW), POISON, device=device)
        self.ssm = torch.full((num_slots, channels), POISON, device=device)
        self.free = list(range(num_slots - 1, -1, -1))  # allocation pops the end: slot 0 first
        self.cached: dict[int, int] = {}  # hash -> slot
        self.hashed: set[int] = set()  # slots in the prefix cache (never freed)
        self.entries: dict[str, list[int | None]] = {}  # request -> slot per block (None: null)

    def admit(self, req: str, tokens: Sequence[int]) -> int:
        """A new request: its longest cached prefix of whole blocks (never its last token),
        whose last entry is the cached slot (the earlier ones null); returns its length."""
        hits = 0
        for i, h in enumerate(block_hashes(tokens[: len(tokens) - 1], self.block)):
            if h in self.cached:
                hits = i + 1  # align mode: a hit needs the state at its end only
        hashes = block_hashes(tokens, self.block)[:hits]
        self.entries[req] = [None] * hits
        if hits:
            self.entries[req][-1] = self.cached[hashes[-1]]
        return hits * self.block

    def initial(self, req: str, start: int) -> int | None:
        """The slot holding the state at `start` (None: a fresh start, zero state)."""
        return None if start == 0 else self.entries[req][(start - 1) // self.block]

    def final(self, req: str, end: int) -> int:
        """The slot the state at `end` is written to: the entry of the chunk's last token."""
        entries, p = self.entries[req], (end - 1) // self.block
        entries.extend([None] * (p + 1 - len(entries)))
        if entries[p] is None:
            entries[p] = self.free.pop()
        return entries[p]

    def cache_blocks(self, req: str, tokens: Sequence[int], num_computed: int) -> None:
        """Hash every entry of a whole block the request has passed as the state at its end."""
        entries = self.entries[req]
        for p, h in enumerate(block_hashes(tokens[:num_computed], self.block)):
            slot = entries[p]
            if slot is not None and slot not in self.hashed and h not in self.cached:
                self.cached[h] = slot
                self.hashed.add(slot)

    def finish(self, req: str) -> None:
        """A finished request's slots go back to the free list, cached ones stay cached."""
        for slot in self.entries.pop(req):
            if slot is not None and slot not in self.hashed:
                self.free.append(slot)


class MambaMixer:
    """The layer on one request's chunk, from the state in one slot to the state in another."""

    def __init__(self, weights: MixerWeights, states: AlignStates, fixes: Variant) -> None:
        self.w, self.states, self.fixes = weights, states, fixes

    def forward(self, tokens: Sequence[int], src: int | None, dst: int) -> torch.Tensor:
        """Run `tokens` from the state in slot `src` (None: zero), leave the state in slot
        `dst`; returns the last token's logits. The convolution is a Triton kernel
        (kernels/causal_conv1d.py), the recurrence torch."""
        w, s, device = self.w, self.states, self.w.embedding.device
        x = w.embedding[torch.tensor(list(tokens), device=device)].contiguous()  # [n, C]
        u = torch.empty_like(x)
        slots = lambda slot: torch.tensor([slot], dtype=torch.int32, device=device)
        bounds = torch.tensor([0, len(tokens)], dtype=torch.int32, device=device)
        initial = slots(-1 if src is None else src)
        # fix: conv_state_short_chunk -- a chunk shorter than the conv state stores it in its
        # own slot too
        own_block = Fix.CONV_STATE_OWN_BLOCK in self.fixes
        causal_conv1d(x, w.conv, s.conv, bounds, initial, slots(dst), u, own_block=own_block)
        h = torch.zeros_like(s.ssm[dst]) if src is None else s.ssm[src].clone()
        for t in range(u.shape[0]):
            h = w.decay * h + u[t]
        s.ssm[dst] = h
        return h @ w.head


@dataclass(frozen=True, slots=True)
class Chunk:
    """One request's chunk of one step."""

    req: str
    start: int
    end: int
    slot: int  # where the chunk wrote its final state


class MambaAlignEngine:
    """Waves of prefills over one align-mode state group; each step's token budget is shared by
    the wave's unfinished requests in order."""

    def __init__(
        self,
        device: str,
        fixes: Variant = ALL_FIXES,
        *,
        block: int = 8,
        budget: int = 16,
        eagle: bool = True,
        vocab: int = 16,
        channels: int = 4,
        num_slots: int = 32,
        seed: int = 0,
    ) -> None:
        self.block, self.budget, self.eagle, self.fixes = block, budget, eagle, fixes
        self.weights = mixer_weights(vocab, channels, device, seed)
        self.states = AlignStates(num_slots, channels, block, device)
        self.mixer = MambaMixer(self.weights, self.states, fixes)
        self.chunks: list[list[Chunk]] = []  # every step's chunks, for reports
        self.kept: dict[str, list[int]] = {}  # requests kept after their wave: tokens computed

    def prefill(
        self, prompts: dict[str, Sequence[int]], keep: bool = False
    ) -> dict[str, tuple[int, torch.Tensor]]:
        """Admit `prompts` together and prefill them to their ends: each one's prefix hit (a
        kept request: where it stopped) and its last token's logits. `keep`: the requests stay
        (their entries held) for a later wave that extends their prompts."""
        states, done = self.states, {}
        computed = {}
        for req, tokens in prompts.items():
            if req in self.kept:
                before = self.kept.pop(req)
                assert list(tokens[: len(before)]) == before, f"{req}: not a continuation"
                computed[req] = len(before)
            else:
                computed[req] = states.admit(req, tokens)
        hits = dict(computed)
        while len(done) < len(prompts):
            left, step = self.budget, []
            for req, tokens in prompts.items():
                start = computed[req]
                if req in done or left == 0:
                    continue
                want = min(left, len(tokens) - start)
                n = aligned_split(start, want, len(tokens), self.block, self.eagle, self.fixes)
                if n == 0:
                    continue
                end = start + n
                src, dst = states.initial(req, start), states.final(req, end)
                logits = self.mixer.forward(tokens[start:end], src, dst)
                computed[req], left = end, left - n
                step.append(Chunk(req, start, end, dst))
                if end == len(tokens):
                    done[req] = (hits[req], logits)
            if not step:
                raise RuntimeError(f"no request could be scheduled: computed {computed}")
            for chunk in step:
                states.cache_blocks(chunk.req, prompts[chunk.req], computed[chunk.req])
            self.chunks.append(step)
        for req, tokens in prompts.items():
            if keep:
                self.kept[req] = list(tokens)
            else:
                states.finish(req)
        return done
