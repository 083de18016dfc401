"""Verifying draft tokens against the target model (Leviathan et al., 2023).

Row j of the target's distributions is what the target gives the token after draft j (row 0:
after the request's last token, for the first draft). Greedy: each draft is accepted while it is
the target's argmax; the first mismatch emits the target's token instead, and a fully accepted
proposal emits the target's next token too (the "bonus" token). Sampling: the proposers here
are deterministic, so the draft distribution q is one-hot at the draft x, and the rule
accept-with-probability min(1, p(x) / q(x)) becomes: accept x with probability p(x); on a
rejection draw from the normalised max(p - q, 0), which is p without x. Each emitted token is
then distributed exactly as the target's own sample would be. Random numbers come from the
request's generator: k uniforms, then one exponential-race draw (argmax of w / Exp(1) noise, as
the sampler draws), so a seeded request emits the same tokens on every run.
"""

from __future__ import annotations

import torch


def accept_greedy(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """The run greedy verification emits: `target_tokens[j]` is the target's argmax after
    draft j (k + 1 entries for k drafts)."""
    out = []
    for j, draft in enumerate(drafts):
        out.append(target_tokens[j])
        if target_tokens[j] != draft:
            return out
    out.append(target_tokens[len(drafts)])
    return out


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn with probability proportional to `weights` [V] (exponential race)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())


def accept_sampled(probs: torch.Tensor, drafts: list[int],
                   generator: torch.Generator | None) -> list[int]:
    """The run rejection sampling emits for one-hot drafts: `probs` [k + 1, V] are the
    target's (warped) distributions after the last token and after each draft."""
    k = len(drafts)
    uniforms = torch.rand(k, generator=generator, device=probs.device)
    index = torch.arange(k, device=probs.device)
    p_draft = probs[index, torch.tensor(drafts, device=probs.device)]
    out: list[int] = []
    for j, accepted in enumerate((uniforms < p_draft).tolist()):
        if not accepted:
            residual = probs[j].clone()
            residual[drafts[j]] = 0.0
            out.append(draw(residual, generator))
            return out
        out.append(drafts[j])
    out.append(draw(probs[k], generator))
    return out
