"""The n-gram proposer: the tokens that followed the last n-gram's most recent earlier
occurrence, longest n first."""

from __future__ import annotations

import random

from pagedkv.spec import SpeculativeConfig, build_proposer
from pagedkv.spec.ngram import NgramProposer, find_ngram_continuation


def test_continuation_of_the_most_recent_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert find_ngram_continuation(tokens, 3, 2) == [7, 8]  # not [9, 1]: the later one
    assert find_ngram_continuation(tokens, 3, 5) == [7, 8, 1, 2, 3]
    assert find_ngram_continuation([5, 6, 7, 8], 2, 3) == []  # no earlier occurrence
    assert find_ngram_continuation([4, 4, 4], 2, 3) == [4]  # overlapping the suffix
    assert find_ngram_continuation([1, 2], 2, 3) == []  # no room for an earlier one


def test_longest_ngram_wins_and_min_bounds_the_search():
    # The 1-gram [3] last occurred before 5; the 2-gram [2, 3] before 4.
    tokens = [2, 3, 4, 0, 3, 5, 0, 2, 3]
    long_first = NgramProposer(SpeculativeConfig("ngram", 2, 1, 2))
    assert long_first.propose(tokens, 10) == [4, 0]
    only_one = NgramProposer(SpeculativeConfig("ngram", 2, 1, 1))
    assert only_one.propose(tokens, 10) == [5, 0]
    only_three = NgramProposer(SpeculativeConfig("ngram", 2, 3, 3))
    assert only_three.propose(tokens, 10) == []


def test_proposal_capped_by_k_and_the_room_left():
    proposer = build_proposer(SpeculativeConfig("ngram", 3, 1, 2))
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.propose(tokens, 10) == [3, 4, 5]
    assert proposer.propose(tokens, 1) == [3]
    assert proposer.propose(tokens, 0) == []


def reference_continuation(tokens: list[int], n: int, k: int) -> list[int]:
    """The plain scan: the latest earlier end position whose n tokens equal the suffix."""
    if n <= 0 or len(tokens) <= n:
        return []
    suffix = tokens[-n:]
    for end in range(len(tokens) - 2, n - 2, -1):
        if tokens[end - n + 1:end + 1] == suffix:
            return tokens[end + 1:end + 1 + k]
    return []


def test_byte_search_equals_the_plain_scan():
    # Small vocabularies repeat a lot; large ids make byte patterns that match off a token
    # boundary, which must be skipped.
    rng = random.Random(0)
    for _ in range(1500):
        vocab = rng.choice([2, 3, 7, 300, 70000, 2**40])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        for n in (1, 2, 3):
            assert find_ngram_continuation(tokens, n, 3) == reference_continuation(tokens, n, 3)
    # The bytes of 2**56 + 1 (little-endian 01 0..0 01) straddle 2**56 and 2**48: no match.
    assert find_ngram_continuation([2**56, 2**48, 9, 2**56 + 1], 1, 2) == []
    assert find_ngram_continuation([2**56, 2**48, 2**56 + 1, 9, 2**56 + 1], 1, 2) == [9, 2**56 + 1]
