"""Evaluators for trained checkpoints, each runnable as `python -m eval.<name> RUN_DIR_OR_CHECKPOINT`:

    passkey      retrieval of a 5-digit key hidden in garbage text, up to 500x the training context
    niah         RULER-style needle-in-a-haystack (single, multi-key, multi-value, multi-query)
    perplexity   loss per position window over held-out validation text, past the training context
    priors       the learned positional priors (BAM shapes and scales, ALiBi slopes, SSMax scales)
    report       one markdown report comparing several runs from their saved results

Results land in RUN/eval/<name>.json (+ .png) unless --out says otherwise; docs/evaluation.md
describes the protocols and the JSON files.
"""
