"""A drafter that writes KV past the sequence in the target's step (DFlash-like parallel
drafting), and the lookahead slots the scheduler allocates for it (upstream: allocate_slots'
num_lookahead_tokens, vllm/v1/core/sched/scheduler.py).

After the target's step, each request's drafter pass runs in the same step: it writes its own
KV layer (a cache of group 0's blocks, beside the target's) at the step's tokens and at k + 1
query positions past the sequence (the bonus token, the target's sampled one, and k mask
tokens), then drafts k tokens at once from every position it wrote, the context's and the
query block's (DFlash's bidirectional block attention, here reduced to the sum of the values:
draft j scores the sum plus mask token j's value through the LM head). Each position's slot
comes from the request's row of the block table. A row is written up to the request's
allocation: its entries past it keep an earlier tenant's block ids (or 0), so a position past
the allocation writes into a block another request may hold, or a prefix-cache entry a later
request hits. Columns past max_model_len's blocks (rows are rounded up to 128 tokens) are no
request's: they hold 0, block 0, a pool block here. The drafter runs only where every
sequence's query block ends within max_model_len.

The scheduler's lookahead: k + 1 slots past the step's tokens, on every step (fix parts
`draft_lookahead_bonus_slot`, vLLM #42971: DFlash's query block is the bonus token and k mask
tokens, not k; `draft_lookahead_on_prefill`, vLLM #43733: a request's first step, a prefill,
keeps its lookahead, which #22317 had dropped for every prefill).
"""

from __future__ import annotations

import torch

from harness.fixes import Fix, Variant
from harness.runner.input_batch import Request
from harness.runner.kv_cache import TAG, KVCache
from harness.runner.model import TinyLoRADecoder
from harness.runner.sleep_mode import TaggedPools
from kernels.paged_attention import reshape_and_cache


def lookahead_slots(num_speculative_tokens: int, first_step: bool, fixes: Variant) -> int:
    """The KV slots past a step's tokens the scheduler allocates for a drafter that writes its
    query block's KV there (upstream: num_lookahead_tokens)."""
    slots = num_speculative_tokens  # EAGLE's count: a draft's KV each
    if Fix.DRAFT_LOOKAHEAD_BONUS_SLOT in fixes:
        # fix: draft_lookahead_bonus_slot -- the bonus token's query writes KV too.
        slots = num_speculative_tokens + 1
    # fix: draft_lookahead_on_prefill -- the drafter runs in a prefill's step too.
    if first_step and Fix.DRAFT_LOOKAHEAD_ON_PREFILL not in fixes:
        slots = 0  # a prefill's lookahead dropped (upstream: #22317's override)
    return slots


def mask_values(k: int, hidden: int) -> torch.Tensor:
    """[k, hidden] float64: the KV of mask token j (position L + 1 + j): j + 1 everywhere."""
    return torch.arange(1, k + 1, dtype=torch.float64)[:, None].expand(k, hidden).clone()


class LookaheadDrafter:
    def __init__(
        self,
        model: TinyLoRADecoder,
        kv_cache: KVCache,
        num_speculative_tokens: int,
        max_model_len: int,
        pools: TaggedPools,
        launch,
    ) -> None:
        if kv_cache.kernel_block_sizes[0] != kv_cache.block_sizes[0]:
            raise ValueError("the lookahead drafter pages group 0 in the manager's blocks")
        self.model, self.kv, self.k, self.launch = model, kv_cache, num_speculative_tokens, launch
        self.max_model_len = max_model_len
        shape = kv_cache.k_caches[0].shape  # [num_blocks, block_size, heads, head_dim]
        # NOTE: the drafter's own KV layer, in group 0's blocks (upstream: the draft model's
        # attention layers share the target's block tables)
        self.k_cache = pools.zeros(TAG, shape, kv_cache.k_caches[0].dtype)
        self.v_cache = pools.zeros(TAG, shape, kv_cache.k_caches[0].dtype)
        self.draft_logits: torch.Tensor | None = None  # [num_reqs, k, vocab], the last step's

    def slots(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        """Each position's slot through request row `row` of group 0's block table."""
        size = self.kv.block_sizes[0]
        table = self.kv.block_tables.block_tables[0][row]
        return table[positions // size].long() * size + positions % size

    def propose(self, requests: list[Request], logits: torch.Tensor) -> torch.Tensor | None:
        """[num_reqs, k] drafts of each request (row r of the batch is request row r), after
        writing its KV; None when the batch cannot take them."""
        longest = max(q.num_computed_tokens + len(q.token_ids) for q in requests)
        if longest + self.k + 1 > self.max_model_len:
            return None
        embed, head, device = self.model.embed, self.model.head, self.model.device
        bonus = logits.argmax(-1)
        masks = mask_values(self.k, embed.shape[1]).to(embed.dtype).to(device)
        scores = []
        for row, q in enumerate(requests):
            end = q.num_computed_tokens + len(q.token_ids)  # the sequence after the step
            tokens = torch.tensor(q.token_ids, device=device)
            values = torch.cat([embed[tokens], embed[bonus[row : row + 1]], masks])
            written = torch.arange(q.num_computed_tokens, end + self.k + 1, device=device)
            kv = values.view(len(written), *self.k_cache.shape[2:]).contiguous()
            self.launch(
                reshape_and_cache, kv, kv, self.k_cache, self.v_cache, self.slots(row, written)
            )
            read = self.slots(row, torch.arange(end + self.k + 1, device=device))
            context = self.v_cache.flatten(0, 1).flatten(1)[read].float().sum(0)
            scores.append((context + masks.float()) @ head.float().T)  # [k, vocab]
        self.draft_logits = torch.stack(scores)
        return self.draft_logits.argmax(-1)

    def dummy_run(self, num_tokens: int = 1) -> None:
        """A dummy run drafts nothing and writes no KV."""
