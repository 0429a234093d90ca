"""Evaluators for trained checkpoints, each runnable as `python -m eval.<name> RUN_DIR_OR_CHECKPOINT`:

    passkey      retrieval of a 5-digit key hidden in garbage text, up to 500x the training context
    niah         RULER-style needle-in-a-haystack (single, multi-key, multi-value, multi-query)
    perplexity   loss per position window over held-out validation text, past the training context
    downstream   lm-evaluation-harness tasks on the run's own model
    priors       the learned positional priors (BAM shapes and scales, ALiBi slopes, SSMax scales)
    attention    where each head looks as prompts grow: entropy, distance, mass past the training context
    report       one markdown report comparing several runs from their saved results

Results land in RUN/eval/<name>.json (+ .png) unless --out says otherwise; docs/evaluation.md
describes the protocols and the JSON files.

An evaluator is one module (or one package, as priors) that declares itself with an
`eval.contract.Evaluator` named EVALUATOR, and one line below: eval.report finds its results, section,
tables and plots through this list. What the evaluators share:

    contract, options  what an evaluator declares; the options every evaluator reads (EvalOptions)
    loading            a run, checkpoint or model object made ready to evaluate, overrides applied
    prompts, scoring   the text fed to a model; retrieval answers graded teacher-forced
    sweep, memory      the loop over lengths; what a length needs in memory, and running out of it
    results            the results files, written as results come in
    plotting           the one module that imports matplotlib
    tables, stats      markdown tables and their cells; intervals and tests over prompts and seeds
    runs, variants     the report's runs read from their folders; runs grouped into named variants
    training_section   the report's section of each variant's training loss
"""

import importlib

from bam.cli import UserError

# The evaluator modules, in the order of the report's sections.
EVALUATORS = [
    "eval.passkey",
    "eval.niah",
    "eval.perplexity",
    "eval.downstream",
    "eval.priors",
    "eval.attention",
]


class EvalError(UserError):
    """A mistake the user can fix; run_cli turns it into one `error: ...` line."""


def evaluators():
    """{schema: Evaluator} of every registered module, in EVALUATORS' order. Importing one loads no
    plotting library and no lm-eval: those are imported where a plot is drawn or a task is run."""
    found = {}
    for module in EVALUATORS:
        evaluator = importlib.import_module(module).EVALUATOR
        found[evaluator.name] = evaluator
    return found
