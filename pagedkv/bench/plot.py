"""PNG charts for the benchmarks' `--plot PATH` (matplotlib, imported only when asked: it is
not a dependency; a missing matplotlib is a SystemExit saying how to install it)."""

from __future__ import annotations

from collections.abc import Sequence


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def bar_chart(path: str, title: str, groups: Sequence[str], series: dict[str, Sequence[float]],
              *, ylabel: str = "") -> None:
    """Grouped bars: one group per label in `groups`, one bar per series; written to `path`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(groups) + 2), 3.2), dpi=110)
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def line_chart(path: str, title: str, xs: Sequence[float], series: dict[str, Sequence[float]],
               *, xlabel: str = "", ylabel: str = "") -> None:
    """One line per series over `xs`; written to `path`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.2), dpi=110)
    for name, values in series.items():
        ax.plot(list(xs), list(values), marker="o", label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
