"""The miniature Model Runner V2: execute_model (real and dummy runs), capture_model, and
greedy generation over the paged KV cache.

The dummy branch's LoRA state (`_set_dummy_lora_state`) is where the fix parts of vLLM #43139
and #43314 live; capture_model sets it once per LoRA capture case (upstream's LoRA capture
hook) and then captures every descriptor on that state, without re-running the dummy branch.
post_kv_cache_wake_up is where the fix part of vLLM #40648 lives; the graph manager's capture
holds the one of vLLM #42444. The cache-only layer (extract_hidden_states.py, vLLM #43869) and
the speculator's draft prefill (speculator.py, vLLM #39773) hold theirs; the LoRA model
manager's mapping memo (lora.py) holds vLLM #47725's, which the per-step activation of the
batch's adapters (`_activate_adapters`) and an adapter added between steps exercise. Async
scheduling's sampling (async_output.py, on streams.py's copy stream; `execute_model_async`)
holds those of vLLM #25279 and #29623. Under data parallelism (RunnerConfig.parallel, the
collectives of parallel.py) every step, dummy runs included, first agrees with the other DP
ranks on each rank's token count (upstream: coordinate_batch_across_dp); the fix part of vLLM
#28774 keeps a rank with zero scheduled tokens in that agreement. A verify step of speculative
decoding (execute_spec_step) draws its acceptance uniforms from the runner's sampling generator,
whose seed holds the fix part of vLLM #17929 (an unset seed is 0 on every tensor-parallel rank).
A drafter (drafter.py) agrees on each draft step's batch too; vLLM #40589's fix part keeps a
rank whose batch cannot take its drafts near max_model_len in those agreements. A parallel
drafter (lookahead.py) writes KV past each sequence in the step: the step first sets each
row's lookahead slots (`_set_lookahead`, vLLM #42971's and #43733's fix parts). A step given
the scheduler's grammar bitmask masks the guided requests' logits (structured_output.py, vLLM
#22896's and #22963's fix parts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from functools import partial

import torch

from harness.fixes import ALL_FIXES, Fix, Variant
from harness.runner.async_inputs import PrevSampled
from harness.runner.async_output import AsyncOutput, async_sampling
from harness.runner.cudagraph import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    CUDAGraphMode,
    GraphPool,
    Launcher,
    host_sync,
)
from harness.runner.drafter import Drafter
from harness.runner.extract_hidden_states import CacheOnlyLayer
from harness.runner.flashmla import DraftAttention, DraftInputs, FlashMLABackend, FlashMLASchedMeta
from harness.runner.input_batch import (
    InputBatch,
    InputBuffers,
    Request,
    SamplingStates,
    decode_first_swaps,
)
from harness.runner.kv_cache import AttentionMetadata, KVCache
from harness.runner.kv_offload import CPUOffloadConnector
from harness.runner.lookahead import LookaheadDrafter, lookahead_slots
from harness.runner.lora import (
    LoRAManager,
    LoRAMapping,
    LoRAModelManager,
    PunicaWrapper,
    moe_config,
)
from harness.runner.mamba import update_conv_state
from harness.runner.model import ModelConfig, TinyLoRADecoder, rms_norm
from harness.runner.parallel import Collectives, ParallelConfig
from harness.runner.rejection_sampler import SpecStep, rejection_sample
from harness.runner.sleep_mode import TaggedPools, make_pools
from harness.runner.speculator import DraftPrefill
from harness.runner.structured_output import GrammarOutput, StructuredOutputsWorker
from kernels.paged_attention import reshape_and_cache, zero_kv_blocks

FULL, PIECEWISE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The KV cache: its groups, blocks and what may share or skip them."""

    block_sizes: tuple[int, ...] = (4, 16)  # one KV-cache group per layer (the KV manager's)
    # per group, the attention kernel's block size, dividing the manager's (upstream: chosen
    # from the backends' supported sizes when the manager's is not one, as for hybrid models)
    kernel_block_sizes: tuple[int, ...] = ()
    num_kv_blocks: int = 64  # per group
    enable_prefix_caching: bool = False  # generate() reuses cached blocks of a prompt's prefix
    hybrid: bool = False  # a Mamba-like state group shares group 0's blocks (mamba.py)
    sliding_window: int = 0  # attention over the last tokens only (the paged kernel's window)
    # a CPU tier of this many blocks (kv_offload.py; 0: none), its stores issued in the step
    # that fills the blocks, or at the start of the next one
    cpu_offload_blocks: int = 0
    offload_store_next_step: bool = False
    # the host a step ahead of the device (async scheduling's overlap, for the CPU tier): a
    # step's output is waited for once the next step is launched (kv_offload.py)
    offload_host_ahead: bool = False


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """The attention backend of decode steps, and what it asks of the batch."""

    decode_backend: str = "paged"  # "flashmla": split-KV for uniform decode, planned lazily;
    # "trtllm": the same, loading whole KV pages (unused slots weighted 0), as TRTLLM's does
    num_splits: int = 4  # split-KV work partitions
    # decodes before prefills, by row swaps (backends that split them: MLA, FlashInfer)
    reorder_batch: bool = False


