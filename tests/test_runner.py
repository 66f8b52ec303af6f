"""The miniature runner's LoRA plumbing and forward, on the run's device."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.oracle import decoder_reference
from harness.runner.input_batch import InputBuffers, Request
from harness.runner.lora import LoRAKernelMeta, LoRAMapping, LoRAModelManager, convert_mapping
from harness.runner.model_runner import ModelRunner, RunnerConfig

INT32_MAX = torch.iinfo(torch.int32).max


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
    runner = ModelRunner(RunnerConfig(device))
    manager = runner.lora_manager._adapter_manager
    assert len(manager.punica_wrapper_mapping) == 3
    wrappers = manager.distinct_wrappers()
    assert len(wrappers) == 2 and wrappers[0] is not wrappers[1]


def test_set_adapter_mapping_skips_an_equal_mapping(device) -> None:
    runner = ModelRunner(RunnerConfig(device))
    manager: LoRAModelManager = runner.lora_manager._adapter_manager
    meta = manager.distinct_wrappers()[0].token_mapping_meta
    mapping = LoRAMapping((0, 0, 0), (0,), True)
    manager.set_adapter_mapping(mapping)
    assert meta.no_lora_flag_cpu[0]
    meta.no_lora_flag_cpu[0] = False
    manager.set_adapter_mapping(LoRAMapping((0, 0, 0), (0,), True))
    assert not meta.no_lora_flag_cpu[0], "an equal mapping was applied again"
    manager.set_adapter_mapping(LoRAMapping((0, 0), (0,), True))
    assert meta.no_lora_flag_cpu[0]


@pytest.mark.parametrize(
    ("fixes", "flag", "active"),
    [
        (ALL_FIXES, False, 1),
        (ALL_FIXES - {Fix.LORA_CAPTURE_LAUNCH}, True, 0),
    ],
)
def test_dummy_branch_fix_parts(device, fixes, flag, active) -> None:
    runner = ModelRunner(RunnerConfig(device, fixes))
    runner.execute_model(dummy_run=True, num_tokens=4, num_reqs=1)
    for wrapper in runner.lora_manager._adapter_manager.distinct_wrappers():
        for meta in (wrapper.token_mapping_meta, wrapper.prompt_mapping_meta):
            assert (bool(meta.no_lora_flag_cpu[0]), int(meta.num_active_loras_cpu[0])) == (
                flag,
                active,
            )


def test_eager_forward_matches_reference_and_lora_changes_it(device) -> None:
    runner = ModelRunner(RunnerConfig(device))
    slot = runner.add_lora(4, seed=9)
    requests = [Request("a", (1, 2, 3), 4), Request("b", (5, 6), 0), Request("c", (63,), 4)]
    logits = runner.execute_model(requests, use_cudagraph=False).double().cpu()
    tokens, slots = [1, 2, 3, 5, 6, 63], [slot, slot, slot, -1, -1, slot]
    expected = decoder_reference(runner.model, tokens, slots)
    assert torch.equal(logits, expected), (logits - expected).abs().max()
    assert not torch.equal(expected, decoder_reference(runner.model, tokens, [-1] * 6))


def test_input_buffers_keep_addresses_and_reject_overflow(device) -> None:
    buffers = InputBuffers(max_num_tokens=8, max_num_reqs=2, device=device)
    ptr = buffers.input_ids.data_ptr()
    batch = buffers.prepare([Request("a", (4, 5), 1), Request("b", (6,))], 4)
    assert batch.input_ids.tolist() == [4, 5, 6, 0] and buffers.input_ids.data_ptr() == ptr
    assert batch.token_lora_ids == (1, 1, 0, 0) and batch.query_start_loc.tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="over the buffers"):
        buffers.prepare([Request("a", tuple(range(9)))], 9)
