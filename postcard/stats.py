"""The confidence intervals and paired tests of every report, written once (issue #61).

``postcard compare``, ``bench/fednl``, ``bench/flite.py``, ``bench/onboarding.py``,
``bench/smartfed_protocol.py`` (and through ``postcard.compare.paired_interval``,
``bench/privacy.py`` and ``bench/channels.py``) use these functions; a report that needs one of
them imports it from here rather than writing it again.

* :func:`mean_ci95` — the mean and its 95% interval: Student's t with n − 1 degrees of freedom,
  or with ``normal=True`` the normal approximation (z = :data:`Z95`);
  :func:`mean_half_width` the same as mean ± half-width; :func:`paired_ci95` the interval of
  paired differences (``a − b`` item by item, or seed by seed).
* :func:`standard_error` — the standard error of the mean (sample standard deviation / √n).
* :func:`t_test_p` — the two-sided p-value of a one-sample t test against 0.
* :func:`mcnemar_p` — McNemar's exact test from the discordant counts of paired 0/1 outcomes.

The conventions for samples too small to estimate a spread: fewer than two values give nan bounds
(and a nan standard error); no values at all give a nan mean. Callers that print "no interval"
test the sample's size themselves.
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def _sample(values) -> np.ndarray:
    return np.asarray(values, np.float64)


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if len(x) else math.nan


def standard_error(values) -> float:
    """The standard error of the mean: the sample standard deviation (n − 1) over √n; nan for fewer
    than two values."""
    x = _sample(values)
    if len(x) < 2:
        return math.nan
    return float(x.std(ddof=1)) / math.sqrt(len(x))


def mean_half_width(values, *, normal: bool = False) -> tuple[float, float]:
    """The mean of ``values`` and the half-width of its 95% interval: Student's t quantile with
    n − 1 degrees of freedom (``normal=True``: the normal one, :data:`Z95`) times the sample
    standard deviation over √n. The half-width is nan for fewer than two values."""
    from scipy.stats import t as student

    x = _sample(values)
    n = len(x)
    if n < 2:
        return _mean(x), math.nan
    quantile = Z95 if normal else float(student.ppf(0.975, n - 1))
    return _mean(x), quantile * float(x.std(ddof=1)) / math.sqrt(n)


def mean_ci95(values, *, normal: bool = False) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``values`` and its 95% interval (:func:`mean_half_width`);
    nan bounds for fewer than two values."""
    mean, half = mean_half_width(values, normal=normal)
    return mean, mean - half, mean + half


def paired_ci95(a, b, *, normal: bool = False) -> tuple[float, float, float]:
    """``(mean, low, high)`` of the paired differences ``a − b`` (the same items or seeds, in the
    same order): their mean and its 95% interval, as :func:`mean_ci95`."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} and {len(b)}")
    return mean_ci95(np.subtract(a, b), normal=normal)


def t_test_p(values) -> float:
    """The two-sided p-value of a one-sample t test of ``values`` against 0 (``scipy.stats.ttest_1samp``).
    With no spread to test against (every value equal, or fewer than two values) it is 0.0 when the
    mean is not 0 and 1.0 when it is."""
    from scipy.stats import ttest_1samp

    x = _sample(values)
    if standard_error(x) > 0:
        return float(ttest_1samp(x, 0.0).pvalue)
    return 0.0 if _mean(x) != 0 else 1.0


def mcnemar_p(gains: int, losses: int) -> float:
    """McNemar's exact test on paired 0/1 outcomes: the two-sided p-value of a binomial test of the
    ``gains`` (right where the reference is wrong) against the ``losses`` (the other way) at 1/2;
    1.0 when no item is discordant."""
    from scipy.stats import binomtest

    return 1.0 if gains + losses == 0 else float(binomtest(gains, gains + losses, 0.5).pvalue)
