"""Probabilistic verification of a step's draft tokens (upstream: the rejection sampler of
speculative decoding), and what a verify step hands on.

A draft token d proposed with probability q is accepted where the target's probability p of
it passes a uniform draw u: p >= u * q (upstream: target_prob / draft_prob >= uniform_prob);
the first rejected draft ends the step's acceptance, and a token of the target's own takes its
place: the most probable other token (upstream samples it from the recovered distribution: the
one random draw here is u). When every draft is accepted, the bonus token is the target's most
probable next one (upstream samples it). The uniforms come from the runner's sampling
generator (ModelRunner._sampling_generator): under tensor parallelism every rank draws its own,
so the ranks accept the same drafts only where their generators were seeded alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SpecStep:
    """One request's verify step: the tokens it adds (accepted drafts, then the recovered or
    bonus token), how many drafts were accepted, and the hidden states of the tokens kept (its
    computed tokens before the drafts, and the accepted drafts), as the drafter's first
    tensor-parallel layer reduced them across the ranks."""

    tokens: list[int]
    num_accepted: int
    draft_hidden: torch.Tensor  # [kept tokens, hidden]


def rejection_sample(
    target_logits: torch.Tensor,
    draft_ids: list[int],
    draft_probs: list[float],
    uniforms: torch.Tensor,
) -> tuple[list[int], int]:
    """(tokens, accepted drafts) of one request: target_logits [k + 1, vocab] predict each
    draft position and the bonus one; uniforms [k], one per draft."""
    probs = torch.softmax(target_logits.float(), dim=-1)
    tokens = []
    for i, (draft, q) in enumerate(zip(draft_ids, draft_probs, strict=True)):
        if q > 0 and float(probs[i, draft]) >= float(uniforms[i]) * q:
            tokens.append(draft)
            continue
        recovered = probs[i].clone()
        recovered[draft] = -1.0  # the rejected draft is not recovered
        return [*tokens, int(recovered.argmax())], i
    return [*tokens, int(probs[len(draft_ids)].argmax())], len(draft_ids)
