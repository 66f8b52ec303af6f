"""The miniature runner's plumbing and forward, on the run's device: LoRA mapping and metas,
persistent inputs with padding, graph modes and dispatch, LoRA capture cases."""

from __future__ import annotations

import pytest
import torch

from harness import record
from harness.fixes import ALL_FIXES, Fix
from harness.oracle import close, step_problems
from harness.reference import step_reference
from harness.runner.cudagraph import BatchExecutionDescriptor, CUDAGraphMode
from harness.runner.flashmla import DraftAttention, FlashMLABackend, FlashMLASchedMeta
from harness.runner.input_batch import InputBuffers, Request
from harness.runner.lora import LoRAKernelMeta, LoRAMapping, LoRAModelManager, convert_mapping
from harness.runner.model import DTYPES
from harness.runner.model_runner import ModelRunner, runner_config

INT32_MAX = torch.iinfo(torch.int32).max
MIXED = [Request("a", (1, 2, 3), 4), Request("b", (5, 6), 0), Request("c", (63,), 4)]


def test_convert_mapping_slots_and_offsets() -> None:
    mapping = LoRAMapping((0, 7, 3, 0, 7), (7, 0), is_prefill=True)
    slots, offsets, prompt = convert_mapping(mapping, [3, None, 7], vocab_size=10)
    assert slots == [-1, 2, 0, -1, 2] and offsets == [0, 20, 0, 0, 20] and prompt == [2, -1]


def test_convert_mapping_id_zero_needs_no_lookup_and_inactive_ids_fail() -> None:
    assert convert_mapping(LoRAMapping((0, 0), (0,)), [None, None], 10)[0] == [-1, -1]
    with pytest.raises(ValueError, match="LoRA id 5 is not active"):
        convert_mapping(LoRAMapping((0, 5), (5,)), [3, None], 10)


def test_prepare_tensors(device) -> None:
    meta = LoRAKernelMeta(max_num_tokens=8, max_loras=2, device=device)
    assert (meta.active_lora_ids.cpu() == INT32_MAX).all(), "buffers start poisoned"
    meta.prepare_tensors([1, -1, 0, 1, -1, 1])
    assert meta.active_lora_ids.tolist() == [-1, 0, 1]
    assert meta.num_tokens_per_lora.tolist() == [2, 1, 3]
    assert meta.lora_token_start_loc.tolist() == [0, 2, 3, 6]
    assert meta.token_indices_sorted_by_lora_ids[:6].tolist() == [1, 4, 2, 0, 3, 5]
    assert not meta.no_lora_flag_cpu[0] and int(meta.num_active_loras_cpu[0]) == 3
    meta.prepare_tensors([-1, -1])
    assert meta.active_lora_ids.tolist() == [-1, -1, -1]
    assert meta.num_tokens_per_lora.tolist() == [0, 0, 0]
    assert meta.no_lora_flag_cpu[0] and int(meta.num_active_loras_cpu[0]) == 0


def test_shared_wrappers_are_handled_once(device) -> None:
    runner = ModelRunner(runner_config(device))
    manager = runner.lora_manager._adapter_manager
    assert len(manager.punica_wrapper_mapping) == 4
    wrappers = manager.distinct_wrappers()
    assert len(wrappers) == 2 and wrappers[0] is not wrappers[1]


def test_set_adapter_mapping_skips_an_equal_mapping(device) -> None:
    runner = ModelRunner(runner_config(device))
    manager: LoRAModelManager = runner.lora_manager._adapter_manager
    meta = manager.distinct_wrappers()[0].token_mapping_meta
    manager.set_adapter_mapping(LoRAMapping((0, 0, 0), (0,), True))
    assert meta.no_lora_flag_cpu[0]
    meta.no_lora_flag_cpu[0] = False
    manager.set_adapter_mapping(LoRAMapping((0, 0, 0), (0,), True))
    assert not meta.no_lora_flag_cpu[0], "an equal mapping was applied again"
    manager.set_adapter_mapping(LoRAMapping((0, 0), (0,), True))
    assert meta.no_lora_flag_cpu[0]


