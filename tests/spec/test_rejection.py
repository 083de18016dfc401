"""Verification: greedy acceptance, and rejection sampling that keeps the target distribution
exactly (a chi-square test over many draws, which an unconditional acceptance fails)."""

from __future__ import annotations

from collections import Counter

import torch

from pagedkv.spec.rejection import accept_greedy, accept_sampled

TARGET = torch.tensor([[0.05, 0.40, 0.25, 0.20, 0.10],   # after the last token
                       [0.30, 0.10, 0.30, 0.20, 0.10],   # after draft 0
                       [0.20, 0.20, 0.20, 0.20, 0.20]])  # after draft 1
DRAFTS = [2, 0]
DRAWS = 6000


def test_greedy_accepts_while_the_argmax_agrees():
    assert accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted, then the bonus
    assert accept_greedy([5, 9, 7], [5, 6]) == [5, 9]  # the target's token replaces draft 1
    assert accept_greedy([4, 6, 7], [5, 6]) == [4]


def chi_square_p_value(counts: Counter, probs: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square test of `counts` against `probs`."""
    total = sum(counts.values())
    observed = torch.tensor([counts[i] for i in range(len(probs))], dtype=torch.float64)
    expected = probs.double() * total
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(statistic / 2, dtype=torch.float64)))


def emitted_distributions(accept) -> tuple[Counter, Counter]:  # noqa: ANN001
    """The first emitted token's counts, and the second's given the first draft accepted."""
    first, second = Counter(), Counter()
    generator = torch.Generator().manual_seed(1234)
    for _ in range(DRAWS):
        run = accept(TARGET, DRAFTS, generator)
        assert 1 <= len(run) <= len(DRAFTS) + 1
        first[run[0]] += 1
        if run[0] == DRAFTS[0] and len(run) > 1:
            second[run[1]] += 1
    return first, second


def test_each_emitted_token_follows_the_target_distribution():
    first, second = emitted_distributions(accept_sampled)
    assert chi_square_p_value(first, TARGET[0]) > 1e-4
    assert chi_square_p_value(second, TARGET[1]) > 1e-4
    # Some drafts are accepted, some rejected: both branches ran.
    assert 0 < first[DRAFTS[0]] < DRAWS


def test_the_test_fails_for_unconditional_acceptance():
    def accept_all(probs, drafts, generator):  # noqa: ANN001, ANN202
        return [*drafts, int(torch.multinomial(probs[-1], 1, generator=generator))]

    first, _ = emitted_distributions(accept_all)
    assert chi_square_p_value(first, TARGET[0]) < 1e-6


def test_the_test_fails_for_a_residual_that_keeps_the_draft():
    def resample_from_p(probs, drafts, generator):  # noqa: ANN001, ANN202
        if float(torch.rand((), generator=generator)) < float(probs[0, drafts[0]]):
            return [drafts[0]]
        return [int(torch.multinomial(probs[0], 1, generator=generator))]

    first, _ = emitted_distributions(resample_from_p)
    assert chi_square_p_value(first, TARGET[0]) < 1e-6


def test_a_seeded_generator_gives_the_same_run():
    runs = [accept_sampled(TARGET, DRAFTS, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0] == runs[1]
