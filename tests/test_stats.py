"""eval.stats against references computed another way: a closed-form variance and exact enumerations."""

import itertools

import numpy as np
import pytest

from eval.stats import difference_bootstrap, permutation_test, seed_bootstrap, seed_means


def jeffreys(seeds):
    """(a, b) of each seed's Beta(k + 1/2, n - k + 1/2)."""
    return np.array([(k + 0.5, n - k + 0.5) for k, n in seeds])


def test_two_level_bootstrap_mean_and_variance_match_the_closed_form():
    # One replicate averages S independent draws of "pick a seed uniformly, then its accuracy from its
    # Beta(a_s, b_s)", so its mean is the mean of the Beta means m_s and its variance is
    # (mean_s Var_s + population variance of m_s) / S.
    seeds = [(3, 10), (8, 10), (5, 20), (20, 20)]
    a, b = jeffreys(seeds).T
    m, v = a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1))
    replicates = seed_means(seeds, draws=400_000)
    assert replicates.mean() == pytest.approx(m.mean(), abs=1e-3)
    assert replicates.var() == pytest.approx((v.mean() + m.var()) / len(seeds), rel=0.02)


def exact_cdf(seeds, x, bins=4000):
    """The replicates' CDF at `x`, computed another way: over every one of the S^S equally likely ordered draws
    of seeds, the distribution of the mean of their independent Betas, each discretised into `bins` cells of
    its CDF and summed by convolution."""
    from scipy.stats import beta

    S, step = len(seeds), 1.0 / bins
    masses = [np.diff(beta.cdf(np.linspace(0, 1, bins + 1), a, b_)) for a, b_ in jeffreys(seeds)]
    cdf = np.zeros(len(x))
    for picked in itertools.product(range(S), repeat=S):
        total = masses[picked[0]]
        for s in picked[1:]:
            total = np.convolve(total, masses[s])  # the sum's cells: cell k holds sums near (k + S / 2) step
        means = (np.arange(len(total)) + S / 2) * step / S
        cdf += np.interp(x, means, np.cumsum(total)) / S ** S
    return cdf


def test_two_level_bootstrap_matches_a_computed_distribution():
    seeds = [(1, 3), (3, 3), (0, 2)]
    x = np.linspace(0.05, 0.95, 19)
    replicates = seed_means(seeds, draws=200_000)
    assert [np.mean(replicates <= v) for v in x] == pytest.approx(list(exact_cdf(seeds, x)), abs=6e-3)
    low, high = seed_bootstrap(seeds)
    assert exact_cdf(seeds, np.array([low, high])) == pytest.approx([0.025, 0.975], abs=3e-3)


def test_one_seed_is_the_jeffreys_interval():
    from scipy.stats import beta

    for k, n in [(20, 20), (10, 20), (0, 20), (3, 7)]:
        expected = tuple(beta.ppf([0.025, 0.975], k + 0.5, n - k + 0.5))
        assert seed_bootstrap([(k, n)]) == pytest.approx(expected, abs=4e-3)


def test_intervals_at_the_edge_and_differences_are_signed():
    low, high = seed_bootstrap([(20, 20), (20, 20)])  # every prompt right in both seeds: still not certain
    assert 0.9 < low < 0.97 and high == pytest.approx(1.0, abs=1e-3)  # Wilson's for 40 of 40 prompts: 91-100
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
