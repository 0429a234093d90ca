"""
How sure a retrieval number is, when it comes from a few training seeds and a few prompts per seed.

A variant (one config, several seeds) is scored per seed as `correct / prompts` at each length. Two sources
of noise sit in the mean over seeds: which prompts were drawn (binomial noise within a seed) and which seed
was drawn (the run-to-run spread of training, often the larger one on small models). The Wilson interval of
one run (`binomial_interval`, a single run's cell in the report) sees only the first. The seed-level
intervals see both, and the test compares variants at the level where they are independent, the seed:

- `seed_bootstrap`: a two-level bootstrap of the mean accuracy over seeds. Draw the seeds again with
  replacement; for each drawn seed, draw its accuracy from what its prompts say about it, the Jeffreys
  posterior Beta(k + 1/2, n - k + 1/2) of k right out of n; take the mean. The interval is the 2.5th and
  97.5th percentile of those means. Resampling the prompts themselves (a binomial draw) would be the
  plain nonparametric bootstrap, but it gives an interval of zero width wherever every seed scored 0% or
  100%, where short passkey sweeps often sit; the posterior draw keeps the width a single run's interval
  has there (for one seed the interval is the Jeffreys interval, within a point or two of Wilson's) and
  agrees with the plain bootstrap elsewhere.
- `difference_bootstrap`: the same for the difference of two variants' means, each resampled on its own.
- `permutation_test`: the p-value of "both variants' seed accuracies come from one distribution", from every
  way of relabelling the pooled seed-level accuracies (exactly when there are at most EXACT_LIMIT ways,
  else by random relabellings); two-sided, on the difference of means. With 4 seeds per variant the
  smallest possible p-value is 2/70 = 0.029: a handful of seeds cannot prove much, and the test says so.

Every function is deterministic (a fixed seed for its random draws), so a report rebuilt from the same
results prints the same numbers.
"""

import itertools
import math

import numpy as np

DRAWS = 20_000  # bootstrap and random-permutation draws: the percentiles move by < 1 point between seeds
EXACT_LIMIT = 20_000  # relabellings enumerated exactly up to this many (4 + 4 seeds: 70; 8 + 8: 12,870)


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


def _counts(seeds):
    """(correct, prompts) per seed as two int arrays; every seed needs at least one prompt."""
    pairs = np.asarray(list(seeds), dtype=np.int64).reshape(-1, 2)
    correct, prompts = pairs[:, 0], pairs[:, 1]
    if len(pairs) == 0 or (prompts <= 0).any() or (correct < 0).any() or (correct > prompts).any():
        raise ValueError(f"need (correct, prompts) pairs with 0 <= correct <= prompts > 0, got {list(seeds)}")
    return correct, prompts


def seed_means(seeds, draws=DRAWS, rng=None):
    """`draws` two-level bootstrap replicates of the mean accuracy over seeds (see the module docstring)."""
    correct, prompts = _counts(seeds)
    rng = np.random.default_rng(0) if rng is None else rng
    picked = rng.integers(0, len(prompts), size=(draws, len(prompts)))  # seeds, with replacement
    k, n = correct[picked], prompts[picked]
    return rng.beta(k + 0.5, n - k + 0.5).mean(axis=1)  # each drawn seed's accuracy, given its prompts


def _percentiles(values, level):
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def seed_bootstrap(seeds, level=0.95, draws=DRAWS):
    """The two-level bootstrap interval (low, high) of the mean accuracy over seeds, from (correct, prompts)
    per seed. With one seed it is that seed's Jeffreys interval, which cannot see seed noise."""
    return _percentiles(seed_means(seeds, draws), level)


def difference_bootstrap(a, b, level=0.95, draws=DRAWS):
    """The two-level bootstrap interval of mean(a) - mean(b), each variant's seeds and prompts resampled on
    their own (independent runs)."""
    rng = np.random.default_rng(0)
    return _percentiles(seed_means(a, draws, rng) - seed_means(b, draws, rng), level)


def permutation_test(a, b, exact_limit=EXACT_LIMIT, draws=DRAWS):
    """Two-sided p-value of the difference of mean seed-level accuracy between a and b (sequences of per-seed
    accuracies), over relabellings of the pooled seeds: the share of relabellings whose |difference| is at
    least the observed one. Exact when there are at most `exact_limit` relabellings; else from `draws` random
    ones, counting the observed labelling as one of them (so p is never 0). 1.0 when one side is empty. The
    smallest p exact enumeration can give is 1 / C(n_a + n_b, n_a), or 2 / C(2n, n) for n seeds against n (the
    mirrored labelling is then as extreme)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) == 0 or len(b) == 0:
        return 1.0
    pooled, n_a = np.concatenate([a, b]), len(a)
    observed = abs(a.mean() - b.mean())
    total = pooled.sum()
    tolerance = 1e-12 * max(1.0, abs(observed))  # equal differences computed in another order still count
    if math.comb(len(pooled), n_a) <= exact_limit:
        sums = np.array([pooled[list(chosen)].sum() for chosen in itertools.combinations(range(len(pooled)), n_a)])
        differences = np.abs(sums / n_a - (total - sums) / len(b))
        return float(np.mean(differences >= observed - tolerance))
    rng = np.random.default_rng(0)
    sums = np.array([pooled[rng.permutation(len(pooled))[:n_a]].sum() for _ in range(draws)])
    differences = np.abs(sums / n_a - (total - sums) / len(b))
    return float((np.sum(differences >= observed - tolerance) + 1) / (draws + 1))
