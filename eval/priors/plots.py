"""eval.priors' plots: the prior's bias curves by layer and head (priors.png), its learned parameters
(priors_shapes.png), how they moved in training (priors_training.png) and FoX's forget gates
(priors_gates.png), and the report's summary figure of BAM's shapes over training. The evaluator
(eval/priors/__init__.py) reads the priors and writes these."""

import math

import numpy as np

from eval.priors.section import FAR, far_heads
from eval.results import rows_by_step
from eval.variants import by_variant

GROUP_COLORS = ["tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple"]


def group_colors(model):
    """{group: colour} for a prior whose heads fall into named groups (BAM's shapes, docs/paper.md §2)."""
    groups = next((p.GROUPS for p in model.priors if p.GROUPS), {})
    return dict(zip(groups, GROUP_COLORS))


def _grid(n):
    cols = min(n, 4)
    return math.ceil(n / cols), cols


def plot_curves(results, dist, curves, path, colors):
    """One panel per prior module, titled by its (first) layer (one for all if the prior is shared), one line
    per head, coloured by group if any. `curves`: {layer: (heads, distances)} (bias_curves)."""
    from eval.plotting import plt, save_figure

    rows, cols = _grid(len(curves))
    fig, axes = plt.subplots(rows, cols, figsize=(max(6.5, 3.6 * cols), 2.9 * rows + 0.6), squeeze=False, sharex=True,
                             sharey=True)
    rows = {(r["layer"], r["head"]): r for r in results["heads"]}
    panels = list(curves.items())
    for idx, ax in enumerate(axes.flat):
        if idx >= len(panels):
            ax.set_axis_off()
            continue
        layer, layer_curves = panels[idx]
        for h, curve in enumerate(layer_curves):
            row = rows.get((layer, h), {})
            ax.plot(dist, curve, color=colors.get(row.get("group"), "tab:blue"), linewidth=1, alpha=0.8)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1e-2)
        ax.set_ylim(top=2e-3)  # every prior is <= 0: a log-prior, highest where the head looks
        ax.axvline(results["model"]["config"]["block_size"], color="gray", linestyle=":", linewidth=1)
        ax.set_title("all layers" if results["shared_across_layers"] else f"layer {layer}", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("distance i - j (tokens)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("prior bias g(d)", fontsize=8)
    rules = results["group_rules"] or {}
    handles = [plt.Line2D([], [], color=c, label=f"{g}: {rules[g]}") for g, c in colors.items()] \
        or [plt.Line2D([], [], color="tab:blue", label=f"{results['pe']}, one line per head")]
    handles.append(plt.Line2D([], [], color="gray", linestyle=":", label="training context"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"{results['model']['name']}: positional prior per head" +
                 (" (before SSMax's s log n)" if results["ssmax"] else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    save_figure(fig, path, dpi=110)


def plot_gates(results, gates, path):
    """FoX: the distribution of each head's forget gates, one panel per layer, each head's memory on top."""
    from eval.plotting import plt, save_figure

    rows, cols = _grid(len(gates))
    fig, axes = plt.subplots(rows, cols, figsize=(max(6.5, 3.6 * cols), 2.9 * rows + 0.4), squeeze=False, sharey=True)
    memory = {(r["layer"], r["head"]): r.get("memory") for r in results["heads"]}
    for idx, ax in enumerate(axes.flat):
        if idx not in gates:
            ax.set_axis_off()
            continue
        ax.boxplot(list(gates[idx]), whis=(5, 95), showfliers=False)
        ax.set_title(f"layer {idx}", fontsize=9)
        ax.set_ylim(0, 1.05)
        labels = [f"{h}\n{memory[(idx, h)]:.3g}" for h in range(len(gates[idx]))]
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=6)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("forget gate f", fontsize=8)
    fig.suptitle(f"{results['model']['name']}: forget gates per head (below each head: its memory "
                 "-1 / mean log f, in tokens)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def plot_shapes(results, path, prior_cls, colors):
    """A prior with head groups (BAM): histogram of the grouping parameter over the groups' spans, and
    that parameter against the next one per layer. Otherwise: a histogram of every learned per-head
    parameter (KERPLE's r1, r2; SSMax's s)."""
    from eval.plotting import plt, save_figure

    heads = results["heads"]
    name = results["model"]["name"]
    grouped = prior_cls is not None and prior_cls.GROUPS
    # every column some layer has: a layer_pattern's layers may differ (a prior in some, SSMax in others)
    learned = list(dict.fromkeys(c for r in heads for c in r if c not in ("layer", "head", "group", "bias_at",
                                                                          "slope")))
    if not grouped:
        fig, axes = plt.subplots(1, len(learned), figsize=(4.2 * len(learned), 3.5), squeeze=False)
        for ax, column in zip(axes[0], learned):
            ax.hist([r[column] for r in heads if column in r], bins=30, color="tab:purple")
            ax.set_xlabel(column)
            ax.set_ylabel("heads")
        fig.suptitle(f"{name}: per-head positional parameters of {len(heads)} heads", fontsize=10)
        fig.tight_layout()
        save_figure(fig, path, dpi=110)
        return
    column, other = prior_cls.GROUP_PARAMETER, prior_cls.SECOND_PARAMETER
    heads = [r for r in heads if column in r]  # the layers of the grouped prior
    values = np.array([r[column] for r in heads])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    edges = sorted({e for lo_hi in prior_cls.GROUP_SPANS.values() for e in lo_hi if math.isfinite(e)})
    low, high = min(values.min(), edges[0] - 0.4) - 0.1, max(values.max(), edges[-1] + 1.2) + 0.1
    for g, (lo, hi) in prior_cls.GROUP_SPANS.items():
        ax.axvspan(max(lo, low), min(hi, high), color=colors[g], alpha=0.12)
    counts, rules = results["groups"], results["group_rules"]
    ax.hist(values, bins=np.linspace(low, high, 41), color="black", alpha=0.75)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[g], alpha=0.35, label=f"{g} ({rules[g]}): {counts[g]}")
                       for g in colors], fontsize=8)
    ax.set_xlabel(f"{column} (1 = ALiBi/Laplace, 0 = flat/NoPE, < 0 = favours far tokens)")
    ax.set_ylabel("heads")
    ax.set_title(f"{name}: {column}s of {len(values)} heads", fontsize=10)
    points = ax2.scatter(values, [r[other] for r in heads], c=[r["layer"] for r in heads], cmap="viridis", s=14)
    fig.colorbar(points, ax=ax2, label="layer")
    for edge in edges:
        ax2.axvline(edge, color="gray", linewidth=0.8)
    ax2.set_xlabel(column)
    ax2.set_ylabel(other)
    ax2.set_title(f"{column} against {other}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def plot_training(results, history, path, prior_cls):
    """Every head's logged parameters (metrics.jsonl's "prior") against the training step, one colour per
    layer. Those that never moved (ALiBi's slopes, a frozen location) are left out."""
    from eval.plotting import plt, save_figure

    names = [n for n in history[-1][1] if any(prior.get(n) != history[0][1].get(n) for _, prior in history)]
    if not names:
        return
    steps = [s for s, _ in history]
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names), 3.6), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, name in zip(axes[0], names):
        values = np.array([prior[name] for _, prior in history if name in prior], dtype=float)  # (steps, layers, heads)
        n_layers = values.shape[1]
        for layer in range(n_layers):
            for head in range(values.shape[2]):
                ax.plot(steps[-len(values):], values[:, layer, head], color=cmap(layer / max(1, n_layers - 1)),
                        linewidth=0.8, alpha=0.7)
        if prior_cls is not None and prior_cls.GROUPS and name.endswith("_" + prior_cls.GROUP_PARAMETER):
            for edge in {e for span in prior_cls.GROUP_SPANS.values() for e in span if math.isfinite(e)}:
                ax.axhline(edge, color="gray", linewidth=0.8)  # the bounds of the head groups
        ax.set_xlabel("training step")
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, max(0, len(history[-1][1][names[0]]) - 1)))
    fig.colorbar(sm, ax=list(axes[0]), label="layer", fraction=0.03)
    fig.suptitle(f"{results['model']['name']}: positional parameters during training ({len(steps)} logged steps)",
                 fontsize=10)
    save_figure(fig, path, dpi=110, bbox_inches="tight")


