"""Scenarios of offload_store_race (vLLM #46278): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.oracle import close, expect_all, mismatch
from harness.record import Context
from harness.reference import recomputed_logits
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.model_runner import ModelRunner, runner_config

BLOCK = 4  # tokens per block, in both KV-cache groups (the CPU tier's one size)
# (label, eager or replayed, whole blocks the first prompt fills)
CASES = (("eager, 1 block", False, 1), ("eager, 3 blocks", False, 3), ("graph, 1 block", True, 1))
CASES += (("graph, 3 blocks", True, 3),)


# (stores deferred to the next step, the host a step ahead): in the step and synchronous (the
# only runner with graphs: a capture is the scenario's largest cost on the CPU); deferred and
# synchronous (the host waited for the writes: no race); deferred with the host a step ahead
RUNNERS = ((False, False), (True, False), (True, True))


def _runner(ctx: Context, store_next_step: bool, host_ahead: bool) -> ModelRunner:
    """Block size 4 in both groups, a CPU tier of 16 blocks, the compute stream late; FULL
    graphs of 4 and 16 tokens captured when the stores are issued in the step."""
    mode = CUDAGraphMode.NONE if store_next_step else CUDAGraphMode.FULL
    config = runner_config(
        ctx.device,
        ctx.fixes,
        dtype=ctx.dtype,
        block_sizes=(BLOCK, BLOCK),
        cpu_offload_blocks=16,
        offload_store_next_step=store_next_step,
        offload_host_ahead=host_ahead,
        stream_delay=True,  # the compute stream runs late: the device behind the host
        cudagraph_mode=mode,
        cudagraph_sizes=(4, 16),
        max_num_tokens=16,
        enable_lora=False,
        max_model_len=16,
    )
    runner = ModelRunner(config)
    if not store_next_step:
        runner.capture_model()
    return runner


def _run(runner: ModelRunner, request: Request, graph: bool, wait: bool = True):
    """The step's logits (after the host waited for them when `wait`)."""
    out = runner.execute_model([request], use_cudagraph=graph)
    assert (out.desc is not None) == graph, f"trigger not reached: graph {out.desc}"
    if wait:
        runner.offload.synchronize()
        return out.logits.clone()
    return None


def _case(runner: ModelRunner, label: str, graph: bool, blocks: int, first: int) -> list:
    """Prompt A fills `blocks` whole blocks and one token more, in row 0 (with deferred stores
    a decode step of A follows, whose start issues them; its token is a placeholder, unread:
    with the host a step ahead A's output is not waited for before it); the host waits for
    the stores, and
    each group's K and V of A's blocks in the CPU tier must equal the device's; A finishes
    and its blocks are freed. Prompt C shares A's whole blocks and adds two tokens: its prefix
    must hit the CPU tier (loaded into new device blocks) and its logits match a reference
    that recomputes every position."""
    kv, tier, problems = runner.kv_cache, runner.offload, []
    prompt = [(first + i) % runner.config.model.vocab_size for i in range(blocks * BLOCK + 1)]
    _run(runner, Request("a", tuple(prompt)), graph, wait=not tier.host_ahead)
    if tier.store_next_step:
        _run(runner, Request("a", (0,), 0, len(prompt)), graph)
    tier.finish_stores()
    stored = [kv.blocks[0][g][:blocks] for g in range(len(kv.block_sizes))]
    for g, ids in enumerate(stored):
        for name, host, caches in (("K", tier.k, kv.k_caches), ("V", tier.v, kv.v_caches)):
            hosts = [tier.cached.get(h, -1) for h in tier.hashes(prompt)[:blocks]]
            problems.append(
                mismatch(
                    f"{label}: group {g} {name} of A's blocks in the CPU tier vs the device's",
                    host[g][hosts],
                    caches[g][ids],
                )
            )
    kv.free(0)
    shared = [*prompt[: blocks * BLOCK], (first + 40) % 64, (first + 41) % 64]
    n = tier.get_computed_blocks(0, shared)
    if n != blocks * BLOCK:
        problems.append(f"{label}: C's prefix hit {n} tokens of the CPU tier, not {blocks * BLOCK}")
    logits = _run(runner, Request("c", tuple(shared[n:]), 0, n), graph)
    problems.append(
        close(
            f"{label}: C's logits vs recomputed", logits, recomputed_logits(runner, [shared])[0:1]
        )
    )
    kv.free(0)
    return problems


def store_then_hit(ctx: Context) -> str:
    """A CPU KV tier (host blocks keyed by block hash, as SimpleCPUOffloadConnector's) on a
    runner whose compute stream runs late (the device behind the host, stream_delay): for each
    case (eager or a FULL graph replay, a prompt of one or three whole blocks) a prompt A is
    prefilled; the connector stores its whole blocks on its side stream in the same step (once
    the forward is launched, as get_finished does); the host waits for the stores and the CPU
    tier's K and V must equal the device blocks'; A finishes, and a prompt C sharing A's whole
    blocks hits the CPU tier (loaded into new device blocks, computed from its first token
    past them): C's logits must match a reference that recomputes every position. Then the
    eager cases with the stores deferred to the start of the next step (vLLM #31341), which a
    decode step of A issues: once with the host waiting for each step's output (sync
    scheduling), once with the host a step ahead (async scheduling: A's output is waited for
    only when the decode step starts, after the deferred stores were issued).

    Fixed: the side stream waits for an event recorded after the step's forward: every tier
    block equals the device's, C matches. Buggy: the stores issued in the step, and the
    deferred ones with the host a step ahead, copy A's blocks before the late compute stream
    writes them (what a fresh block holds: zeros); C loads those and attends over them: wrong
    logits (wrong result, on the GPU as on the CPU: the delay holds the forward's launches on
    the host until the host waits for them, so the copy runs first on either device). The
    deferred stores under sync scheduling run after the host waited for the step's output:
    they pass in both variants (the deferral alone suffices without overlap, as #45704 says).
    """
    problems, first = [], 1
    for deferred, ahead in RUNNERS:
        runner = _runner(ctx, deferred, ahead)
        timing = "a step later" + (", the host a step ahead" if ahead else "")
        for label, graph, blocks in CASES:
            if graph and deferred:
                continue
            name = f"{label}, stores {timing if deferred else 'in the step'}"
            problems += _case(runner, name, graph, blocks, first)
            first += 13
    expect_all(problems)
    return f"{first // 13} prompts stored to the CPU tier and hit from it"
