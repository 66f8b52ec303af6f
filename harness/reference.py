"""The decoder's dense float64 reference of one step, independent of the runner's kernels,
LoRA plumbing, graphs and attention backends (test code: scenarios and tests use it).

Each token attends to its request's earlier positions, read from the KV cache where earlier
steps (or a seeded fill) put them, and to this step's tokens up to itself, computed here. A
dummy step writes nothing and reads a fresh (zero) cache: its attention adds nothing.
"""

from __future__ import annotations

import torch

from harness.runner.input_batch import Request
from harness.runner.model import EPS
from harness.runner.model_runner import ModelRunner
from kernels.split_kv_attention import split_kv_attention_reference


def _d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().cpu()


class _Host:
    """A model's tensors in float64 on the CPU, each copied once when first read: one
    reference step reads the same weights for every token, and a copy from a GPU waits for it
    (hundreds of small copies were most of a step's reference on a GPU shared by four ranks)."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name: str) -> torch.Tensor:
        host = _d(getattr(self._model, name))
        setattr(self, name, host)
        return host


def slots_of(runner: ModelRunner, requests: list[Request]) -> list[int]:
    """The LoRA slot of each request (-1: base model, or LoRA disabled)."""
    adapters = runner.lora_manager._adapter_manager.lora_index_to_id
    lora = runner.config.lora.enable_lora
    return [adapters.index(q.lora_id) if lora and q.lora_id else -1 for q in requests]


def _lora(x, a, b, slot: int, scale: float) -> torch.Tensor:
    return scale * (x @ a[slot].T) @ b[slot].T


def step_reference(
    runner: ModelRunner, requests: list[Request], dummy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [num_tokens, hidden], logits [num_reqs, vocab]) in float64."""
    model, c = runner.model, runner.model.config
    w = _Host(model)
    slots = slots_of(runner, requests)
    tokens = [t for q in requests for t in q.token_ids]
    token_slots = [s for q, s in zip(requests, slots, strict=True) for _ in q.token_ids]
    h = w.embed[tokens]
    for t, s in enumerate(token_slots):
        if s != -1:
            row = w.embed_a[s * c.vocab_size + tokens[t]]
            h[t] += row @ w.embed_b[0, s].T
    h = h * c.embed_scale  # the config's value, not the runner's live buffer
    width = c.hidden_size // model.LAYER_SLICES
    if not dummy:
        h = h + _attention(runner, 0, h, requests)
    y = h @ w.mlp.T
    for t, s in enumerate(token_slots):
        for k in range(model.LAYER_SLICES if s != -1 else 0):
            lora = _lora(h[t], w.mlp_a[k], w.mlp_b[k], s, c.lora_scale)
            y[t, k * width : (k + 1) * width] += lora
    h = y.relu()
    if not dummy:
        h = h + _attention(runner, 1, h, requests)
    y = torch.zeros_like(h)
    router = model.router.cpu().tolist()
    for t, s in enumerate(token_slots):
        if c.learned_gate:
            y[t] = _gated_experts(c, w, h[t])
            continue
        for e in router[tokens[t]]:
            y[t] += h[t] @ w.experts[e].T
            if s != -1:
                y[t] += _lora(h[t], w.expert_a[:, e], w.expert_b[:, e], s, c.lora_scale)
    h = y.relu()
    last = torch.cumsum(torch.tensor([len(q.token_ids) for q in requests]), 0) - 1
    logits = h[last] @ w.head.T
    for r, s in enumerate(slots):
        if s != -1:
            logits[r] += _lora(h[last[r]], w.head_a[0], w.head_b[0], s, c.lora_scale)
    return h, logits


def _gated_experts(c, w: _Host, h: torch.Tensor) -> torch.Tensor:
    """One token through the learned gate: its softmax's top_k experts (ties: the lowest
    index), each weighted by its probability."""
    probs = (h @ w.gate.T).softmax(-1)
    chosen = sorted(range(c.num_experts), key=lambda e: -probs[e].item())[: c.top_k]
    return sum(probs[e] * (h @ w.experts[e].T) for e in chosen)


