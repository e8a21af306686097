"""scripts/tau_curve.py's arithmetic: the fitted line and the data it says each tau needs, and the step counts."""

from __future__ import annotations

import math

import pytest

from conftest import load_script


def test_the_fit_recovers_a_line_in_log_tokens_and_says_where_it_reaches_tau_2_and_3():
    curve = load_script("tau_curve")
    # tau = 1.1 + 0.05 log2(tokens), measured at four sizes each twice the last
    points = [(t, 1.1 + 0.05 * math.log2(t)) for t in (2**20, 2**21, 2**22, 2**23)]
    fit = curve.fit_curve(points)
    assert fit["b_per_doubling"] == pytest.approx(0.05) and fit["a"] == pytest.approx(1.1)
    assert fit["tokens_for_tau"]["2"] == pytest.approx(2**18)  # 1.1 + 0.05 * 18 = 2.0
    assert fit["tokens_for_tau"]["3"] == pytest.approx(2**38)
    # a flat or falling curve reaches neither
    assert curve.fit_curve([(2**20, 1.3), (2**21, 1.2)])["tokens_for_tau"] == {"2": None, "3": None}
    with pytest.raises(ValueError):
        curve.fit_curve([(2**20, 1.3)])


def test_steps_are_the_epochs_over_the_examples_in_batches():
    curve = load_script("tau_curve")
    assert curve.steps_for(1000, 3, 8) == 375
    assert curve.steps_for(1001, 3, 8) == 376  # a part batch is a step
    assert curve.steps_for(1, 0.5, 8) == 1