@pytest.mark.lora_dummy_run
@pytest.mark.lora_graph_capture
@pytest.mark.parametrize(
    ("fixes", "flag", "active"),
    [(ALL_FIXES, False, 1), (ALL_FIXES - {Fix.LORA_CAPTURE_LAUNCH}, True, 0)],
)
def test_dummy_branch_fix_parts(device, fixes, flag, active) -> None:
    runner = ModelRunner(runner_config(device, fixes))
    runner.execute_model(dummy_run=True, num_tokens=4, num_reqs=1)
    for wrapper in runner.lora_manager._adapter_manager.distinct_wrappers():
        for meta in (wrapper.token_mapping_meta, wrapper.prompt_mapping_meta):
            state = (bool(meta.no_lora_flag_cpu[0]), int(meta.num_active_loras_cpu[0]))
            assert state == (flag, active)


@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_step_matches_reference_and_every_lora_changes_it(device, dtype) -> None:
    runner = ModelRunner(runner_config(device, dtype=dtype))
    runner.add_lora(4, seed=9)
    out = runner.execute_model(MIXED, use_cudagraph=False)
    want = getattr(torch, dtype)
    m, kv = runner.model, runner.kv_cache
    held = [m.embed, m.head, m.mlp, m.experts, *m.attn[0], m.expert_a, m.head_b, *kv.k_caches]
    assert {t.dtype for t in (*held, out.hidden_states, out.logits)} == {want}
    hidden, logits = step_reference(runner, MIXED)
    assert not any(step_problems("mixed", out, (hidden, logits)))
    model = runner.model
    for name in ("embed_b", "mlp_b", "expert_b", "head_b"):  # each adapter part is seen
        saved = getattr(model, name).clone()
        getattr(model, name).zero_()
        assert close(name, out.logits, step_reference(runner, MIXED)[1]), f"{name} unseen"
        getattr(model, name).copy_(saved)


def test_the_runners_dtypes_are_the_clis_and_float16_is_refused(device) -> None:
    assert DTYPES == record.DTYPES
    with pytest.raises(ValueError, match="dtype 'float16': the runner runs in float32, bfloat16"):
        ModelRunner(runner_config(device, dtype="float16"))


@pytest.mark.lora_dummy_run
def test_dummy_run_writes_nothing_to_the_kv_cache(device) -> None:
    runner = ModelRunner(runner_config(device))
    before = [c.clone() for c in runner.kv_cache.k_caches]
    runner.execute_model(dummy_run=True, num_tokens=8, num_reqs=2)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_cache.k_caches, strict=True))


def test_input_buffers_pad_in_place_and_reject_overflow(device) -> None:
    buffers = InputBuffers(max_num_tokens=8, max_num_reqs=4, device=device)
    ptr = buffers.input_ids.data_ptr()
    batch = buffers.prepare([Request("a", (4, 5), 1), Request("b", (6,), 0, 7)], 4, 3)
    assert batch.input_ids.tolist() == [4, 5, 6, 0] and buffers.input_ids.data_ptr() == ptr
    assert batch.positions.tolist() == [0, 1, 7, 0] and batch.token_rows.tolist() == [0, 0, 1, 0]
    assert batch.query_start_loc.tolist() == [0, 2, 3, 3] and batch.seq_lens.tolist() == [2, 8, 1]
    assert batch.logits_indices.tolist() == [1, 2, 0]
    assert batch.token_lora_ids == (1, 1, 0, 0) and batch.req_lora_ids == (1, 0, 0)
    assert not batch.uniform_decode
    decode = buffers.prepare([Request("a", (4,), 0, 3), Request("b", (6,), 0, 9)], 3, 3)
    assert decode.uniform_decode
    with pytest.raises(ValueError, match="over the buffers"):
        buffers.prepare([Request("a", tuple(range(9)))], 9, 1)


