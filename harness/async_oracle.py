"""The async engine's oracle (test code): every launched step's logits, at the positions the
device ran them, vs the float64 reference of the host's final tokens up to that position.

The positions are the step's after the device's shift (rejected drafts); a token counts when
its position is in the request's sequence (a rejected draft's is not) and inside the host's
final tokens (a step scheduled after the request's last output is not).
"""

from __future__ import annotations

from harness.oracle import close
from harness.reference import recomputed_logits
from harness.runner.async_engine import AsyncEngine
from harness.runner.model_runner import ModelRunner


def engine_problems(runner: ModelRunner, engine: AsyncEngine) -> list[str | None]:
    """One comparison per launched step."""
    tokens = {q.req_id: q.prompt + tuple(q.output) for q in engine.scheduler.finished}
    problems = []
    for n, step in enumerate(engine.steps):
        owners = [q.req_id for q in step.requests for _ in q.token_ids]
        rows, seqs = [], []
        for t, (rid, pos) in enumerate(zip(owners, step.positions.tolist(), strict=True)):
            if step.valid[t] and pos < len(tokens[rid]):
                rows.append(t)
                seqs.append(list(tokens[rid][: pos + 1]))
        if not rows:  # every token past its request's last output (or a rejected draft)
            continue
        names = ", ".join(q.req_id for q in step.requests)
        what = f"step {n} ({names}) logits at positions {step.positions[rows].tolist()}"
        problems.append(
            close(f"{what} vs reference", step.logits[rows], recomputed_logits(runner, seqs))
        )
    return problems