def shapes_in_training(metrics_path, far_distance=None):
    """(steps, smallest shape b of any head, number of heads with b <= 0, number of far-reaching heads
    (far_heads at `far_distance` tokens; NaN at a step whose row lacks the log-scale or the location, and at
    every step without a distance)) of one run, from the BAM parameters its metrics.jsonl logs at every logged
    step (train.py's "prior" rows); None for a run without shapes."""
    rows = {step: row["prior"] for step, row in rows_by_step(metrics_path).items()
            if (row.get("prior") or {}).get("bam_shape")}
    if not rows:
        return None
    steps = sorted(rows)
    shapes = [np.asarray(rows[s]["bam_shape"], dtype=float) for s in steps]
    return (steps, [float(b.min()) for b in shapes], [int((b <= 0).sum()) for b in shapes],
            [far_heads_logged(rows[s], far_distance) for s in steps])


def far_heads_logged(prior, distance):
    """far_heads of one logged "prior" row, or NaN without a distance, a log-scale or a location."""
    if not distance or "bam_log_scale" not in prior or "bam_loc" not in prior:
        return math.nan
    return far_heads(prior["bam_shape"], prior["bam_log_scale"], prior["bam_loc"], distance)


def plot_shapes_in_training(runs, path):
    """eval.report's summary figure of BAM's shapes over training, every BAM run of the report: the smallest
    shape b against the step (top), how many heads have b <= 0, the paper's retrieval heads (middle), and how
    many heads' prior puts a key FAR x the training context back within one logit of its best key (bottom,
    far_heads, where the runs logged their scales); one line per run, a colour per variant. False (nothing
    drawn) when no run logged BAM shapes."""
    from eval.plotting import plt, save_figure

    variants = {}
    for variant, members in by_variant([r for r in runs if not r.overrides and r.metrics]).items():
        found = [(r, shapes_in_training(r.metrics, FAR * (r.pretraining_context or 0))) for r in members]
        found = [(r, s) for r, s in found if s is not None]
        if found:
            variants[variant] = found
    if not variants:
        return False
    far_drawn = any(not all(map(math.isnan, series[3])) for found in variants.values() for _, series in found)
    fig, axes = plt.subplots(3 if far_drawn else 2, 1, figsize=(9, 11.5 if far_drawn else 8), sharex=True)
    top, middle = axes[0], axes[1]
    for i, (variant, members) in enumerate(variants.items()):
        color, style = plt.get_cmap("tab10")(i % 10), ("-", "--", ":")[i // 10 % 3]
        for j, (run, (steps, smallest, retrieval, far)) in enumerate(members):
            label = f"{variant} ({len(members)} seed{'s' if len(members) > 1 else ''})" if j == 0 else None
            line = dict(color=color, linestyle=style, linewidth=1, alpha=0.85)
            top.plot(steps, smallest, label=label, **line)
            middle.plot(steps, retrieval, **line)
            if far_drawn:  # NaN (a step logged without scales) leaves a gap
                axes[2].plot(steps, far, **line)
    top.axhline(0, color="black", linewidth=0.8)
    top.set_ylabel("smallest shape b over all heads")
    top.set_title("BAM's shapes during training, one line per seed (below 0: a retrieval head)", fontsize=10)
    top.legend(fontsize=7, loc="best")  # runs of several budgets leave different corners free
    middle.set_ylabel("heads with b <= 0")
    if far_drawn:  # a head reaches far with b <= 0 or with a scale shrunk to a nearly flat prior
        axes[2].set_ylabel(f"heads whose prior at {FAR}x the context\nis within 1 logit of its best")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax is not top:
            ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))  # a count of heads
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return True
