"""A PNG of the lag distributions, side by side: one cumulative curve per system (matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.report import Result


def lag_chart(results: Sequence[Result], path: Path, title: str, what: str = "start lag (the task began)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    for result in results:
        lags = sorted(result.start_lags)
        if not lags:
            continue
        share = [100 * (i + 1) / len(lags) for i in range(len(lags))]
        p99 = result.start_lag["p99"] if result.start_lag else lags[-1]
        ax.plot(lags, share, label=f"{result.system} (p99 {p99:.2f} s)", linewidth=2)
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlabel(f"seconds after the due time: {what}")
    ax.set_ylabel("% of runs")
    ax.set_ylim(0, 100.5)
    ax.grid(True, which="both", alpha=0.3)
    ax.axhline(99, color="grey", linestyle=":", linewidth=1)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
