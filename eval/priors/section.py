"""
eval.report's section of the learned priors (eval.priors): BAM's heads per shape group for every run; over
the seeds of each BAM variant, whether the seeds that grew heads of b <= 0 are the ones that retrieve far;
and, for BAM variants that differ in one numeric setting only (the prior's learning rate at 1x, 3x, 10x and
30x in docs/repro.md), one table against that setting: a dose and its response.
"""

import json

import torch

from eval import variants
from eval.tables import DASH, length_label, table
from eval.variants import by_variant
from model import ggd_bias


def longest_passkey(run):
    """(length, accuracy %) of the run's plain passkey results at their longest length, or None."""
    results = run.all("passkey").get("passkey")
    if not results or not results["results"]:
        return None
    cell = max(results["results"], key=lambda x: x["length"])
    return cell["length"], 100.0 * cell["correct"] / cell["samples"]


def retrieval_heads(priors):
    """How many BAM heads ended with b <= 0 (the retrieval and aggressive groups)."""
    return priors["groups"]["retrieval"] + priors["groups"]["aggressive"]


FAR = 8  # far_heads reads each head's prior at 8x the training context (1,024 tokens in the 128-token grid)


def far_heads(shape, log_scale, mu, distance):
    """How many BAM heads let a key `distance` tokens back within one logit of the key their prior favours
    most over distances 0 to `distance` (model.py's own prior, ggd_bias: -scale x (|d - mu| + eps)^b). The
    prior is monotone in |d - mu|, so that best key is at mu (b > 0, clamped to the range) or at the end of
    the range farther from mu (b < 0), and evaluating the three candidates is exact. With mu = 0, every head
    of b <= 0 counts (its prior rises with the distance, or is flat), and a head of b > 0 counts once its
    scale shrank until the prior is nearly flat (scale 0.025 and b = 0.04 cost 0.03 logits at 1,000 tokens).
    The logit is the prior's, before SSMax's factor s log n, which multiplies content and prior alike. The
    parameters per head (any nesting: per layer, then head), as eval.priors' table and train.py's metrics
    give them: the shape, the log-scale and the location mu = 2 sinh(l) itself."""
    shape, log_scale, mu = (torch.tensor(x, dtype=torch.float64).flatten() for x in (shape, log_scale, mu))
    head, l = torch.arange(len(shape)), torch.asinh(mu / 2)  # ggd_bias takes l, the parameter, not mu
    far = torch.full_like(mu, float(distance))
    best = torch.stack([ggd_bias(d, head, shape, log_scale, l)
                        for d in (torch.zeros_like(mu), far, mu.clamp(0, distance))]).max(0).values
    return int((ggd_bias(far, head, shape, log_scale, l) - best > -1).sum())


def far_heads_of(run):
    """far_heads of a run's eval.priors results at FAR x its training context, or None (no context known, or
    heads without a shape, a log-scale and a location). A prior shared by all layers is listed once per layer
    there: its heads are counted once, as train.py's metrics log them."""
    priors, context = run.get("priors"), run.pretraining_context
    heads = [h for h in priors["heads"] if "shape" in h]  # a layer_pattern's BAM layers
    first = min((h["layer"] for h in heads), default=0)
    heads = [h for h in heads if not priors.get("shared_across_layers") or h["layer"] == first]
    if not context or not heads or not all(k in h for h in heads for k in ("shape", "log_scale", "loc")):
        return None
    return far_heads([h["shape"] for h in heads], [h["log_scale"] for h in heads], [h["loc"] for h in heads],
                     FAR * context)


def seeds_lines(runs):
    """Per BAM variant of several seeds: how many seeds grew a head with b <= 0, and the passkey accuracy at
    the longest length of the seeds that did against those that did not (the question docs/repro.md asks of
    the seed spread: is long retrieval the seeds that learned retrieval heads?)."""
    rows, longest = [], set()
    for variant, members in by_variant(runs).items():
        seeds = [(retrieval_heads(r.get("priors")), longest_passkey(r)) for r in members
                 if (r.get("priors") or {}).get("groups") and longest_passkey(r)]
        if len(seeds) < 2:
            continue
        longest |= {at[0] for _, at in seeds}
        grew = [at[1] for heads, at in seeds if heads > 0]
        did_not = [at[1] for heads, at in seeds if heads == 0]
        mean = lambda xs: f"{sum(xs) / len(xs):.0f} ({', '.join(f'{x:.0f}' for x in xs)})" if xs else DASH
        rows.append([variant, len(seeds), len(grew), mean(grew), mean(did_not)])
    if not rows:
        return []
    at = f"at {max(longest):,} tokens" if len(longest) == 1 else "at each run's longest length"
    return ["", f"BAM variants by seed: the seeds that ended with a head of b <= 0 (retrieval or aggressive), and "
                f"the mean passkey accuracy (%) {at} of the seeds that did and of those that did not (each seed's "
                f"in brackets).", ""] + table(
        ["variant", "seeds", "seeds with a b <= 0 head", "passkey, those seeds", "passkey, the others"], rows)


