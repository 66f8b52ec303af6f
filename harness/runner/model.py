"""A tiny seeded decoder with LoRA on its embedding, its MLPs, its experts and its LM head.

embed (+ LoRA: gather A rows at input_ids + embeddings_indices[1][:n], then expand) times the
normalizer -> 2 layers of [h += attention(h), h = MLP(h)] -> logits of the sampled rows
(+ LoRA).
Attention (layer i uses KV-cache group i): q, k, v = rms_norm(h) @ W, K/V written through the
slot mapping, causal attention through the block table (paged; uniform decode batches may use
the split-KV decode backend), h += o @ Wo.T. The attention op is the one piece of device work
a PIECEWISE graph leaves out (`launch.outside_graph`).
Layer 0's MLP: relu(h @ W.T + LoRA) with two LoRA slices (a fused gate|up projection): slice s
adds scale * (h @ A[s].T) @ B[s].T to its half of the columns.
Layer 1's MLP is a mixture of experts: a hash router sends token id t to experts router[t]
(top_k distinct), y = sum over them of h @ E[e].T + scale * (h @ A[lora, e].T) @ B[lora, e].T,
then relu; the expert LoRA runs upstream's way: align per LoRA slot (kernels/moe_lora_align,
CUDA C++ on the GPU, its Triton twin on the CPU), the fused shrink that consumes the align
outputs, an expand. With `learned_gate` (no expert LoRA) a gate routes instead: logits h @ G.T,
softmax top-k (kernels/topk_gate; with `skip_padding` padding rows get expert -1), and
y = sum of weight * h @ E[e].T over expert-sorted rows (kernels/moe_permute: sort, GEMM,
finalize), then relu.
LM head: logits[r] = h[logits_indices[r]] @ head.T + scale * (h @ A.T) @ B.T with the request's
adapter (the punica wrapper's prompt mapping). Base weights and adapters are small integers.
The normalizer is the model's one buffer (`named_buffers`): it lives in the weights pool with
the base weights but is derived from the config, so reload_weights() (the checkpoint) does not
write it.
With `derived_weights` the LM head's GEMM and the embedding's gather read tensors derived from
those parameters by post-load processing (post_load.py), which every reload_weights() re-runs.
Weights, activations and the KV cache are in the runner's dtype (float32, bfloat16 or float16:
kernels accumulate in float32 and round each store once; the LoRA shrink buffers stay float32,
as upstream's). All device work goes through `launch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.runner.cudagraph import Launcher
from harness.runner.flashmla import FlashMLABackend
from harness.runner.input_batch import InputBatch
from harness.runner.kv_cache import AttentionMetadata
from harness.runner.lora import MoEConfig, PunicaWrapper
from harness.runner.post_load import DerivedWeights
from kernels.moe_permute import moe_finalize, moe_permute_experts
from kernels.paged_attention import paged_attention, reshape_and_cache
from kernels.topk_gate import topk_gate

EPS = 1e-6
POISON_ROW = 2**31 - 1  # an expert-sorted row no sort writes: far past any buffer
# the runner's dtypes, by torch's names (harness.record.DTYPES, for the CLI, is the same tuple).
# Not float16: the integer weights put LoRA logits past its largest value (65504)
DTYPES = ("float32", "bfloat16")


def model_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: the runner runs in {', '.join(DTYPES)}")
    return getattr(torch, name)


def gate_clamps(fixes: Variant) -> bool:
    """The top-k gate's switch (clamp_nonfinite), the one translation of its fix part: the
    runner's launch and the kernel-level scenarios and probes all read it."""
    return Fix.MOE_GATE_NAN_CLAMP in fixes  # fix: moe_gate_nan_clamp


