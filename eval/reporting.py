"""What an evaluator's report section is made of: the runs (`Run`, one column of the report each) and the
cells and tables of markdown they become. eval.report finds the runs and calls every section with them."""

import math
import os
from dataclasses import dataclass, field

from eval.sweep import format_factor
from model import ENCODINGS

DASH = "—"  # an evaluation a run does not have


@dataclass
class Run:
    """One column of the report: a run's results under one set of model overrides ({} = as trained)."""

    path: str  # as given on the command line
    folder: str  # its eval folder
    name: str  # the column's name: the run's, then ": <overrides label>"
    overrides: dict
    results: dict = field(default_factory=dict)  # {schema: {results file stem: results}}
    model: dict | None = None  # the "model" block of its results
    tokens: int | None = None  # tokens trained
    step: int | None = None
    config: dict | None = None  # the run's resolved config (RUN/config.toml as a new run reads it), if any
    variant: str = ""  # the name of its variant: the runs whose configs differ only in the seed (eval.variants)
    seed: int | None = None
    metrics: str | None = None  # the run's metrics.jsonl (train.py's log), if it has one

    def all(self, schema):
        """{file stem: results} of one evaluator (passkey keeps several: passkey, passkey_given1, ...)."""
        return self.results.get(schema, {})

    def get(self, schema):
        """The results of one evaluator: the file named after it, else the first; None without any."""
        found = self.all(schema)
        return found.get(schema, next(iter(found.values()), None))

    @property
    def block_size(self):
        return ((self.model or {}).get("config") or {}).get("block_size")

    @property
    def pretraining_context(self):
        """The context a length is a multiple of: for a model extended with a RoPE scaling, the one it was
        pretrained at (rope_original_context; a YaRN fine-tune from 128 to 512 tokens asked at 1,024 is at 8x),
        else its block_size: model.ModelConfig.rope_context's rule, on the config dict the results hold, or
        on the run's config.toml for a run without results (one the divergence guard stopped)."""
        config = ((self.model or {}).get("config") or ((self.config or {}).get("model")) or {})
        return config.get("rope_original_context") or config.get("block_size")

    def plot_path(self, schema, suffix=""):
        """<results file stem><suffix>.png of the main results of `schema`, or None."""
        results = self.get(schema)
        return os.path.splitext(results["_file"])[0] + suffix + ".png" if results else None


def by_family(variants):
    """{family: [variant names]} of {variant: [its runs]}, by the encoding's family (model.ENCODINGS), for
    small multiples: RoPE and its extensions in one panel, additive priors in another, ..., the families in
    the registry's order."""
    families = {}
    for variant, members in variants.items():
        pe = ((members[0].model or {}).get("config") or {}).get("pe") or ((members[0].config or {}).get("model") or {}).get("pe")
        families.setdefault(getattr(ENCODINGS.get(pe), "family", "other"), []).append(variant)
    order = list(dict.fromkeys(e.family for e in ENCODINGS.values()))  # baselines, RoPE, ..., as the registry
    return dict(sorted(families.items(), key=lambda f: order.index(f[0]) if f[0] in order else len(order)))


def by_variant(runs):
    """{variant name: [its runs, one per seed]}, in the order the variants first appear."""
    variants = {}
    for run in runs:
        variants.setdefault(run.variant or run.name, []).append(run)
    return variants


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def binomial_interval(successes, trials, z=1.959963984540054):
    """Wilson's 95% score interval (low, high) for a success rate seen as successes / trials: unlike the
    normal approximation it stays inside [0, 1] and is not empty at 0% or 100%, where short passkey
    sweeps often sit. (None, None) without trials."""
    if not trials:
        return None, None
    p, n = successes / trials, trials
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


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
