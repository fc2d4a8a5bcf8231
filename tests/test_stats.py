"""postcard.stats: the one module of intervals and paired tests every report uses (issue #61)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from postcard.stats import (Z95, mcnemar_p, mean_ci95, mean_half_width, paired_ci95, standard_error,
                            t_test_p)

ROOT = Path(__file__).resolve().parent.parent


def test_a_t_interval_computed_by_hand():
    # 1, 2, 3, 4: mean 2.5, sd sqrt(5/3), se sqrt(5/12), t(0.975, 3 df) = 3.182446305
    half = 3.182446305284263 * math.sqrt(5 / 12)
    assert mean_ci95([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, 2.5 - half, 2.5 + half), rel=1e-12)
    assert mean_half_width([1, 2, 3, 4]) == pytest.approx((2.5, half), rel=1e-12)  # integers are values too
    assert standard_error([1.0, 2.0, 3.0, 4.0]) == pytest.approx(math.sqrt(5 / 12), rel=1e-12)
    assert mean_half_width([1.0, 3.0]) == (2.0, pytest.approx(12.706204736, rel=1e-9))  # two values: 1 df


def test_the_intervals_agree_with_scipy():
    x = np.random.default_rng(3).normal(0.4, 2.0, 17)
    mean, low, high = mean_ci95(x)
    assert (low, high) == pytest.approx(scipy_stats.t.interval(0.95, len(x) - 1, loc=x.mean(),
                                                               scale=scipy_stats.sem(x)), rel=1e-12)
    assert mean_ci95(x, normal=True)[1:] == pytest.approx(scipy_stats.norm.interval(0.95, loc=x.mean(),
                                                                                    scale=scipy_stats.sem(x)),
                                                          rel=1e-12)
    assert Z95 == pytest.approx(scipy_stats.norm.ppf(0.975), rel=1e-15)
    assert t_test_p(x) == pytest.approx(scipy_stats.ttest_1samp(x, 0.0).pvalue, rel=1e-12)


def test_a_paired_interval_is_the_interval_of_the_differences():
    method, reference = [30.1, 29.4, 31.0, 30.2], [31.0, 30.1, 31.2, 30.9]
    expected = mean_ci95([a - b for a, b in zip(method, reference)])
    assert paired_ci95(method, reference) == expected
    assert paired_ci95(np.array(method), np.array(reference)) == expected
    assert expected[0] == pytest.approx(-0.625) and expected[2] < 0  # shown lower, seed by seed
    assert paired_ci95(method, reference, normal=True)[1] > expected[1]  # the normal interval is narrower
    with pytest.raises(ValueError, match="differ in length"):
        paired_ci95(method, reference[:3])


def test_the_degenerate_samples():
    one = mean_ci95([2.5])  # one value: a mean, no spread to estimate
    assert one[0] == 2.5 and math.isnan(one[1]) and math.isnan(one[2])
    assert math.isnan(mean_half_width([2.5])[1]) and math.isnan(standard_error([2.5]))
    assert all(math.isnan(v) for v in mean_ci95([]))  # no values: no mean either
    assert mean_ci95([5.0, 5.0, 5.0]) == (5.0, 5.0, 5.0)  # no spread: a zero-width interval
    assert mean_ci95([5.0, 5.0, 5.0], normal=True) == (5.0, 5.0, 5.0)
    assert standard_error([5.0, 5.0]) == 0.0
    # no spread to test against: p 0 when the mean is off 0, 1 when it is 0 (bench.fednl's reports)
    assert t_test_p([0.3, 0.3, 0.3]) == 0.0 and t_test_p([0.0, 0.0]) == 1.0


def test_mcnemar_from_the_discordant_counts():
    # 10 gains, 2 losses: p = P(|X - 6| >= 4) for X ~ Bin(12, 1/2) = 2 * (1 + 12 + 66) / 4096
    assert mcnemar_p(10, 2) == pytest.approx(2 * 79 / 4096, rel=1e-12)
    assert mcnemar_p(2, 10) == mcnemar_p(10, 2)
    assert mcnemar_p(0, 0) == 1.0  # no discordant item: nothing to test


def test_the_reports_compute_their_intervals_here(monkeypatch):
    """The copies that were (issue #61) now give postcard.stats' numbers, to the bit."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import flite_report  # bench/flite_report.py

    from bench.fednl.stats import t_interval
    from postcard.compare import paired_interval

    gaps = [0.31, -0.12, 0.05, 0.4]
    assert paired_interval(np.array(gaps), t=True) == mean_ci95(gaps)
    assert paired_interval(np.array(gaps), t=False) == mean_ci95(gaps, normal=True)
    fednl = t_interval(gaps)
    assert (fednl["mean"], *fednl["ci95"]) == mean_ci95(gaps) and fednl["p"] == t_test_p(gaps)
    runs = [{"seed": s, "final_accuracy": 0.8 + g, "initial_accuracy": 0.8} for s, g in enumerate(gaps)]
    assert flite_report.gap_interval(runs, None) == mean_ci95([100 * (r["final_accuracy"] - 0.8) for r in runs])
    assert flite_report.gap_interval(runs[:1], None) is None  # one seed: no interval