def finalize_skips(fixes: Variant) -> bool:
    """The MoE finalize's switch (skip_invalid), the one translation of its fix part."""
    return Fix.MOE_PAD_SENTINEL_GUARD in fixes  # fix: moe_pad_sentinel_guard


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    max_loras: int = 2
    max_lora_rank: int = 16
    lora_scale: float = 2.0
    num_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    seed: int = 0
    # the embedding's normalizer (Gemma: sqrt(hidden_size)), a buffer, not a checkpoint
    # parameter; 1.0 leaves every output as it was before the normalizer existed
    embed_scale: float = 1.0
    learned_gate: bool = False  # the MoE routes by a learned gate, not by token id
    skip_padding: bool = False  # the gate marks padding rows -1 (upstream VLLM_MOE_SKIP_PADDING)
    # post-load processing derives the LM head's transpose and a float32 embedding table, which
    # the forward reads instead of the parameters (post_load.py; vLLM #48251)
    derived_weights: bool = False


def _ints(gen: torch.Generator, *shape: int, low: int = -1, high: int = 2) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen).float()


def rms_norm(x: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(x, torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS), out=out)


class TinyLoRADecoder:
    # NOTE: LoRA layers by prefix; the runner maps each prefix to a punica wrapper.
    PREFIXES = ("model.embed_tokens", "model.layers.0.mlp", "model.layers.1.experts", "lm_head")
    LAYER_SLICES = 2

    def __init__(
        self,
        config: ModelConfig,
        device: str,
        place: Callable[[torch.Tensor], torch.Tensor] | None = None,
        dtype: str = "float32",
    ) -> None:
        """`place` puts a base weight where it lives (default: on `device`)."""
        c = config
        self.config, self.device, self.dtype = config, device, model_dtype(dtype)
        place = place or (lambda t: t.to(device))
        weights = self._seeded_weights()
        self.embed, self.head = place(weights["embed"]), place(weights["head"])
        self.mlp, self.experts = place(weights["mlp"]), place(weights["experts"])
        self.router = weights["router"].to(device)  # [vocab, top_k] int32
        self.normalizer = place(torch.tensor([c.embed_scale], dtype=self.dtype))  # [1]
        self.attn = [[place(w) for w in ws] for ws in weights["attn"]]  # per layer q, k, v, o
        self.gate = place(weights["gate"]) if c.learned_gate else None  # [experts, hidden]
        self.checkpoint_seed = c.seed  # the checkpoint reload_weights() writes
        self.derived = DerivedWeights(self.head, self.embed, place) if c.derived_weights else None
        self.fixes: Variant = ALL_FIXES  # set by the runner: the variant's fix parts
        self.decode_backend: FlashMLABackend | None = None  # set by the runner's config
        self.moe = MoEConfig()  # set by the runner: align backend and fix switches
        self.cache_write_warps = 4  # the KV-cache write's launch config (the runner tunes it)
        zeros = lambda *shape: torch.zeros(*shape, dtype=self.dtype, device=device)
        # LoRA weights stacked per slice (or expert) and slot, filled in place by load_lora
        k, width, r = self.LAYER_SLICES, c.hidden_size // self.LAYER_SLICES, c.max_lora_rank
        L, E, H = c.max_loras, c.num_experts, c.hidden_size
        self.embed_a = zeros(L * c.vocab_size, r)  # [L * vocab, rank]
        self.embed_b = zeros(1, L, H, r)
        self.mlp_a, self.mlp_b = zeros(k, L, r, H), zeros(k, L, width, r)
        self.expert_a, self.expert_b = zeros(L, E, r, H), zeros(L, E, H, r)
        self.head_a, self.head_b = zeros(1, L, r, H), zeros(1, L, c.vocab_size, r)
        self.adapter_enabled = torch.ones(L + 1, dtype=torch.int32, device=device)

    def _seeded_weights(self, seed: int | None = None) -> dict:
        c = self.config
        gen = torch.Generator().manual_seed(c.seed if seed is None else seed)
        embed = _ints(gen, c.vocab_size, c.hidden_size)
        mlp = _ints(gen, c.hidden_size, c.hidden_size)
        experts = _ints(gen, c.num_experts, c.hidden_size, c.hidden_size)
        head = _ints(gen, c.vocab_size, c.hidden_size)
        attn = [
            [
                (torch.randn(c.hidden_size, c.hidden_size, generator=gen) * 0.25).to(self.dtype)
                for _ in range(4)
            ]
            for _ in range(2)
        ]
        router = torch.stack(
            [torch.randperm(c.num_experts, generator=gen)[: c.top_k] for _ in range(c.vocab_size)]
        ).to(torch.int32)
        gate = _ints(gen, c.num_experts, c.hidden_size)  # drawn last: the others stay as they were
        return {
            "embed": embed.to(self.dtype),
            "mlp": mlp.to(self.dtype),
            "experts": experts.to(self.dtype),
            "head": head.to(self.dtype),
            "attn": attn,
            "router": router,
            "gate": gate.to(self.dtype),
        }

    def reload_weights(self, seed: int | None = None) -> None:
        """Write the checkpoint's base weights again, in place (after their memory was
        discarded), then run the post-load processing. `seed`: a new checkpoint (a trainer's
        weight update), which later reloads write too."""
        if seed is not None:
            self.checkpoint_seed = seed
        weights = self._seeded_weights(self.checkpoint_seed)
        for name in ("embed", "head", "mlp", "experts", "gate"):
            if getattr(self, name) is not None:
                getattr(self, name).copy_(weights[name])
        for mine, fresh in zip(self.attn, weights["attn"], strict=True):
            for w, f in zip(mine, fresh, strict=True):
                w.copy_(f)
        if self.derived is not None:
            self.derived.refresh(self.head, self.embed, self.fixes)

    def named_buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers: state the forward reads that is no checkpoint parameter."""
        return {"normalizer": self.normalizer}

    def load_lora(self, slot: int, seed: int, experts: bool = True) -> None:
        """Write a seeded adapter into `slot` of every stacked LoRA tensor. `experts=False`: an
        adapter without expert weights: the slot's expert LoRA is zeroed and disabled
        (adapter_enabled 0), so the expert align and its consumers skip it."""
        c, gen = self.config, torch.Generator().manual_seed(seed)
        rows = slice(slot * c.vocab_size, (slot + 1) * c.vocab_size)
        self.embed_a[rows] = _ints(gen, c.vocab_size, c.max_lora_rank).to(self.device)
        self.embed_b[0, slot] = _ints(gen, c.hidden_size, c.max_lora_rank).to(self.device)
        for a, b in ((self.mlp_a, self.mlp_b), (self.head_a, self.head_b)):
            a[:, slot] = _ints(gen, *a[:, slot].shape).to(self.device)
            b[:, slot] = _ints(gen, *b[:, slot].shape).to(self.device)
        expert_a = _ints(gen, *self.expert_a[slot].shape).to(self.device)
        expert_b = _ints(gen, *self.expert_b[slot].shape).to(self.device)
        self.expert_a[slot] = expert_a if experts else 0.0
        self.expert_b[slot] = expert_b if experts else 0.0
        self.adapter_enabled[slot] = int(experts)

    def reset_lora(self, slot: int) -> None:
        """An evicted adapter's slot: every stacked LoRA tensor's rows zeroed, disabled."""
        c = self.config
        self.embed_a[slot * c.vocab_size : (slot + 1) * c.vocab_size] = 0.0
        self.embed_b[0, slot] = 0.0
        for t in (self.mlp_a, self.mlp_b, self.head_a, self.head_b):
            t[:, slot] = 0.0
        self.expert_a[slot], self.expert_b[slot] = 0.0, 0.0
        self.adapter_enabled[slot] = 0

    def forward(
        self,
        batch: InputBatch,
        attn: AttentionMetadata,
        wrappers: list[PunicaWrapper] | None,
        launch: Launcher,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [num_tokens, hidden], logits [num_reqs, vocab]) of the padded batch;
        wrappers[i] serves PREFIXES[i] (None: no LoRA)."""
        c = self.config
        h = self._embed(batch.input_ids, wrappers, launch)
        h = self._mlp(self._attention(0, h, attn, launch), wrappers, launch)
        h = self._moe(self._attention(1, h, attn, launch), batch, wrappers, launch)
        rows = batch.logits_indices.shape[0]
        sample = torch.empty(rows, c.hidden_size, dtype=self.dtype, device=self.device)
        launch(torch.index_select, h, 0, batch.logits_indices, out=sample)
        logits = torch.empty(rows, c.vocab_size, dtype=self.dtype, device=self.device)
        head_t = self.head.T if self.derived is None else self.derived.tensors["head_t"]
        launch(torch.mm, sample, head_t, out=logits)
        if wrappers is not None:
            buffer = torch.empty(1, rows, c.max_lora_rank, device=self.device)
            wrappers[3].add_lora_logits(
                logits, sample, self.head_a, self.head_b, c.lora_scale, buffer, launch
            )
        return h, logits

    def _embed(self, input_ids, wrappers, launch: Launcher) -> torch.Tensor:
        c, n = self.config, input_ids.shape[0]
        h = torch.empty(n, c.hidden_size, dtype=self.dtype, device=self.device)
        embed = self.embed if self.derived is None else self.derived.tensors["embed_f32"]
        if wrappers is None:
            launch(_embed_base, input_ids, embed, h)
        else:
            a_rows = torch.empty(1, n, c.max_lora_rank, dtype=self.dtype, device=self.device)
            offsets = wrappers[0].embeddings_indices[1, :n]
            launch(_embed, input_ids, offsets, embed, self.embed_a, h, a_rows)
            wrappers[0].add_lora_embedding(h, a_rows, self.embed_b, launch)
        launch(torch.mul, h, self.normalizer, out=h)
        return h

    def _mlp(self, h, wrappers, launch: Launcher) -> torch.Tensor:
        c, n = self.config, h.shape[0]
        y = torch.empty(n, c.hidden_size, dtype=self.dtype, device=self.device)
        launch(torch.mm, h, self.mlp.T, out=y)
        if wrappers is not None:
            buffer = torch.empty(self.LAYER_SLICES, n, c.max_lora_rank, device=self.device)
            wrappers[1].add_lora_linear(y, h, self.mlp_a, self.mlp_b, c.lora_scale, buffer, launch)
        launch(torch.relu_, y)
        return y

    def _moe(self, h, batch: InputBatch, wrappers, launch: Launcher) -> torch.Tensor:
        c, n = self.config, h.shape[0]
        if c.learned_gate:
            if wrappers is not None:
                raise ValueError("the learned gate serves no expert LoRA: enable_lora=False")
            y = self._gated_experts(h, batch, launch)
            launch(torch.relu_, y)
            return y
        topk_ids = torch.empty(n, c.top_k, dtype=torch.int32, device=self.device)
        launch(torch.index_select, self.router, 0, batch.input_ids, out=topk_ids)
        y = torch.empty(n, c.hidden_size, dtype=self.dtype, device=self.device)
        launch(_experts, h, self.experts, topk_ids, y)
        if wrappers is not None:
            wrappers[2].add_lora_fused_moe(
                y,
                h,
                topk_ids,
                self.expert_a,
                self.expert_b,
                c.lora_scale,
                self.adapter_enabled,
                self.moe,
                launch,
            )
        launch(torch.relu_, y)
        return y

    def _gated_experts(self, h, batch: InputBatch, launch: Launcher) -> torch.Tensor:
        """Route by the gate's softmax top-k, then the experts over expert-sorted rows."""
        c, n = self.config, h.shape[0]
        logits = torch.empty(n, c.num_experts, dtype=self.dtype, device=self.device)
        launch(torch.mm, h, self.gate.T, out=logits)
        topk_ids = torch.empty(n, c.top_k, dtype=torch.int32, device=self.device)
        topk_weights = torch.empty(n, c.top_k, device=self.device)
        # padding rows: from the live step's real token count (a graph replay reads it)
        padding = batch.query_start_loc[-1:] if c.skip_padding else None
        clamp = gate_clamps(self.fixes)  # fix: moe_gate_nan_clamp
        launch(topk_gate, logits, topk_ids, topk_weights, padding, clamp_nonfinite=clamp)
        # NOTE: upstream's workspace is empty memory; poisoned here on purpose (int32 max: a
        # row far past any buffer), so an entry the sort never writes reads the same each run
        rows = torch.full((n * c.top_k,), POISON_ROW, dtype=torch.int32, device=self.device)
        permuted = torch.empty(n * c.top_k, c.hidden_size, dtype=self.dtype, device=self.device)
        launch(moe_permute_experts, h, self.experts, topk_ids, permuted, rows)
        y = torch.empty(n, c.hidden_size, dtype=self.dtype, device=self.device)
        skip = finalize_skips(self.fixes)  # fix: moe_pad_sentinel_guard
        args = (permuted, rows, topk_ids, topk_weights, y, c.num_experts)
        launch(moe_finalize, *args, skip_invalid=skip)
        return y

    def _attention(self, i: int, h, attn: AttentionMetadata, launch: Launcher) -> torch.Tensor:
        c, n = self.config, h.shape[0]
        heads, dim = c.num_heads, c.hidden_size // c.num_heads
        normed = torch.empty(n, c.hidden_size, dtype=self.dtype, device=self.device)
        launch(rms_norm, h, normed)
        q, k, v = (
            torch.empty(n, heads, dim, dtype=self.dtype, device=self.device) for _ in range(3)
        )
        # NOTE: attention writes the rows of real tokens only (attn.num_actual_tokens); upstream
        # leaves the padding rows empty memory, NaN in nearly every padded step it measured
        # (vLLM #39593): poisoned here on purpose, NaN
        o = torch.full((n, heads, dim), float("nan"), dtype=self.dtype, device=self.device)
        wq, wk, wv, wo = self.attn[i]
        for out, w in ((q, wq), (k, wk), (v, wv)):
            launch(torch.mm, normed, w.T, out=out.view(n, c.hidden_size))
        launch.outside_graph(self.attention_op, i, q, k, v, o, attn, launch)
        out = torch.empty(n, c.hidden_size, dtype=self.dtype, device=self.device)
        launch(torch.addmm, h, o.view(n, c.hidden_size), wo.T, out=out)
        return out

    def attention_op(self, i, q, k, v, o, attn: AttentionMetadata, launch: Launcher) -> None:
        """Cache this step's K/V, then attend: the split-KV backend for uniform decode
        batches when the runner has one, paged causal attention otherwise."""
        k_cache, v_cache = attn.k_caches[i], attn.v_caches[i]
        slots = attn.slot_mappings[i]
        launch(reshape_and_cache, k, v, k_cache, v_cache, slots, self.cache_write_warps)
        scale = (self.config.hidden_size // self.config.num_heads) ** -0.5
        table = attn.block_tables[i]
        if self.decode_backend is not None and attn.uniform_decode:
            self.decode_backend.forward(
                attn.sched, q, k_cache, v_cache, table, attn.seq_lens, o, scale, launch
            )
            return
        # NOTE: max_model_len bounds the kernel's loop (a constexpr), not the live lengths
        real = slice(0, attn.num_actual_tokens)  # upstream: FlashAttention's num_actual_tokens
        launch(
            paged_attention,
            q[real],
            k_cache,
            v_cache,
            table,
            attn.token_rows[real],
            attn.positions[real],
            o[real],
            scale,
            attn.max_model_len,
            block_size=attn.block_sizes[i],
            window=attn.window,
        )


def _experts(h, experts, topk_ids, y) -> None:
    """y[t] = sum over t's experts e of h[t] @ experts[e].T."""
    y.copy_(torch.einsum("th,tkoh->to", h, experts[topk_ids.long()]))


def _embed_base(input_ids, weight, h) -> None:
    h.copy_(F.embedding(input_ids, weight))


def _embed(input_ids, offsets, weight, lora_a_2d, h, a_rows) -> None:
    """Base rows, and the LoRA-A rows at input_ids + offsets (a bad offset fails the gather:
    a device-side assert on the GPU, IndexError on the CPU)."""
    h.copy_(F.embedding(input_ids, weight))
    a_rows[0].copy_(F.embedding(input_ids + offsets, lora_a_2d))
