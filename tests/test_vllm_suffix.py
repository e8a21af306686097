"""serve/vllm_suffix.py's proposer outside vLLM: what a verified chain teaches its calibration, and the verify cost
curve it measures on the engine's steps."""

from __future__ import annotations

import numpy as np
import pytest

from selfspec.decode.adaptive import CostCurve
from selfspec.serve import vllm_suffix
from selfspec.serve.vllm_suffix import (CURVE_MIN, EXPLORE_EVERY, MEASURE_ENV, MeasuredCurve, SuffixProposer,
                                        default_curve, engine_curve)


def call(proposer: SuffixProposer, history: list[int], new: int) -> list[int]:
    """One vLLM step for one row whose tokens are ``history``, the last ``new`` of them this step's."""
    ids = np.zeros((1, max(256, len(history))), dtype=np.int64)
    ids[0, :len(history)] = history
    return proposer.propose([history[-new:]], np.array([len(history)]), ids)[0]


def test_a_chain_teaches_the_depths_up_to_its_first_rejected_token_only():
    proposer = SuffixProposer.standalone(8, 256, default_curve(8))
    pattern = list(range(10, 30))
    history = pattern + pattern[:5]  # the pattern seen once: its continuation is the chain
    chain = call(proposer, history, 1)
    assert chain[:3] == pattern[5:8] and len(chain) >= 3
    calibration = proposer.rows[0].drafter.calibration
    before = dict(calibration.scored)
    # vLLM accepted the chain's first token and rejected its second (sampling 99 there instead)
    call(proposer, history + [chain[0], 99], 2)
    learned = {key[1]: calibration.scored[key] - before.get(key, 0.0) for key in calibration.scored}
    assert learned.get(1, 0) > 0 and learned.get(2, 0) > 0  # the accepted depth and the rejected one
    assert all(v == 0 for d, v in learned.items() if d > 2)  # never reached: not counted as rejected
    accepted = {key[1]: calibration.accepted.get(key, 0.0) for key in calibration.accepted}
    assert accepted.get(1, 0) >= 1 and accepted.get(2, 0) == 0


def test_the_measured_curve_is_the_prior_until_a_length_has_enough_steps_then_their_median_over_one_tokens():
    prior = default_curve(4)
    curve = MeasuredCurve(prior, 5, measure=True)
    for _ in range(CURVE_MIN):
        curve.observe(1, 0.010)
    for _ in range(CURVE_MIN - 1):
        curve.observe(3, 0.008)
    assert curve.cost(3) == prior.cost(3)  # one step short
    curve.observe(3, 0.500)  # an outlier (a step the machine was busy for): the median holds
    assert curve.cost(3) == pytest.approx(0.8)
    assert curve.cost(2) == prior.cost(2) and curve.cost(1) == 1.0
    for _ in range(CURVE_MIN + 1):  # one-token steps slow down: every measured length is priced against them again
        curve.observe(1, 0.016)
    assert curve.cost(3) == pytest.approx(0.5)


def test_a_step_is_timed_from_the_end_of_one_call_to_the_start_of_the_next_for_one_request_only(monkeypatch):
    curve = MeasuredCurve(default_curve(4), 5, measure=True)
    ends = iter([10.0, 11.0, 12.0])  # each call's end, as the proposer's clock reads it
    monkeypatch.setattr(vllm_suffix, "perf_counter", lambda: next(ends))
    curve.step(9.5, [7, 8], alone=False, last_token=0)
    curve.step(10.25, [7], alone=True, last_token=0)
    assert list(curve.times[3]) == [0.25]
    curve.step(11.5, None, alone=False, last_token=0)  # several requests: their period holds their total
    curve.step(12.5, [7], alone=True, last_token=0)  # (or another request's: its prefill)
    assert [len(t) for t in curve.times.values()] == [0, 0, 1, 0, 0]


def history_of(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).permutation(np.arange(100, 50_000))[:n]]  # no repeats


