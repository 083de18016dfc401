"""`pagedkv simulate --plot`: a run's figure names what it shows and carries the SLO's lines
and a running/queued panel whose counts are the scheduler's; `--sweep` and `--search` write a
plot of each metric against the setting (they wrote nothing before)."""

from __future__ import annotations

import pytest

from pagedkv.cli import main
from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency import FunctionLatency
from pagedkv.sim.plots import PlotTitle, run_figure, sweep_figure
from pagedkv.sim.results import SLO
from pagedkv.sim.search import sweep
from pagedkv.sim.simulator import simulate
from tests.sim.workloads import shared_prefix_trace

pytest.importorskip("matplotlib")
MOONCAKE = "tests/sim/data/mooncake_conversation_head40.jsonl"
PNG = b"\x89PNG\r\n\x1a\n"
TITLE = PlotTitle(trace="t.jsonl", model="qwen3-8b", hardware="h100", instances=2,
                  policy="kv-aware")
LATENCY = FunctionLatency(lambda shape: 2e-3 + 1e-4 * shape.prefill_tokens)


def line(ax, label: str):
    return next(x for x in ax.get_lines() if x.get_label() == label)


def test_a_runs_figure_has_its_title_slo_lines_and_queue_panel():
    config = SimConfig(num_blocks=60, block_size=8, max_num_seqs=4)
    result = simulate(shared_prefix_trace(num=30), config, LATENCY, num_instances=2,
                      policy="kv-aware")
    fig = run_figure(result, TITLE, SLO(ttft=0.5, e2e=3.0))
    title = fig._suptitle.get_text()
    for part in ("t.jsonl", "qwen3-8b", "h100", "2 instances (kv-aware)", "30 requests"):
        assert part in title, title
    usage, queues, latency = fig.axes
    assert usage.get_ylabel() == "KV usage (%)" and latency.get_xlabel() == "virtual time (s)"
    assert list(line(latency, "TTFT SLO 0.5 s").get_ydata()) == [0.5, 0.5]
    assert list(line(latency, "E2E SLO 3 s").get_ydata()) == [3.0, 3.0]
    running = line(queues, "running").get_ydata()
    queued = line(queues, "queued (waiting, swapped, loading)").get_ydata()
    # Two instances of at most 4 running each; 30 requests arriving faster than served queue.
    assert 0 < max(running) <= 2 * config.max_num_seqs and max(queued) > 0
    for inst in result.instances:
        assert len(inst.stats.running_values) == len(inst.stats.usage_times)
        assert max(inst.stats.running_values) <= config.max_num_seqs


def test_a_sweeps_figure_plots_each_metric_against_the_setting():
    config = SimConfig(num_blocks=60, block_size=8)
    trace = shared_prefix_trace(num=20)
    slo = SLO(ttft=0.2)
    rows = sweep(trace, config, LATENCY, "num_blocks", [40, 80, 160], slo=slo)
    fig = sweep_figure(rows, "num_blocks", TITLE, slo, target=0.9, answer=80, searched=True)
    goodput, latency, hits = fig.axes
    assert "fewest meeting the SLO: 80" in fig._suptitle.get_text()
    meeting = line(goodput, "meeting the SLO")
    assert list(meeting.get_xdata()) == [40, 80, 160]
    assert [pytest.approx(v) for v in meeting.get_ydata()] == \
        [100 * r["goodput"]["fraction"] for r in rows]
    assert list(line(latency, "TTFT SLO 0.2 s").get_ydata()) == [0.2, 0.2]
    assert all(ax.get_xlabel() == "num_blocks" for ax in fig.axes)
    assert hits.get_ylabel().startswith("prefix hit rate")
    # No SLO: no goodput panel; a setting of names is categorical.
    rows = sweep(trace, config, LATENCY, "preemption_mode", ["swap", "recompute"])
    fig = sweep_figure(rows, "preemption_mode", TITLE)
    assert len(fig.axes) == 2
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["recompute", "swap"]


def test_a_search_over_instances_names_no_fixed_count_and_ticks_whole_instances():
    rows = sweep(shared_prefix_trace(num=12), SimConfig(num_blocks=60, block_size=8), LATENCY,
                 "instances", [1, 2, 4], slo=SLO(ttft=0.2))
    fig = sweep_figure(rows, "instances", TITLE, SLO(ttft=0.2), answer=2, searched=True)
    title = fig._suptitle.get_text()
    assert "2 instances" not in title and "kv-aware routing" in title, title
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
    fig = sweep_figure(rows, "num_blocks", TITLE)  # another setting keeps the fleet
    assert "2 instances (kv-aware)" in fig._suptitle.get_text()


@pytest.mark.parametrize("flags", [
    ["--sweep", "num_blocks=100,200"],
    ["--search", "num_blocks", "--slo", "ttft=1"],
    ["--instances", "2", "--slo", "ttft=1,tpot=0.2"],
])
def test_the_cli_writes_a_plot_for_every_kind_of_run(tmp_path, capsys, flags):
    png = tmp_path / "plot.png"
    code = main(["simulate", MOONCAKE, "--latency", "linear", "--num-gpu-blocks-override",
                 "400", "--limit", "20", "--plot", str(png), *flags])
    err = capsys.readouterr().err
    assert code == 0, err
    assert png.read_bytes()[:8] == PNG and f"plot: {png}" in err
