"""Which of two fleets serves more requests within an SLO (the DistServe question), asked of
per-request latencies: a real run's and a simulated one's alike, so the simulator's answer can
be checked against the real answer SLO by SLO (benchmarks/bench_pd.py --vs-sim,
tests/sim/test_split_vs_real.py).

A row is a mapping with `ttft` and `tpot` in seconds (`tpot` None: one output token, TTFT
alone decides). A fleet wins by more than `margin` requests, else it is a tie: on a few dozen
requests one request either way is noise. The simulator's answer is wrong when it names the
other fleet than the real run does (a flip); a tie on one side and a winner on the other is a
close call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.sim.results import percentile

Rows = Sequence[Mapping[str, Any]]
QUANTILES = (25, 50, 75, 90)


def within(rows: Rows, ttft: float, tpot: float) -> int:
    """The rows whose TTFT and TPOT are within the targets."""
    return sum(1 for r in rows if r["ttft"] is not None and r["ttft"] <= ttft
               and (r["tpot"] is None or r["tpot"] <= tpot))


def winner(a: int, b: int, names: tuple[str, str], margin: int = 1) -> str:
    return names[0] if a > b + margin else names[1] if b > a + margin else "tie"


def flipped(decision: dict[str, Any]) -> bool:
    """Whether the simulator named the other fleet than the real run (ties never flip)."""
    sides = {decision["real_winner"], decision["sim_winner"]}
    return "tie" not in sides and len(sides) == 2


def slo_grid(rows: Rows, quantiles: Sequence[float] = QUANTILES) -> list[tuple[float, float]]:
    """(ttft, tpot) targets at the rows' own quantiles of each, every pair: where the answer
    can go either way."""
    targets = []
    for name in ("ttft", "tpot"):
        values = sorted(r[name] for r in rows if r[name] is not None)
        targets.append(sorted({percentile(values, q) for q in quantiles}))
    return [(ttft, tpot) for ttft in targets[0] for tpot in targets[1]]


def slo_winners(real: tuple[Rows, Rows], simulated: tuple[Rows, Rows],
                names: tuple[str, str] = ("split", "mixed"),
                margin: int = 1) -> list[dict[str, Any]]:
    """Per SLO of the real runs' grid (`slo_grid` over both fleets' real rows): the requests
    each fleet serves within it, real and simulated, and each side's winner (by more than
    `margin` requests)."""
    out = []
    for ttft, tpot in slo_grid([*real[0], *real[1]]):
        counts = [within(rows, ttft, tpot) for rows in (*real, *simulated)]
        out.append({"ttft": ttft, "tpot": tpot, "real": counts[:2], "sim": counts[2:],
                    "real_winner": winner(*counts[:2], names, margin),
                    "sim_winner": winner(*counts[2:], names, margin)})
    return out
