"""Markdown tables and their cells, as the evaluators print them and the report's sections are made of: a
dash for an evaluation a run does not have, a retrieval rate with its interval, a count in K/M/B, a length
with its multiple of the training context."""

from eval.stats import binomial_interval
from eval.sweep import format_factor

DASH = "—"  # an evaluation a run does not have


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def rate(successes, trials):
    """A retrieval cell: the rate in %, its Wilson 95% interval and the number of trials."""
    if not trials:
        return DASH
    low, high = binomial_interval(successes, trials)
    return f"{100 * successes / trials:.0f} ({100 * low:.0f}-{100 * high:.0f}, n={trials})"


def human(n):
    if n is None:
        return DASH
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def length_label(n, runs):
    """A length as a column heading: with its multiple of the training context when the runs share one."""
    sizes = {r.pretraining_context for r in runs if r.pretraining_context}
    return f"{n:,}" + (f" ({format_factor(n / sizes.pop())}x)" if len(sizes) == 1 else "")