@dataclass(frozen=True, slots=True)
class GraphConfig:
    """CUDA graphs (upstream: the compilation config's)."""

    cudagraph_mode: CUDAGraphMode = FULL
    cudagraph_sizes: tuple[int, ...] = (4, 8, 16)
    # the block-table gather and slot mappings run in the forward, so graphs hold them (and the
    # layout tensors' addresses), as upstream's fused draft decode graph does (vLLM #46849)
    tables_in_graph: bool = False


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    enable_lora: bool = True
    specialize_active_lora: bool = False  # one graph per active-LoRA count (upstream's flag)


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """A speculator, and the readers of the target's hidden states."""

    draft_attention: bool = False  # a speculator's draft attention on the captured states
    # a speculator's draft prefill gathers each request's last hidden state (speculator.py)
    draft_prefill: bool = False
    # the draft prefill in graphs of its own, replayed after the target's (upstream: the padded
    # drafter's), and every graph's outputs in one shared pool (cudagraph.GraphPool)
    draft_graphs: bool = False
    # a cache-only layer stores each token's hidden state (extract_hidden_states.py)
    extract_hidden_states: bool = False
    # drafts verified by rejection sampling (rejection_sampler.py: execute_spec_step), each
    # step's acceptance drawn from the runner's sampling generator
    rejection_sampling: bool = False
    # a drafter's tokens per request after each step (drafter.py; 0: none)
    num_speculative_tokens: int = 0
    # the drafter writes its own KV at the step's tokens and k + 1 positions past them in the
    # target's step (lookahead.py: DFlash-like parallel drafting), in lookahead slots
    parallel_drafting: bool = False


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Async scheduling (async_output.py: execute_model_async): sampling on a copy stream that
    runs late with `stream_delay` (streams.py: the order a race loses)."""

    async_output: bool = False
    stream_delay: bool = False
    # with stream_delay, async sampling's late stream: "copy", or "main" (the device behind the
    # host: a copy's wait is met before the main stream's later work reaches the device)
    late_stream: str = "copy"


# each group's field -> the group (runner_config's flat keywords, vLLM's EngineArgs to its config)
GROUPS = {
    "cache": CacheConfig,
    "attention": AttentionConfig,
    "graphs": GraphConfig,
    "lora": LoRAConfig,
    "spec": SpecConfig,
    "scheduler": SchedulerConfig,
}


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """The runner's configuration, grouped by concern as vLLM's is: the model, the batch's
    limits and the sampling outputs here; the cache, attention, graphs, LoRA, speculator and
    scheduler each in a group. `runner_config` builds one from flat keywords."""

    device: str
    fixes: Variant = ALL_FIXES
    model: ModelConfig = field(default_factory=ModelConfig)
    dtype: str = "float32"  # weights, activations and KV cache (harness.runner.model.DTYPES)
    max_num_tokens: int = 32
    max_num_reqs: int = 8
    max_model_len: int = 32
    prompt_logprobs: bool = False  # each step's log-softmax of every token's logits
    # the engine's seed of its sampling (upstream: ModelConfig.seed); None: unset
    seed: int | None = None
    cache: CacheConfig = CacheConfig()
    attention: AttentionConfig = AttentionConfig()
    graphs: GraphConfig = GraphConfig()
    lora: LoRAConfig = LoRAConfig()
    spec: SpecConfig = SpecConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    # this rank's place among ranks (parallel.py; frozen, so one default instance is safe)
    parallel: ParallelConfig = ParallelConfig()  # noqa: RUF009


_GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}


def updated(config: RunnerConfig, **flat) -> RunnerConfig:
    """`config` with each flat keyword set in its group (a top-level field: in place)."""
    unknown = set(flat) - set(_GROUP_OF) - {f.name for f in fields(RunnerConfig)}
    if unknown:
        raise TypeError(f"RunnerConfig has no field {', '.join(sorted(unknown))}")
    top = {k: v for k, v in flat.items() if k not in _GROUP_OF}
    for group in GROUPS:
        mine = {k: v for k, v in flat.items() if _GROUP_OF.get(k) == group}
        if mine:
            top[group] = replace(top.get(group, getattr(config, group)), **mine)
    return replace(config, **top)


def runner_config(device: str, fixes: Variant = ALL_FIXES, **flat) -> RunnerConfig:
    """A RunnerConfig from flat keywords, each to its group (`runner_config("cpu",
    cudagraph_mode=FULL, enable_lora=False)`), as vLLM's EngineArgs make its config."""
    return updated(RunnerConfig(device, fixes), **flat)


@dataclass(frozen=True, slots=True)
class ModelOutput:
    """Views of the step's outputs (of a graph's buffers after a replay: clone to keep)."""

    hidden_states: torch.Tensor  # [num_tokens, hidden]
    logits: torch.Tensor  # [num_reqs, vocab], the sampled token of each request
    draft: torch.Tensor | None = None  # [num_reqs, heads, head_dim], the draft attention
    desc: BatchExecutionDescriptor | None = None  # the graph that ran; None: eager
    req_ids: tuple[str, ...] = ()  # a real step's requests, in the rows of `logits`
    prompt_logprobs: torch.Tensor | None = None  # [num_tokens, vocab], read after the step
    drafts: torch.Tensor | None = None  # [num_reqs, k] int64, the drafter's (drafter.py)