def _descs(runner: ModelRunner) -> set[tuple]:
    graphs = runner.cudagraph_manager.graphs
    return {(d.cg_mode.value, d.num_tokens, d.num_reqs, d.uniform_decode) for d in graphs}


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_and_piecewise_capture_and_dispatch(device, dtype) -> None:
    mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config = runner_config(device, cudagraph_mode=mode, cudagraph_sizes=(4, 16), dtype=dtype)
    runner = ModelRunner(config)
    runner.add_lora(4, seed=9)
    runner.capture_model()
    assert _descs(runner) == {
        ("piecewise", 4, 4, False),
        ("piecewise", 16, 8, False),
        ("full", 4, 4, True),
    }
    graphs = {d.cg_mode: g for d, g in runner.cudagraph_manager.graphs.items()}
    assert "eager attention_op" in graphs[CUDAGraphMode.PIECEWISE].launches
    assert "paged_attention" in graphs[CUDAGraphMode.FULL].launches
    decode = [Request("a", (3,), 0, 5), Request("b", (4,), 0, 2)]
    for requests, want in ((decode, ("full", 4)), (MIXED, ("piecewise", 16))):
        if requests is decode:  # the decode steps need their context in the cache
            for row, n in enumerate((6, 3)):
                runner.kv_cache.ensure_blocks(row, n)
        replay = runner.execute_model(requests)
        assert (replay.desc.cg_mode.value, replay.desc.num_tokens) == want
        replay = type(replay)(replay.hidden_states.clone(), replay.logits.clone())
        eager = runner.execute_model(requests, use_cudagraph=False)
        assert not any(step_problems(str(want), eager, step_reference(runner, requests), replay))


@pytest.mark.lora_graph_capture
def test_specialized_lora_captures_one_case_per_active_count(device) -> None:
    config = runner_config(device, cudagraph_sizes=(8,), specialize_active_lora=True)
    runner = ModelRunner(config)
    runner.add_lora(1, seed=1)
    runner.add_lora(2, seed=2)
    runner.capture_model()
    cases = sorted(d.num_active_loras for d in runner.cudagraph_manager.graphs)
    assert cases == [1, 2, 3]  # adapters plus one LoRA program for the base model (-1)
    base = runner.execute_model([Request("a", (1, 2), 0)])
    one = runner.execute_model([Request("a", (1, 2), 1), Request("b", (3,), 0)])
    both = runner.execute_model([Request("a", (1,), 1), Request("b", (3,), 2)])
    assert [o.desc.num_active_loras for o in (base, one, both)] == [1, 2, 3]


class _StateRecordingDraft(DraftAttention):
    """A draft attention whose forward records the state it runs on (and whether a graph is
    being captured) instead of attending."""

    def __init__(self, device: str, fixes) -> None:
        super().__init__(FlashMLABackend(4, 32, device), 2, lambda x, out: None, fixes)
        self.seen: list[tuple[FlashMLASchedMeta, bool]] = []

    def forward(self, state, x) -> torch.Tensor:
        self.seen.append((state, self.launch.capturing))
        return torch.zeros(1, device=self.backend.device)


DRAFT_STATES = [
    pytest.param(
        ALL_FIXES,
        "warm-up",
        "fresh",
        marks=[pytest.mark.spec_capture_state, pytest.mark.spec_prewarm_captured_state],
        id="fixed",
    ),
    pytest.param(
        ALL_FIXES - {Fix.SPEC_SEPARATE_WARMUP_STATE},
        "captured",
        "fresh",
        marks=pytest.mark.spec_capture_state,
        id="spec_separate_warmup_state",
    ),
    pytest.param(
        ALL_FIXES - {Fix.SPEC_DISPOSABLE_PREWARM_STATE},
        "warm-up",
        "captured",
        marks=pytest.mark.spec_prewarm_captured_state,
        id="spec_disposable_prewarm_state",
    ),
]


@pytest.mark.parametrize(("fixes", "warm_up", "prewarm"), DRAFT_STATES)
def test_draft_capture_passes_run_on_their_states(device, fixes, warm_up, prewarm) -> None:
    """The speculator's warm-up, prewarm (vLLM #46523) and capture of one FULL decode graph:
    fixed, on the target's warm-up state, a fresh one, the target's captured one."""
    draft = _StateRecordingDraft(device, fixes)
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 4, 4, uniform_decode=True)
    target = {"warm-up": FlashMLASchedMeta(), "captured": FlashMLASchedMeta()}
    draft.capture({desc: (target["warm-up"], target["captured"])}, lambda d: None)
    (warm_up_state, _), (prewarm_state, eager), (capture_state, in_graph) = draft.seen
    assert warm_up_state is target[warm_up] and capture_state is target["captured"]
    if prewarm == "fresh":
        assert all(prewarm_state is not t for t in target.values())
    else:
        assert prewarm_state is target[prewarm]
    assert not eager and in_graph