def section(runs, report_options):
    """BAM's head groups per run (with its passkey accuracy at the longest length, when it has one), then per
    BAM variant of several seeds, the seeds that grew b <= 0 heads against their accuracy; other priors have
    no shapes to group."""
    rows = []
    for r in runs:
        p = r.get("priors")
        if not p:  # no prior (NoPE, RoPE), or not evaluated: nothing to say here
            continue
        at = longest_passkey(r)
        passkey = f"{at[1]:.0f} at {at[0]:,}" if at else DASH
        if not p.get("groups"):
            rows.append([r.name, DASH, DASH, DASH, f"{p['pe']}: no shapes", DASH, passkey])
            continue
        g = p["groups"]
        shapes = sorted(h["shape"] for h in p["heads"] if "shape" in h)
        far = far_heads_of(r)
        rows.append([r.name, g["local"], g["retrieval"], g["aggressive"],
                     f"{shapes[0]:.2f} / {shapes[len(shapes) // 2]:.2f} / {shapes[-1]:.2f}",
                     DASH if far is None else far, passkey])
    return ["BAM heads per shape group (docs/paper.md §2): local b > 0, retrieval -0.6 <= b <= 0, "
            f"aggressive b < -0.6; the heads whose prior puts a key {FAR}x the training context back within one logit "
            "of the key it favours most (every b <= 0 head, and a b > 0 head whose scale shrank until its prior is "
            "nearly flat); and the "
            "run's passkey accuracy (%) at its longest length.", ""] + table(
        ["run", "local", "retrieval", "aggressive", "shape min / median / max", f"within 1 logit at {FAR}x",
         "passkey"], rows) + seeds_lines(runs) + setting_lines(runs)


def setting_value(key, settings):
    """Where a variant sits along `key`: its value, except the prior's learning rate, as a multiple of the base
    learning rate (unset: the prior trains at the base rate, x1)."""
    value = settings.get(key)
    if key == "train.prior_lr" and settings.get("train.lr"):
        return (value or settings["train.lr"]) / settings["train.lr"]
    return value


def setting_lines_of(runs):
    """[(key, [(value, variant name, its settings, its runs)])]: the BAM variants (as trained) in lines along one setting,
    three or more variants whose settings differ in that one numeric key and in nothing else."""
    found = {}
    for variant, members in by_variant([r for r in runs if not r.overrides and r.config]).items():
        settings = variants.experiment(members[0].config)
        if settings.get("model.pe") == "bam":
            found[variant] = (settings, members)
    lines = []
    for key in sorted({k for settings, _ in found.values() for k in settings}):
        rest = {}
        for variant, (settings, members) in found.items():
            value = setting_value(key, settings)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                others = json.dumps({k: v for k, v in settings.items() if k != key}, sort_keys=True, default=str)
                rest.setdefault(others, []).append((value, variant, settings, members))
        lines += [(key, sorted(line, key=lambda entry: entry[0])) for line in rest.values()
                  if len({entry[0] for entry in line}) >= 3]
    return lines


def accuracy_at(run, length):
    """The run's plain passkey accuracy (%) at `length` tokens, or None where it was not asked there."""
    results = run.all("passkey").get("passkey") or {}
    cells = [c for c in results.get("results") or [] if c["length"] == length and c["samples"]]
    return 100.0 * cells[0]["correct"] / cells[0]["samples"] if cells else None


def setting_lines(runs):
    """One table per line of BAM variants along a setting (setting_lines_of): per variant, its seeds that
    trained to the end and those train.py's divergence guard stopped, the mean passkey accuracy at 16x and 64x
    of the training context (or at the longest length asked; a seed not asked there is left out of the mean),
    and per seed its heads of b <= 0 and its smallest shape."""
    out = []
    for key, line in setting_lines_of(runs):
        evaluated = [r for *_, members in line for r in members if longest_passkey(r)]
        if not evaluated:
            continue
        asked = sorted({c["length"] for r in evaluated for c in r.get("passkey")["results"]})
        context = evaluated[0].pretraining_context
        lengths = [n for n in asked if context and n / context in (16, 64)] or asked[-1:]
        rows = []
        for _, variant, settings, members in line:
            stopped = [r for r in members if r.divergence]
            done = [r for r in members if longest_passkey(r) and r not in stopped]
            cells = []
            for n in lengths:
                seen = [a for a in (accuracy_at(r, n) for r in done) if a is not None]
                cells.append(f"{sum(seen) / len(seen):.0f} [{' '.join(f'{a:.0f}' for a in seen)}]" if seen else DASH)
            shaped = [r for r in done if (r.get("priors") or {}).get("groups")]
            heads = [retrieval_heads(r.get("priors")) for r in shaped]
            smallest = [min(h["shape"] for h in r.get("priors")["heads"]) for r in shaped]
            far = [far_heads_of(r) for r in shaped]
            seeds = f"{len(done)}" + (f" (+{len(stopped)} diverged)" if stopped else "")
            rows.append([variants.describe_setting(key, settings.get(key), settings), variant, seeds, *cells,
                         f"{sum(h > 0 for h in heads)} of {len(heads)}" if heads else DASH,
                         " ".join(map(str, heads)) or DASH, " ".join(f"{b:.2f}" for b in smallest) or DASH,
                         " ".join(DASH if n is None else str(n) for n in far) or DASH])
        name = key.split(".", 1)[1].replace("_", " ")
        out += ["", f"BAM variants along one setting, {name}: the seeds that trained to the end (and those the "
                    f"divergence guard stopped), their mean passkey accuracy (%) with each seed's in brackets, the "
                    f"seeds that ended with a head of b <= 0, and each seed's heads of b <= 0, smallest shape b and heads "
                    f"whose prior is within one logit of its best at {FAR}x the training context.",
                ""] + table([name, "variant", "seeds", *(length_label(n, evaluated) for n in lengths),
                             "seeds with a b <= 0 head", "b <= 0 heads, each seed", "smallest b, each seed",
                             f"within 1 logit at {FAR}x, each seed"], rows)
    return out
