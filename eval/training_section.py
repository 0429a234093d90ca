"""
The report's training section: the loss each variant reached and how it got there, from every run's
RUN/metrics.jsonl (train.py's log, kept with the run even where its checkpoints are not, as
configs/repro/grid5.sh keeps docs/repro/runs5). A variant that learned nothing shows it here first: its
passkey row is empty and its loss curve stays flat. A run that train.py's divergence guard stopped is shown
where it stopped and why, its curve ending in an x.

Only a run's own training counts: evaluator overrides ("rope_seed1: rope + YaRN auto") share the run's
training and are left out. The training loss of a step is its batch's; the table gives its mean over the
last tenth of the logged steps, so one noisy batch does not set it, and the last validation loss.
"""

import numpy as np

from eval.results import rows_by_step
from eval.tables import DASH, table
from eval.variants import by_family, by_variant


def curves(path):
    """(steps, training losses), (steps, validation losses) of one metrics.jsonl; the last row of a step
    wins (a run resumed from a checkpoint logs that checkpoint's later steps again)."""
    rows = rows_by_step(path)
    steps = sorted(rows)
    train = [(s, rows[s]["loss"]) for s in steps if isinstance(rows[s].get("loss"), (int, float))]
    val = [(s, rows[s]["val_loss"]) for s in steps if isinstance(rows[s].get("val_loss"), (int, float))]
    return tuple(map(list, zip(*train))) or ([], []), tuple(map(list, zip(*val))) or ([], [])


def trained(runs):
    """{variant: [(run, curves, divergence)]} of the runs as trained (no overrides) whose metrics.jsonl has a
    loss; divergence is None for a run that did not diverge."""
    found = {}
    for variant, members in by_variant([r for r in runs if not r.overrides and r.metrics]).items():
        kept = [(r, curves(r.metrics), r.divergence) for r in members]
        kept = [(r, c, stop) for r, c, stop in kept if c[0][0]]
        if kept:
            found[variant] = kept
    return found


def final_train_loss(train):
    steps, losses = train
    return float(np.mean(losses[-max(1, len(losses) // 10):]))


# What data.loss_on takes the loss over, in the table's words
LOSS_OVER = {"all": "every token", "passkey_answers": "passkey answers"}


def loss_text(value):
    """Four significant digits: 3.457 for a language model's loss, and 0.0001234 rather than 0.000 for a loss on
    the passkey's answer tokens (data.loss_on = "passkey_answers"), which a trained model drives near zero."""
    return f"{value:#.4g}"


def seeds_cell(values):
    """The mean over seeds, each seed's value in brackets (only the mean for one seed)."""
    if not values:
        return DASH
    mean = loss_text(float(np.mean(values)))
    return mean if len(values) == 1 else f"{mean} [{' '.join(loss_text(v) for v in values)}]"


def loss_over(run):
    """What the run's losses are taken over, from its data.loss_on (a run without a config.toml: unknown)."""
    if run.config is None:
        return DASH
    loss_on = run.config.get("data", {}).get("loss_on", "all")
    return LOSS_OVER.get(loss_on, loss_on)


def section(runs):
    """The '## Training' lines: per variant, steps, final training and validation loss over its seeds."""
    variants = trained(runs)
    if not variants:
        return []
    rows, notes = [], []
    for variant, members in variants.items():
        # The losses of the seeds that trained to the end; a seed that diverged early is not averaged with
        # them (its loss is that of a shorter run), unless no seed got further.
        counted = [c for _, c, stop in members if not stop] or [c for _, c, _ in members]
        steps = [f"{s:,}" for s in sorted({c[0][0][-1] for _, c, stop in members if not stop})]
        for r, _, stop in members:
            if stop:
                steps.append(f"seed {r.seed} diverged at {stop[0]:,}")
                notes.append(f"- {r.name} ({variant}) diverged at step {stop[0]:,}: {stop[1]}")
        rows.append([variant, len(members), "; ".join(steps), loss_over(members[0][0]),
                     seeds_cell([final_train_loss(c[0]) for c in counted]),
                     seeds_cell([c[1][1][-1] for c in counted if c[1][1]])])
    return (["## Training", "",
             "From each run's metrics.jsonl: the training loss (nats per token, over the tokens that data.loss_on "
             "names: every token, or only the passkey's answer tokens) averaged over the last tenth of the logged "
             "steps, and the last validation loss, over the same tokens; the mean over the variant's seeds, each "
             "seed's in brackets (over the seeds that trained to the end when some diverged).", ""]
            + table(["variant", "seeds", "steps", "loss over", "training loss, end", "validation loss, last"], rows)
            + ([""] + notes if notes else []))


def plot(runs, path):
    """Training loss against step in small multiples by family: per variant the mean over its seeds
    (each seed smoothed over 5 logged steps), a band over the seeds' range, the validation losses as dots.
    False (nothing drawn) when no run has a metrics.jsonl."""
    from eval.plotting import family_panels, finish_panels, plt

    variants = trained(runs)
    if not variants:
        return False
    families = by_family({v: [r for r, _, _ in members] for v, members in variants.items()})
    fig, axes, panels = family_panels(families, height=4.0)
    for ax, family, names in panels:
        for i, variant in enumerate(names):
            color, style = plt.get_cmap("tab10")(i % 10), ("-", "--", ":")[i // 10 % 3]
            members = []
            for r, c, stop in variants[variant]:  # a diverged seed: its own thin line to an x where it stopped
                if not stop:
                    members.append((r, c))
                    continue
                ax.plot(*c[0], color=color, linewidth=0.8, alpha=0.7)
                ax.plot(*c[1], linestyle="none", marker=".", markersize=4, color=color)
                ax.plot(c[0][0][-1], c[0][1][-1], marker="x", markersize=7, color=color,
                        label=f"{variant}: seed {r.seed} diverged at step {stop[0]:,}")
            if not members:
                continue
            steps = sorted(set.intersection(*(set(c[0][0]) for _, c in members)))
            smooth = np.array([np.convolve(np.interp(steps, *c[0]), np.ones(5) / 5, mode="valid") for _, c in members])
            x = steps[2:len(steps) - 2] if len(steps) >= 5 else []
            if not len(x):
                continue
            ax.plot(x, smooth.mean(0), color=color, linestyle=style, linewidth=1.2,
                    label=f"{variant} ({len(members)} seed{'s' if len(members) > 1 else ''})")
            if len(members) > 1:
                ax.fill_between(x, smooth.min(0), smooth.max(0), color=color, alpha=0.15, linewidth=0)
            for _, c in members:
                ax.plot(*c[1], linestyle="none", marker=".", markersize=4, color=color)
        ax.set_yscale("log")
        ax.set_title(family, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper right")
    finish_panels(fig, axes, len(families), "training loss (dots: validation)",
                  "training loss by variant: mean over seeds, band = the seeds' range", path)
    return True
