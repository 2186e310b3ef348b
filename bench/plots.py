"""What the benchmarks' figures share: matplotlib without a display, bars labelled with their values, the
log-2 axis of concurrency levels, and how a figure is saved."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot drawing to files only (the Agg backend): benchmarks run on machines without a display.
    Imported on first use: matplotlib is an extra (`.[bench]`) that the rest of a benchmark does not need."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label_bars(ax, bars, labels: list[str], fontsize: float) -> None:
    """Each bar's label centred just above it."""
    for bar, label in zip(bars, labels, strict=True):
        xy = (bar.get_x() + bar.get_width() / 2, bar.get_height())
        ax.annotate(label, xy, ha="center", va="bottom", fontsize=fontsize)


def concurrency_axis(ax, levels: list[int], label: str) -> None:
    """An x axis of concurrency levels (powers of two): log-2 scale, one tick per level."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(v) for v in levels])
    ax.set_xlabel(label)


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # a legend beside the axes stays in the picture
    pyplot().close(fig)
