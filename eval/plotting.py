"""What the evaluators' plots share. This is the one module that imports matplotlib, and a plot function
imports it when it draws: loading a model, sampling from it (sample.py) or importing an evaluator never
loads a plotting library."""

import math

import matplotlib

matplotlib.use("Agg")  # files only; no display on clusters

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bam.outputs import atomic_file
from eval.sweep import format_length  # noqa: E402


def save_figure(fig, path, **kwargs):
    """fig.savefig through the atomic writer: a full disk leaves the previous plot, never half a PNG."""
    try:
        with atomic_file(path, "wb") as f:
            fig.savefig(f, format="png", **kwargs)
    finally:
        plt.close(fig)


def draw_heatmap(ax, matrix, row_labels, col_labels, xlabel, ylabel, title):
    """Accuracy in [0, 1] per cell, red to green; NaN (not measured) is grey. Rows run upward, so longer
    lengths sit higher, as on the paper's plots."""
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#d9d9d9")
    data = np.ma.masked_invalid(np.asarray(matrix, dtype=float))
    image = ax.imshow(data, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", origin="lower",
                      interpolation="nearest")
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=45 if len(col_labels) > 6 else 0, ha="right"
                  if len(col_labels) > 6 else "center", fontsize=8)
    ax.set_yticks(range(len(row_labels)), row_labels, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if data.shape[0] * data.shape[1] <= 400:  # small enough to print every value legibly
        for (r, c), value in np.ndenumerate(np.asarray(matrix, dtype=float)):
            if not math.isnan(value):
                ax.text(c, r, f"{100 * value:.0f}", ha="center", va="center", fontsize=7,
                        color="black" if 0.25 < value < 0.85 else "white")
    return image


def log2_length_axis(ax):
    """An x axis of token counts on a log2 scale, ticks written as 512, 4K, 256K."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: format_length(int(v)) if v >= 1 else ""))


def family_panels(families, height=4.2):
    """(fig, axes, [(ax, family, its variants)]): one panel per family of encodings, two per row, sharing
    the y axis (the report's small multiples, eval.variants.by_family)."""
    columns = min(2, len(families))
    rows = -(-len(families) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7.0 * columns, height * rows), squeeze=False, sharey=True)
    return fig, axes, [(ax, family, variants) for ax, (family, variants) in zip(axes.flat, families.items())]


def finish_panels(fig, axes, used, ylabel, title, path):
    """The y label on the first column, the panels left over blanked, the title; saved to `path`."""
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[used:]:
        ax.set_axis_off()
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