def _attention(runner: ModelRunner, i: int, h: torch.Tensor, requests: list[Request]):
    """Layer i's attention output projected back to the hidden size, [num_tokens, hidden]."""
    model, kv, c = runner.model, runner.kv_cache, runner.model.config
    heads, dim = c.num_heads, c.hidden_size // c.num_heads
    normed = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS)
    wq, wk, wv, wo = (_d(w) for w in model.attn[i])
    q, k, v = ((normed @ w.T).view(-1, heads, dim) for w in (wq, wk, wv))
    k_cache = _d(kv.k_caches[i]).reshape(-1, heads, dim)
    v_cache = _d(kv.v_caches[i]).reshape(-1, heads, dim)
    out, start = torch.zeros_like(q), 0
    for row, req in enumerate(requests):
        m, past = len(req.token_ids), req.num_computed_tokens
        cached = [kv.slot(i, row, p) for p in range(past)]
        keys = torch.cat([k_cache[cached], k[start : start + m]])
        values = torch.cat([v_cache[cached], v[start : start + m]])
        for j in range(m):
            window = runner.config.cache.sliding_window or past + j + 1  # 0: no window
            live = slice(max(0, past + j + 1 - window), past + j + 1)
            scores = torch.einsum("hd,phd->hp", q[start + j], keys[live]) * dim**-0.5
            out[start + j] = torch.einsum("hp,phd->hd", scores.softmax(-1), values[live])
        start += m
    return out.reshape(-1, c.hidden_size) @ wo.T


def recomputed_logits(runner: ModelRunner, sequences: list[list[int]]) -> torch.Tensor:
    """[num_sequences, vocab] float64: the logits of each sequence's last token with every
    position recomputed: nothing is read from the KV cache, so a cache that holds wrong bytes
    (a stale block, a discarded one) cannot agree with it."""
    requests = [Request(f"ref{r}", tuple(seq)) for r, seq in enumerate(sequences)]
    return step_reference(runner, requests)[1]


def draft_reference(runner: ModelRunner, hidden_states: torch.Tensor, lens: list[int]):
    """The draft attention of a uniform decode step in float64: split-KV attention over layer
    0's cache with the draft's query (the normalized target hidden state of each request)."""
    kv, c = runner.kv_cache, runner.model.config
    h = _d(hidden_states)
    query = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS)).view(
        len(lens), c.num_heads, -1
    )
    width = max(len(kv.blocks[r][0]) for r in range(len(lens)))
    table = torch.tensor(
        [kv.blocks[r][0] + [0] * (width - len(kv.blocks[r][0])) for r in range(len(lens))]
    )
    scale = (c.hidden_size // c.num_heads) ** -0.5
    return split_kv_attention_reference(
        query, kv.k_caches[0], kv.v_caches[0], table, torch.tensor(lens), scale
    )


def mixer_reference(weights, tokens: list[int]) -> torch.Tensor:
    """A Mamba align-mode mixer's (harness/runner/mamba_align.py) logits after `tokens`, in
    float64, the whole sequence from a zero state (no chunks, no slots)."""
    x = _d(weights.embedding)[torch.tensor(tokens)]  # [n, C]
    conv, decay = _d(weights.conv), _d(weights.decay)
    width = conv.shape[1]
    padded = torch.cat([torch.zeros(width - 1, x.shape[1], dtype=x.dtype), x])
    h = torch.zeros(x.shape[1], dtype=x.dtype)
    for t in range(len(tokens)):
        h = decay * h + (padded[t : t + width].T * conv).sum(1)
    return h @ _d(weights.head)


def conv_state_reference(weights, tokens: list[int]) -> torch.Tensor:
    """A Mamba align-mode mixer's conv state after `tokens` (its last width - 1 inputs, oldest
    first, zeros before the first token), [channels, width - 1] in float64."""
    x = _d(weights.embedding)[torch.tensor(tokens)]  # [n, C]
    window = weights.conv.shape[1] - 1
    padded = torch.cat([torch.zeros(window, x.shape[1], dtype=x.dtype), x])
    return padded[-window:].T