def test_until_every_length_is_measured_some_steps_send_a_chain_cut_or_padded_to_one_that_is_not():
    k = 4
    proposer = SuffixProposer.standalone(k, 1024, MeasuredCurve(default_curve(k), k + 1, measure=True))
    history = history_of(700)  # no repeats: the drafter finds nothing, so only the exploration sends tokens
    sent = []
    for n in range(20, 700):
        chain = call(proposer, history[:n], 1)
        assert set(chain) <= {history[n - 1]}  # padding: the request's last token
        sent.append(len(chain))
    curve = proposer.curve
    assert sorted(curve.measured) == [2, 3, 4, 5]  # every length, timed on the engine's (here: the loop's) steps
    assert set(sent) == {0, 1, 2, 3, 4}
    assert min(sent.count(n) for n in range(1, k + 1)) >= CURVE_MIN
    explored = [i for i, n in enumerate(sent) if n]
    assert all(b - a >= EXPLORE_EVERY for a, b in zip(explored, explored[1:]))  # never two exploring steps in a row
    assert not any(sent[explored[-1] + 1:])  # once all are measured, no more padding
    assert sent[:explored[0]] and len(explored) < len(sent) / 2


def test_where_a_chain_is_always_drafted_the_empty_chain_is_timed_too():
    k = 4
    proposer = SuffixProposer.standalone(k, 1024, MeasuredCurve(default_curve(k), k + 1, measure=True))
    pattern = history_of(30, seed=2)
    history = pattern * 20  # the pattern repeats: a chain of k every step once it has been seen
    sent = [call(proposer, history[:n], 1) for n in range(60, 600)]
    assert [] in sent[40:]  # cut to the empty chain, to time one-token steps
    assert 1 in proposer.curve.times and len(proposer.curve.times[1]) >= CURVE_MIN


def test_measuring_off_keeps_the_given_curve_and_sends_only_what_the_drafter_drafts(monkeypatch):
    monkeypatch.setenv(MEASURE_ENV, "0")
    curve = engine_curve(4)
    proposer = SuffixProposer.standalone(4, 1024, curve)
    history = history_of(200, seed=1)
    assert not any(call(proposer, history[:n], 1) for n in range(20, 200))
    assert not curve.measured and curve.cost(5) == default_curve(4).cost(5)


def test_chains_are_priced_by_the_measured_costs_not_the_prior_once_measured():
    k = 6
    steep = CostCurve.from_relative({n: 1.0 + 0.5 * (n - 1) for n in range(1, k + 2)})  # every token half a step
    flat = MeasuredCurve(steep, k + 1, measure=False)  # no exploration: only what is observed below
    for n in range(1, k + 2):
        for _ in range(CURVE_MIN):
            flat.observe(n, 0.010)  # the engine verifies any chain up to k in the time of one token
    assert all(flat.cost(n) == pytest.approx(1.0) for n in range(1, k + 2)) and steep.cost(k + 1) == 4.0
    pattern = history_of(40, seed=3)
    history = pattern * 3  # seen twice before: the suffix drafter proposes its continuation, with some doubt
    lengths = {}
    for name, curve in (("steep", steep), ("flat", flat)):
        proposer = SuffixProposer.standalone(k, 1024, curve)
        lengths[name] = [len(call(proposer, history[:n], 1)) for n in range(45, 115)]
    assert sum(lengths["flat"]) > sum(lengths["steep"])
    assert max(lengths["flat"]) == k


def test_a_chain_cut_by_exploration_teaches_only_the_depths_it_sent():
    """Where the curve's exploration sends fewer tokens than the plan holds, the depths past them were never verified:
    the whole cut chain accepted is not a rejection at the next depth."""
    k = 4
    curve = MeasuredCurve(default_curve(k), k + 1, measure=True)
    for n in (1, 3, 4, 5):  # every length timed but 2 (one drafted token): exploration cuts chains to one token
        for _ in range(CURVE_MIN):
            curve.observe(n, 0.010)
    proposer = SuffixProposer.standalone(k, 1024, curve)
    pattern = history_of(30, seed=4)
    history = pattern + pattern[:3]  # the pattern seen once: its continuation is the chain
    for _ in range(3 * EXPLORE_EVERY):
        chain = call(proposer, history, 1)
        row = proposer.rows[0]
        if len(chain) == 1 and len(row.plan.chosen) > 1:
            break
        history = history + [pattern[len(history) % len(pattern)]]  # nothing accepted: the target's next token
    else:
        pytest.fail("no step was cut by exploration")
    calibration = row.drafter.calibration
    before = dict(calibration.scored)
    nxt = len(history) % len(pattern)
    call(proposer, history + pattern[nxt:nxt + 2], 2)  # the one token sent accepted, then the bonus token
    learned = {key[1]: calibration.scored[key] - before.get(key, 0.0) for key in calibration.scored}
    assert learned.get(1, 0) > 0  # the depth sent learned
    assert all(v == 0 for d, v in learned.items() if d > 1)  # the depths cut off were not counted as rejected