class ModelRunner:
    def __init__(
        self,
        config: RunnerConfig,
        pools: TaggedPools | None = None,
        collectives: Collectives | None = None,
    ) -> None:
        """Weights and the KV cache live in tagged sleep pools (a Worker's, or its own); a
        rank among several issues its collectives through `collectives`."""
        c, m = config, config.model
        self.config, self.device, self.fixes = config, config.device, config.fixes
        if collectives is None and c.parallel.world_size > 1:
            raise ValueError("a runner of several ranks needs its Collectives")
        self.collectives = collectives or Collectives(c.parallel, self.device)
        # each DP rank's token count of the last step, as the ranks agreed (upstream: DPMetadata)
        self.num_tokens_across_dp: list[int] | None = None
        self.pools = pools or make_pools(self.device)
        self.launch = Launcher()
        self.input_buffers = InputBuffers(c.max_num_tokens, c.max_num_reqs, self.device)
        self.sampling = SamplingStates(c.max_num_reqs, m.vocab_size, self.fixes)
        self.structured_outputs = StructuredOutputsWorker(
            c.max_num_reqs, m.vocab_size, c.device, self.fixes
        )
        self.async_sampler = None
        if c.scheduler.async_output:
            self.sampling, self.async_sampler = async_sampling(c, m.vocab_size)
        self.model = TinyLoRADecoder(
            m, self.device, lambda t: self.pools.adopt("weights", t), c.dtype
        )
        self.kv_cache = KVCache(
            c.cache.block_sizes,
            c.cache.num_kv_blocks,
            m.num_heads,
            m.hidden_size // m.num_heads,
            c.max_num_reqs,
            c.max_num_tokens,
            c.max_model_len,
            self.pools,
            self.model.dtype,
            m.seed,
            c.cache.enable_prefix_caching,
            c.cache.hybrid,
            c.cache.kernel_block_sizes,
            self._builder_block_sizes(),
            c.cache.sliding_window,
        )
        self.model.fixes = self.fixes
        self.model.moe = moe_config(self.fixes, self.device)
        self.offload = (
            CPUOffloadConnector(
                self.kv_cache,
                c.cache.cpu_offload_blocks,
                self.device,
                self.fixes,
                self.launch,
                c.scheduler.stream_delay,
                c.cache.offload_store_next_step,
                c.cache.offload_host_ahead,
            )
            if c.cache.cpu_offload_blocks
            else None
        )
        pages = c.attention.decode_backend == "trtllm"
        backend = FlashMLABackend(c.attention.num_splits, c.max_model_len, self.device, pages)
        self.model.decode_backend = backend if c.attention.decode_backend != "paged" else None
        self.draft = (
            DraftAttention(backend, m.num_heads, rms_norm, c.fixes)
            if c.spec.draft_attention
            else None
        )
        self.cache_only, self.speculator = self._hidden_state_readers()
        self.drafter = (
            Drafter(
                self.model,
                c.spec.num_speculative_tokens,
                c.max_model_len,
                c.parallel,
                self.collectives,
                self.fixes,
            )
            if c.spec.num_speculative_tokens
            else None
        )
        if self.drafter is not None and c.spec.parallel_drafting:
            self.drafter = LookaheadDrafter(
                self.model,
                self.kv_cache,
                c.spec.num_speculative_tokens,
                c.max_model_len,
                self.pools,
                self.launch,
            )
        self.lora_manager = LoRAManager(
            LoRAModelManager(m.max_loras, m.vocab_size, self._punica_wrappers(), self.fixes)
        )
        self.registered_loras: dict[int, tuple[int, bool]] = {}  # id -> (seed, experts)
        pool = self._graph_pool()
        self.cudagraph_manager = CudaGraphManager(self.device, self.launch, self.fixes, pool)
        self.drafter_graphs = (
            CudaGraphManager(self.device, self.launch, self.fixes, pool) if pool else None
        )
        self.capture_attn: dict[BatchExecutionDescriptor, AttentionMetadata] = {}
        self.tuned: set[tuple[bool, int]] = set()  # (capture path?, size) tuned on a first call
        self.rejection_generator = self._sampling_generator() if c.spec.rejection_sampling else None

    def _sampling_generator(self) -> torch.Generator:
        """The generator of the runner's random draws, seeded with the engine's seed (upstream:
        the worker's set_random_seed at start-up). An unset seed leaves each worker with its
        process's own random state: each tensor-parallel rank draws differently."""
        c, seed = self.config, self.config.seed
        if seed is None and Fix.SEED_DEFAULT_ZERO in self.fixes:
            # fix: seed_default_zero -- an unset seed is 0 on every worker, so the TP ranks
            # draw the same uniforms and accept the same drafts
            seed = 0
        if seed is None:
            seed = torch.initial_seed()  # NOTE: the process's own state (each rank's own)
        return torch.Generator(c.device).manual_seed(seed)

    def _builder_block_sizes(self) -> tuple[int, ...]:
        """The block size each group's attention metadata builder is given."""
        c = self.config
        if Fix.KERNEL_BLOCK_SIZE_TO_BUILDERS in self.fixes:
            # fix: kernel_block_size_to_builders -- the tables and cache views are in kernel blocks
            return c.cache.kernel_block_sizes or c.cache.block_sizes
        return c.cache.block_sizes  # the KV manager's (upstream: kv_cache_spec.block_size)

    def _hidden_state_readers(self) -> tuple[CacheOnlyLayer | None, DraftPrefill | None]:
        """What reads the model's hidden states after its forward, when configured: a
        cache-only layer (group 0's blocks and slot mapping) and a speculator's draft prefill
        (the LM head shared with the target)."""
        c = self.config
        cache_only = speculator = None
        if c.spec.extract_hidden_states:
            layout = (c.cache.num_kv_blocks, c.cache.block_sizes[0], c.model.hidden_size)
            cache_only = CacheOnlyLayer(*layout, self.model.dtype, self.pools, c.fixes)
        if c.spec.draft_prefill:
            speculator = DraftPrefill(c.max_num_reqs, self.model.head, self.device, c.fixes)
        return cache_only, speculator

    def _graph_pool(self) -> GraphPool | None:
        """With draft graphs: the pool the target's and the drafter's graph outputs share
        (room for one graph's hidden states and logits), and the drafter's input buffer."""
        c, m = self.config, self.config.model
        if not c.spec.draft_graphs:
            return None
        if not c.spec.draft_prefill:
            raise ValueError("draft_graphs needs a drafter: draft_prefill=True")
        self.draft_hidden = torch.zeros(
            c.max_num_tokens, m.hidden_size, dtype=self.model.dtype, device=self.device
        )
        numel = c.max_num_tokens * m.hidden_size + c.max_num_reqs * m.vocab_size
        return GraphPool(numel, self.model.dtype, self.device)

    def _punica_wrappers(self) -> dict[str, PunicaWrapper]:
        # NOTE: the embedding and layer 0 share one wrapper object; layer 1 and the LM head
        # share another (upstream: one wrapper for many layers; fixes must dedupe by id()).
        c = self.config
        shared, own = (
            PunicaWrapper(
                c.max_num_tokens,
                c.max_num_reqs,
                c.model.max_loras,
                self.device,
                c.lora.specialize_active_lora,
            )
            for _ in range(2)
        )
        return dict(zip(TinyLoRADecoder.PREFIXES, (shared, shared, own, own), strict=True))

    @property
    def wrappers(self) -> list[PunicaWrapper] | None:
        """The wrapper of each LoRA layer, in TinyLoRADecoder.PREFIXES order (None: no LoRA)."""
        if not self.config.lora.enable_lora:
            return None
        mapping = self.lora_manager._adapter_manager.punica_wrapper_mapping
        return [mapping[p] for p in TinyLoRADecoder.PREFIXES]

    def add_lora(self, lora_id: int, seed: int, experts: bool = True) -> int:
        """Register adapter `lora_id` with seeded weights (`experts=False`: none for the
        experts: disabled there) and activate it now, between steps if the engine is serving
        (upstream: add_lora's add_adapter activates at once, evicting the least recently used
        adapter when every slot is taken); returns its slot."""
        self.registered_loras[lora_id] = (seed, experts)
        slot = self.lora_manager._adapter_manager.activate_adapter(lora_id)
        self.model.load_lora(slot, seed, experts)
        return slot

    def remove_lora(self, lora_id: int) -> int:
        """Remove adapter `lora_id`: unregistered, its slot freed and zeroed; returns the slot."""
        self.registered_loras.pop(lora_id, None)
        slot = self.lora_manager._adapter_manager.deactivate_adapter(lora_id)
        self.model.reset_lora(slot)
        return slot

    def _activate_adapters(self, requests: list[Request]) -> None:
        """Each registered adapter of the step, in request order, made active (loaded into a
        slot if it was evicted) and most recently used (upstream: set_active_adapters)."""
        manager = self.lora_manager._adapter_manager
        for lora_id in dict.fromkeys(q.lora_id for q in requests if q.lora_id):
            if lora_id in self.registered_loras:
                loaded = lora_id in manager.lora_index_to_id
                slot = manager.activate_adapter(lora_id)
                if not loaded:
                    self.model.load_lora(slot, *self.registered_loras[lora_id])

    # -- steps --------------------------------------------------------------------------------

    def execute_model(
        self,
        requests: list[Request] | None = None,
        *,
        dummy_run: bool = False,
        num_tokens: int = 0,
        num_reqs: int = 1,
        use_cudagraph: bool = True,
        prev_sampled: PrevSampled | None = None,
        grammar: GrammarOutput | None = None,
    ) -> ModelOutput:
        """A real step (graph replay when one fits), or a dummy run (eager, no KV writes);
        `prev_sampled` fills a scheduler's placeholders on the device (async_inputs.py);
        `grammar` masks the guided requests' logits (structured_output.py)."""
        if self.offload is not None:
            self.offload.start_step()
        if dummy_run:
            self._coordinate_dp(num_tokens)  # a dummy run joins the ranks' agreement too
            if self.drafter is not None:  # upstream: _dummy_run runs the drafter's dummy too
                self.drafter.dummy_run(num_tokens)
            batch = self.input_buffers.dummy(num_tokens, num_reqs)
            self._prepare_speculator(batch)
            self._set_dummy_lora_state(num_tokens, num_reqs)
            return self._eager(batch, self.kv_cache.metadata(batch))
        if not requests:  # zero scheduled tokens: an empty step
            if (
                Fix.DP_ZERO_TOKEN_DUMMY_RUN in self.fixes
                and self.config.parallel.data_parallel_size > 1
            ):
                # fix: dp_zero_token_dummy_run -- an idle DP rank still joins the step's
                # token-count agreement, by a one-token dummy run, before its empty step
                self.execute_model(dummy_run=True, num_tokens=1, num_reqs=1)
            return self._empty_output()
        restricted = self.sampling.add_requests(requests)
        if self.config.attention.reorder_batch:
            requests = self._reorder_batch(requests)
        n, r = sum(len(q.token_ids) for q in requests), len(requests)
        self._coordinate_dp(n)
        uniform = all(len(q.token_ids) == 1 for q in requests)
        desc = None
        if use_cudagraph and self.config.graphs.cudagraph_mode != CUDAGraphMode.NONE:
            desc = self.cudagraph_manager.dispatch(n, r, uniform, self._lora_case(requests))
        batch = self.input_buffers.prepare(
            requests, desc.num_tokens if desc else n, desc.num_reqs if desc else r
        )
        if prev_sampled is not None:
            prev_sampled.fill(batch)
        if self.config.spec.parallel_drafting and self.drafter is not None:
            self._set_lookahead(requests)
        for row, q in enumerate(requests):
            self.kv_cache.ensure_blocks(row, q.num_computed_tokens + len(q.token_ids), q.token_ids)
        self._zero_new_blocks()
        if self.config.cache.hybrid:
            self._update_states(requests)
        if desc is None or not self.config.graphs.tables_in_graph:  # else the graph gathers
            attn = self.kv_cache.metadata(batch)
        if self.speculator is not None:
            self.speculator.prepare(batch)
        if self.config.lora.enable_lora:
            self._activate_adapters(requests)
            mapping = LoRAMapping(batch.token_lora_ids, batch.req_lora_ids, is_prefill=True)
            self.lora_manager._adapter_manager.set_adapter_mapping(mapping)
        # the step's device work: on the CPU tier's compute stream when there is one
        if desc is None:
            step = partial(self._eager, batch, attn)
        else:
            step = partial(self._replay, desc, batch)
        out = step() if self.offload is None else self.offload.execute(step, requests)
        logits = self.sampling.apply(out.logits) if restricted else out.logits
        out = replace(out, logits=logits, req_ids=tuple(q.req_id for q in requests))
        if grammar is not None:  # the scheduler's bitmask of the guided requests
            self.structured_outputs.apply(grammar, out.req_ids, out.logits, self.launch)
        if self.drafter is not None:
            out = replace(out, drafts=self.drafter.propose(requests, out.logits))
        return self._read_prompt_logprobs(out)

    def _set_lookahead(self, requests: list[Request]) -> None:
        """Each row's slots past its tokens for a drafter that writes KV there in this step
        (upstream: the scheduler's num_lookahead_tokens), before the step allocates."""
        kv = self.kv_cache
        kv.lookahead = {
            row: lookahead_slots(self.drafter.k, kv.first_step(row), self.fixes)
            for row, q in enumerate(requests)
        }

    def _coordinate_dp(self, num_tokens: int) -> None:
        """Agree with the other DP ranks on each one's token count (an all-reduce of one
        count per DP rank, a host tensor: upstream's goes over the DP group's cpu_group,
        get_num_tokens_across_dp; its result pads the ranks' batches alike). Every DP rank must
        join it on every step."""
        p = self.config.parallel
        if p.data_parallel_size == 1:
            self.num_tokens_across_dp = None
            return
        counts = torch.zeros(p.data_parallel_size, dtype=torch.int32)
        counts[p.dp_rank] = num_tokens
        self.collectives.all_reduce(counts, "dp")
        self.num_tokens_across_dp = counts.tolist()

    def _empty_output(self) -> ModelOutput:
        """What a step of no tokens returns (upstream: EMPTY_MODEL_RUNNER_OUTPUT)."""
        m, dtype = self.config.model, self.model.dtype
        hidden = torch.empty(0, m.hidden_size, dtype=dtype, device=self.device)
        logits = torch.empty(0, m.vocab_size, dtype=dtype, device=self.device)
        return ModelOutput(hidden, logits)

    def execute_spec_step(
        self, request: Request, draft_ids: list[int], draft_probs: list[float]
    ) -> SpecStep:
        """A verify step of one request whose token_ids end with its drafts (none: a prefill):
        the target's logits at the last token before the drafts and at each draft, rejection
        sampling with this step's uniforms, then the drafter's first tensor-parallel layer on
        the hidden states kept (upstream: EAGLE's prepare_inputs drops the rejected tokens, so
        its input, and the all-reduce of its row-parallel layer, has as many rows as the ranks
        kept: ranks that accepted differently disagree on its shape)."""
        k, n = len(draft_ids), len(request.token_ids)
        out = self.execute_model([request], use_cudagraph=False)
        logits = out.hidden_states[n - k - 1 :] @ self.model.head.T  # [k + 1, vocab]
        uniforms = torch.zeros(0)
        if k:
            uniforms = torch.rand(k, generator=self.rejection_generator, device=self.device)
        tokens, accepted = rejection_sample(logits, draft_ids, draft_probs, uniforms.cpu())
        tp = self.config.parallel.tensor_parallel_size
        kept = out.hidden_states[: n - k + accepted] / tp  # each TP rank's partial sum
        self.collectives.all_reduce(kept, "tp")
        return SpecStep(tokens, accepted, kept)

    def execute_model_async(self, requests: list[Request]) -> AsyncOutput:
        """Async scheduling's step: returns before the device has sampled it."""
        out = self.execute_model(requests)
        return self.async_sampler.sample(out.logits, out.req_ids)

    def _reorder_batch(self, requests: list[Request]) -> list[Request]:
        """Decodes (one scheduled token) before prefills, by swapping rows of the persistent
        state: the requests, their KV-cache rows and their sampling state (upstream: the
        attention backend's reorder_batch calling InputBatch.swap_states)."""
        requests = list(requests)
        for i, j in decode_first_swaps([len(q.token_ids) == 1 for q in requests]):
            requests[i], requests[j] = requests[j], requests[i]
            self.kv_cache.swap_rows(i, j)
            self.sampling.swap_states(i, j)
        return requests

    def _read_prompt_logprobs(self, out: ModelOutput) -> ModelOutput:
        """After the step (upstream: bookkeeping's prompt logprobs): every token's logits from
        its hidden state through the LM head, log-softmaxed (no LoRA)."""
        if not self.config.prompt_logprobs:
            return out
        logits = out.hidden_states @ self.model.head.T  # in the model's dtype, as the logits
        return replace(out, prompt_logprobs=torch.log_softmax(logits, -1))

    def _zero_new_blocks(self) -> None:
        """Zero the blocks this step's requests were given, before any kernel reads them
        (upstream: the scheduler's new_block_ids_to_zero, zeroed by the worker's KVBlockZeroer
        where the KV cache needs it: a hybrid runner, whose blocks change tenants and dtypes)."""
        new = self.kv_cache.take_new_block_ids()
        if not self.config.cache.hybrid or Fix.ZERO_NEW_KV_BLOCKS not in self.fixes:
            return
        # fix: zero_new_kv_blocks -- a recycled block's bytes may read as NaN in this dtype.
        for g, ids in enumerate(new):
            if ids:
                block_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
                for cache in (self.kv_cache.k_caches[g], self.kv_cache.v_caches[g]):
                    self.launch(zero_kv_blocks, cache, block_ids)

    def _update_states(self, requests: list[Request]) -> None:
        """The hybrid runner's state group: each request's window, in its state block."""
        kv = self.kv_cache
        for row, q in enumerate(requests):
            ids = torch.tensor(q.token_ids, dtype=torch.int32, device=self.device)
            fresh = q.num_computed_tokens == 0
            self.launch(update_conv_state, kv.state_pages[kv.state_blocks[row]], ids, fresh)

    def _eager(self, batch: InputBatch, attn: AttentionMetadata) -> ModelOutput:
        attn.sched = FlashMLASchedMeta()  # eager attention plans for this step
        hidden, logits = self._model_forward(batch, attn)
        self._draft_prefill(hidden, batch.num_reqs)
        draft = None
        if self.draft is not None and batch.uniform_decode:
            draft = self.draft.forward(FlashMLASchedMeta(), self._draft_inputs(hidden, attn))
        return self._output(batch, hidden, logits, draft, None)

    def _replay(self, desc: BatchExecutionDescriptor, batch: InputBatch) -> ModelOutput:
        if desc.cg_mode == PIECEWISE:  # its attention runs eagerly, on this step
            attn = self.capture_attn[desc]
            attn.sched, attn.uniform_decode = FlashMLASchedMeta(), batch.uniform_decode
            attn.num_actual_tokens = batch.num_tokens  # the padding rows stay as allocated
        hidden, logits = self.cudagraph_manager.run(desc)
        if self.drafter_graphs is not None:
            return self._replay_drafter(desc, batch, hidden, logits)
        if desc.cg_mode == PIECEWISE:  # a FULL graph holds the draft prefill
            self._draft_prefill(hidden, batch.num_reqs)
        draft = None
        if self.draft is not None and desc in self.draft.graphs.graphs:
            draft = self.draft.graphs.run(desc)
        return self._output(batch, hidden, logits, draft, desc)

    def _replay_drafter(self, desc, batch, hidden, logits) -> ModelOutput:
        """The sampler consumes the target's logits; then the padded drafter replays its graph
        on a copy of the target's hidden states, its outputs where the pool held the
        target's."""
        logits = logits.clone()  # NOTE: upstream samples before the drafter runs
        if Fix.GRAPH_OUTPUT_COPY_BEFORE_DRAFT in self.fixes:
            # fix: graph_output_copy_before_draft -- the drafter's outputs take this memory.
            hidden = hidden.clone()
        self.draft_hidden[: desc.num_tokens].copy_(hidden)
        self.drafter_graphs.run(desc)
        return self._output(batch, hidden, logits, None, desc)

    @staticmethod
    def _output(batch, hidden, logits, draft, desc) -> ModelOutput:
        n, r = batch.num_tokens, batch.num_reqs
        return ModelOutput(hidden[:n], logits[:r], None if draft is None else draft[:r], desc)

    def _draft_inputs(self, hidden: torch.Tensor, attn: AttentionMetadata) -> DraftInputs:
        """A uniform decode batch's hidden states are its sampled ones, one per request."""
        rows = attn.seq_lens.shape[0]
        return DraftInputs(
            hidden[:rows], attn.k_caches[0], attn.v_caches[0], attn.block_tables[0], attn.seq_lens
        )

    # -- LoRA state ---------------------------------------------------------------------------

    def _set_dummy_lora_state(self, num_tokens: int, num_reqs: int) -> None:
        """The dummy branch's LoRA state (profile, warm-up, capture)."""
        if not self.config.lora.enable_lora or Fix.LORA_DUMMY_MAPPING not in self.fixes:
            return
        # fix: lora_dummy_mapping -- an unset mapping leaves the LoRA index buffers garbage.
        adapter_manager = self.lora_manager._adapter_manager
        adapter_manager.set_adapter_mapping(LoRAMapping((0,) * num_tokens, (0,) * num_reqs, True))
        if Fix.LORA_CAPTURE_LAUNCH in self.fixes:
            # fix: lora_capture_launch -- launch (so capture) LoRA kernels; programs see -1, exit.
            for wrapper in adapter_manager.distinct_wrappers():
                for meta in (wrapper.token_mapping_meta, wrapper.prompt_mapping_meta):
                    meta.no_lora_flag_cpu[0] = False
                    meta.num_active_loras_cpu[0] = 1

    def _lora_cases(self) -> list[int | None]:
        """The LoRA capture cases: one, or every active-LoRA count (-1 included) when
        specialised."""
        if not (self.config.lora.enable_lora and self.config.lora.specialize_active_lora):
            return [None]
        return list(range(1, self.config.model.max_loras + 2))

    def _lora_case(self, requests: list[Request]) -> int | None:
        """The capture case a batch dispatches to: its adapters, plus one program for -1."""
        cases = self._lora_cases()
        if cases == [None]:
            return None
        count = len({q.lora_id for q in requests if q.lora_id}) + 1
        return min(c for c in cases if c >= count)

    def _capture_lora_state(self, case: int | None) -> None:
        """Upstream's LoRA capture hook: the dummy LoRA state, with each active meta set to
        launch `case` LoRA programs when specialised."""
        c = self.config
        self._set_dummy_lora_state(max(c.graphs.cudagraph_sizes), c.max_num_reqs)
        if case is None or not c.lora.enable_lora:
            return
        for wrapper in self.lora_manager._adapter_manager.distinct_wrappers():
            for meta in (wrapper.token_mapping_meta, wrapper.prompt_mapping_meta):
                if int(meta.num_active_loras_cpu[0]) > 0:
                    meta.num_active_loras_cpu[0] = case

    # -- capture ------------------------------------------------------------------------------

    def _capture_descriptors(self) -> list[BatchExecutionDescriptor]:
        c, descs = self.config, []
        for size in (s for s in c.graphs.cudagraph_sizes if s <= c.max_num_tokens):
            reqs = min(size, c.max_num_reqs)
            for case in self._lora_cases():
                if c.graphs.cudagraph_mode in (FULL, PIECEWISE):
                    descs.append(
                        BatchExecutionDescriptor(c.graphs.cudagraph_mode, size, reqs, False, case)
                    )
                if c.graphs.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE:
                    descs.append(BatchExecutionDescriptor(PIECEWISE, size, reqs, False, case))
                    if size <= c.max_num_reqs:
                        descs.append(BatchExecutionDescriptor(FULL, size, size, True, case))
        return descs

    def capture_model(self) -> None:
        """Per LoRA capture case: its LoRA state, then every descriptor captured on it; then
        the draft attention's graphs, on the target's attention states (upstream hands
        them to the speculator)."""
        descs = self._capture_descriptors()
        for case in self._lora_cases():
            self._capture_lora_state(case)
            mine = [d for d in descs if d.num_active_loras == case]
            self.cudagraph_manager.capture(mine, self._create_forward_fn)
            if self.drafter_graphs is not None:  # upstream: after the target, same pool
                self.drafter_graphs.capture(mine, self._create_draft_fn)
        if self.draft is None or self.model.decode_backend is None:
            return
        graphs = self.cudagraph_manager
        decode = {
            d: (graphs.warmup_attn_states[d], state)
            for d, state in graphs.captured_attn_states.items()
            if d.cg_mode == FULL and d.uniform_decode
        }
        self.draft.capture(decode, self._captured_draft_inputs)

    def _captured_draft_inputs(self, desc: BatchExecutionDescriptor) -> DraftInputs:
        hidden, _ = self.cudagraph_manager.outputs[desc]
        return self._draft_inputs(hidden, self.capture_attn[desc])

    def _create_forward_fn(self, desc: BatchExecutionDescriptor, warmup: bool = True):
        """A forward on dummy inputs of `desc`'s size, with a fresh attention state (and, with
        tables_in_graph, the gather of the step's tables first): of the eager path (warmup),
        or of the capture-compatible one (upstream: the compiled graph's path)."""
        batch = self.input_buffers.dummy(desc.num_tokens, desc.num_reqs)
        self._prepare_speculator(batch)
        attn = self.kv_cache.metadata(batch)
        attn.uniform_decode, attn.sched = desc.uniform_decode, FlashMLASchedMeta()
        self.capture_attn[desc] = attn

        def forward(mode: CUDAGraphMode):
            self._first_call_tuning(not warmup, batch.num_tokens)
            if self.config.graphs.tables_in_graph:
                self.kv_cache.metadata(batch, self.launch)
            hidden, logits = self._model_forward(batch, attn)
            # upstream: the speculator's FULL prefill graph, unless it has graphs of its own
            if desc.cg_mode == FULL and not self.config.spec.draft_graphs:
                self._draft_prefill(hidden, desc.num_reqs)
            return hidden, logits

        return forward, attn.sched

    def _create_draft_fn(self, desc: BatchExecutionDescriptor, warmup: bool = True):
        """The padded drafter's forward for `desc`: the draft prefill on its input buffer,
        returning the draft logits and the gathered hidden states (no attention state)."""
        hidden, reqs = self.draft_hidden[: desc.num_tokens], desc.num_reqs

        def forward(mode: CUDAGraphMode):
            self.speculator.forward(hidden, reqs, self.launch)
            return self.speculator.draft_logits[:reqs], self.speculator.sample[:reqs]

        return forward, None

    def _model_forward(
        self, batch: InputBatch, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward, then the cache-only layer on its hidden states."""
        hidden, logits = self.model.forward(batch, attn, self.wrappers, self.launch)
        if self.cache_only is not None:
            self.cache_only.forward(hidden, attn.slot_mappings[0], self.launch)
        return hidden, logits

    def _prepare_speculator(self, batch: InputBatch) -> None:
        """The draft prefill's indices of `batch`'s last tokens, before its forward: a dummy
        batch's too (a dummy run, a capture's warm-up), else its draft prefill gathers the
        previous step's indices, past the dummy batch's hidden states (found by `repro fuzz`,
        2026-11-27: a dummy run after a step of more tokens, fixed runner; upstream's dummy run
        runs the drafter on dummy inputs of its own)."""
        if self.speculator is None:
            return
        self.speculator.prepare(batch)

    def _draft_prefill(self, hidden: torch.Tensor, num_reqs: int) -> None:
        """The speculator's draft prefill on the step's hidden states: padded requests in a
        FULL graph, the live ones elsewhere (upstream's eager and PIECEWISE prefill)."""
        if self.speculator is not None:
            self.speculator.forward(hidden, num_reqs, self.launch)

    def _first_call_tuning(self, capture_path: bool, num_tokens: int) -> None:
        """The one-time tuning of a path and size on its first call (upstream: Inductor's
        autotuning of the compiled capture-compatible path, per shape, vLLM #40742): time the
        KV-cache write under two launch configs, with host syncs, on scratch tensors; keep the
        faster. The eager path (warm-up functions, which PIECEWISE captures too) tunes at
        warm-up; the capture path (functions made with warmup=False, which FULL captures) at
        its first call: in capture, unless prewarmed (vLLM #46523)."""
        key = (capture_path, num_tokens)
        if key in self.tuned:
            return
        m = self.config.model
        dim = m.hidden_size // m.num_heads
        kv = torch.zeros(4, m.num_heads, dim, dtype=self.model.dtype, device=self.device)
        cache = torch.zeros(4, 1, *kv.shape[1:], dtype=kv.dtype, device=self.device)
        slots = torch.arange(4, device=self.device)
        seconds = {}
        for warps in (1, 4):
            host_sync(self.launch, self.device)
            start = time.perf_counter()
            self.launch(reshape_and_cache, kv, kv, cache, cache, slots, warps)
            host_sync(self.launch, self.device)
            seconds[warps] = time.perf_counter() - start
        self.model.cache_write_warps = min(seconds, key=seconds.get)
        self.tuned.add(key)

    # -- generation and sleep mode ------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, use_cudagraph: bool = False
    ) -> tuple[list[list[int]], list[tuple[list[Request], torch.Tensor]]]:
        """Greedy tokens per prompt (one prefill step, then one decode step per new token),
        and each step's requests and logits. Prompt r is a new request in row r (what the row
        held is freed), whose first step computes what the prefix cache does not hold; the
        requests finish at the end: their blocks are freed."""
        kv, rows = self.kv_cache, range(len(prompts))
        for row in rows:
            kv.free(row)
        starts = [kv.get_computed_blocks(row, prompt) for row, prompt in enumerate(prompts)]
        seqs, new, steps = [list(p) for p in prompts], [[] for _ in prompts], []
        for step in range(max_new_tokens):
            requests = []
            for row, seq in enumerate(seqs):
                start = starts[row] if step == 0 else len(seq) - 1
                requests.append(Request(f"req{row}", tuple(seq[start:]), 0, start))
            logits = self.execute_model(requests, use_cudagraph=use_cudagraph).logits.clone()
            steps.append((requests, logits))
            for row, token in enumerate(logits.argmax(-1).tolist()):
                seqs[row].append(token)
                new[row].append(token)
        for row in rows:
            kv.free(row)
        return new, steps

    def post_kv_cache_wake_up(self) -> None:
        """Called by the worker after the kv_cache pool woke up."""
        if Fix.BLOCK_TABLE_REINIT_ON_WAKE in self.fixes:
            # fix: block_table_reinit_on_wake -- the layout tensors woke up with garbage.
            self.kv_cache.block_tables.init_block_table_layout_tensors(
                # fix: block_table_refresh_in_place -- graphs hold the old tensors' addresses.
                in_place=Fix.BLOCK_TABLE_REFRESH_IN_PLACE in self.fixes
            )

    def reload_weights(self, seed: int | None = None) -> None:
        """The checkpoint again (`seed`: a new one), then the model's post-load processing."""
        self.model.reload_weights(seed)
