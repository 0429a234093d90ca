"""eval.stats against references computed another way: a closed-form variance and exact enumerations."""

import itertools
import math

import numpy as np
import pytest

from eval.stats import difference_bootstrap, permutation_test, seed_bootstrap, seed_means, wilson_interval


def test_wilson_interval_known_values():
    # Wilson's interval for 0/20, 10/20 and 20/20 (z = 1.96), computed from the formula by hand
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.16113), abs=1e-4)
    assert wilson_interval(10, 20) == pytest.approx((0.29930, 0.70070), abs=1e-4)
    assert wilson_interval(20, 20) == pytest.approx((0.83887, 1.0), abs=1e-4)
    assert wilson_interval(0, 0) == (None, None)


def test_two_level_bootstrap_variance_matches_the_closed_form():
    # One replicate averages S draws of "pick a seed uniformly, then a Binomial(n_s, p_s) / n_s", so its
    # variance is (mean_s p_s (1 - p_s) / n_s + population variance of p_s) / S.
    seeds = [(3, 10), (8, 10), (5, 20), (20, 20)]
    p = np.array([c / n for c, n in seeds])
    n = np.array([n for _, n in seeds])
    closed = (np.mean(p * (1 - p) / n) + p.var()) / len(seeds)
    replicates = seed_means(seeds, draws=200_000)
    assert replicates.mean() == pytest.approx(p.mean(), abs=2e-3)
    assert replicates.var() == pytest.approx(closed, rel=0.03)


def exact_bootstrap_distribution(seeds):
    """Every outcome of the two-level bootstrap with its probability: all S^S ordered draws of seeds, then
    every count each drawn seed can show."""
    S = len(seeds)
    outcomes = {}
    for picked in itertools.product(range(S), repeat=S):
        per_seed = [[(k / seeds[s][1], math.comb(seeds[s][1], k) * (seeds[s][0] / seeds[s][1]) ** k
                      * (1 - seeds[s][0] / seeds[s][1]) ** (seeds[s][1] - k)) for k in range(seeds[s][1] + 1)]
                    for s in picked]
        for combo in itertools.product(*per_seed):
            mean = round(sum(a for a, _ in combo) / S, 9)
            outcomes[mean] = outcomes.get(mean, 0.0) + math.prod(w for _, w in combo) / S ** S
    return outcomes


def test_two_level_bootstrap_matches_an_exact_enumeration():
    seeds = [(1, 3), (3, 3), (0, 2)]
    exact = exact_bootstrap_distribution(seeds)
    assert sum(exact.values()) == pytest.approx(1.0)
    replicates = np.round(seed_means(seeds, draws=200_000), 9)
    for value in sorted(exact):  # the CDF at every support point
        cdf = sum(w for v, w in exact.items() if v <= value)
        assert np.mean(replicates <= value) == pytest.approx(cdf, abs=5e-3)
    support = sorted(exact)
    cdf = np.cumsum([exact[v] for v in support])
    low = support[int(np.searchsorted(cdf, 0.025))]
    high = support[int(np.searchsorted(cdf, 0.975))]
    interval = seed_bootstrap(seeds)
    assert interval[0] == pytest.approx(low, abs=1e-9) and interval[1] == pytest.approx(high, abs=1e-9)


def test_one_seed_sees_prompt_noise_only_and_differences_are_signed():
    assert seed_bootstrap([(20, 20)]) == (1.0, 1.0)  # nothing varies: no seed spread, no prompt noise
    low, high = seed_bootstrap([(10, 20)])
    assert 0.25 < low < 0.35 and 0.65 < high < 0.75  # about Wilson's 0.30-0.70
    low, high = difference_bootstrap([(18, 20), (19, 20)], [(2, 20), (5, 20)])
    assert 0.5 < low < 0.75 < high < 0.95  # around the observed 0.925 - 0.175
    low, high = difference_bootstrap([(2, 20), (5, 20)], [(18, 20), (19, 20)])
    assert -0.95 < low < -0.75 < high < -0.5
    with pytest.raises(ValueError):
        seed_bootstrap([])
    with pytest.raises(ValueError):
        seed_bootstrap([(3, 2)])


def brute_force_p(a, b):
    """Over every ordering of the pooled values (all (n_a + n_b)! of them), the first n_a labelled a."""
    pooled, hits, total = list(a) + list(b), 0, 0
    observed = abs(np.mean(a) - np.mean(b))
    for order in itertools.permutations(pooled):
        diff = abs(np.mean(order[:len(a)]) - np.mean(order[len(a):]))
        hits += diff >= observed - 1e-12
        total += 1
    return hits / total


@pytest.mark.parametrize("a,b", [([1.0, 1.0], [0.0, 0.0]), ([0.9, 0.8, 0.85], [0.3, 0.5, 0.6]),
                                 ([0.95, 0.2, 0.6], [0.55, 0.5]), ([0.5, 0.5], [0.5, 0.5, 0.5])])
def test_permutation_test_matches_brute_force_enumeration(a, b):
    assert permutation_test(a, b) == pytest.approx(brute_force_p(a, b))


def test_permutation_test_known_values_and_the_random_branch():
    assert permutation_test([1.0, 1.0], [0.0, 0.0]) == pytest.approx(2 / 6)
    # 4 seeds each, completely separated: the smallest p-value 4 + 4 seeds can give
    assert permutation_test([0.9, 0.95, 0.85, 1.0], [0.1, 0.0, 0.2, 0.05]) == pytest.approx(2 / 70)
    a, b = [0.9, 0.6, 0.8, 0.7, 0.75], [0.5, 0.65, 0.4, 0.55, 0.7]
    assert permutation_test(a, b, exact_limit=0) == pytest.approx(permutation_test(a, b), abs=0.01)
    assert permutation_test([], [0.5]) == 1.0
