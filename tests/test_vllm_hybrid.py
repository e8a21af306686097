"""serve/vllm_hybrid.py's choice and learning, apart from vLLM (tests/test_serving.py runs it inside vLLM): per
request, the chain with more expected tokens per verify cost; the trained drafter's acceptance calibrated from what
was accepted, so a confident drafter that is always wrong stops being sent, and the suffix drafter's chain is sent
where the text repeats."""

from __future__ import annotations

import time

import pytest

from selfspec.decode.adaptive import CostCurve
from selfspec.serve.vllm_hybrid import (RATE_WARMUP, TIME_SAMPLES, ChainCalibration, HybridRows, Pending,
                                          expected_prefix, matched, trained_tokens)

FLAT = CostCurve.from_relative({1: 1.0, 9: 1.0})  # verifying is free up to 9 tokens
LINEAR = CostCurve.from_relative({1: 1.0, 9: 9.0})  # each verified token costs what one step does


def test_the_prefix_that_pays_under_the_verify_cost():
    assert expected_prefix([0.9, 0.9, 0.1], FLAT) == pytest.approx((3, 0.9 + 0.81 + 0.081))
    # cost growing with every token: (1 + 0.9) / 2 < 1, so the root alone
    assert expected_prefix([0.9, 0.9, 0.1], LINEAR) == (0, 0.0)
    curve = CostCurve.from_relative({1: 1.0, 3: 1.0, 4: 3.0})  # two drafted tokens free, a third triples the cost
    assert expected_prefix([0.9, 0.9, 0.9], curve) == pytest.approx((2, 0.9 + 0.81))


def test_matched_is_what_greedy_verification_would_accept():
    assert matched([5, 6, 7], [5, 6, 9, 1]) == (2, 3)  # rejected at the third
    assert matched([5, 6], [5, 6, 9]) == (2, 2)  # all accepted
    assert matched([5, 6, 7, 8], [5, 6]) == (2, 2)  # the target's tokens end: what follows is unknown
    assert matched([4], [5]) == (0, 1)


def test_calibration_starts_at_the_drafters_probability_and_learns():
    cal = ChainCalibration()
    assert cal.prob(0, 0.95) == pytest.approx(0.95)
    for _ in range(40):
        cal.record([0.95, 0.95], accepted=0, observed=1)  # always rejected at the first token
    assert cal.prob(0, 0.95) < 0.1
    assert cal.prob(1, 0.95) == pytest.approx(0.95)  # never observed: still the prior
    assert cal.prob(0, 0.35) == pytest.approx(0.35)  # another bin


def _decode(rows: HybridRows, target: list[int], prompt: list[int], trained_of, steps: int = 200,
            request: str = "r") -> list[str]:
    """Drive ``rows`` as vLLM would at greedy decoding where the target's answer is ``target``: each step the sent
    chain is verified against it, and what was accepted plus the bonus token is the next step's ``new``."""
    kinds = []
    history = prompt + target[:1]
    new = target[:1]
    while len(history) - len(prompt) < min(len(target), steps):
        done = len(history) - len(prompt)
        trained, confidences = trained_of(done)
        chain = rows.step(0, request, list(history), list(new), trained, confidences, greedy=True)
        kinds.append(rows.sent[request].kind)
        truth = target[done:]
        accepted, _ = matched(chain, truth)
        new = truth[: accepted + 1]
        if not new:
            break
        history += new
    return kinds


def test_a_confident_but_wrong_drafter_gives_way_to_plain_steps_and_a_good_one_is_sent():
    curve = CostCurve.from_relative({1: 1.0, 9: 1.8})  # each verified token costs a tenth of a step more
    target = [(7 * i + 3) % 50 + 10 for i in range(120)]
    wrong = HybridRows(k=3, max_model_len=512, curve=curve)
    kinds = _decode(wrong, target, [1, 2, 3], lambda done: ([1, 1, 1], [0.99, 0.99, 0.99]))
    assert kinds[0] == "trained" and "trained" not in kinds[-20:]
    right = HybridRows(k=3, max_model_len=512, curve=curve)
    kinds = _decode(right, target, [1, 2, 3], lambda done: (target[done:done + 3], [0.6, 0.6, 0.6]))
    assert kinds[:20] == ["trained"] * 20 and len(kinds) == 30  # every step: three drafted tokens and the bonus
    assert right.calibration.prob(0, 0.6) > 0.8  # learned that its 0.6 means more


def test_the_suffix_chain_is_sent_where_the_text_repeats_and_the_trained_one_elsewhere():
    curve = CostCurve.from_relative({1: 1.0, 4: 1.0, 8: 1.5})
    novel = [(7 * i + 3) % 50 + 10 for i in range(40)]
    loop = [90, 91, 92, 93, 94, 95, 96, 97]
    target = novel + loop * 8  # new text, then a phrase repeated

    def trained_of(done):  # half right: its first token only
        return [target[done], 0, 0] if done < len(target) else [0, 0, 0], [0.7, 0.7, 0.7]

    rows = HybridRows(k=6, max_model_len=512, curve=curve)
    kinds = _decode(rows, target, [1, 2, 3], trained_of)
    # where the loop starts, its first token is the trained drafter's and the rest the suffix drafter's (spliced)
    assert "trained" in kinds[:10] and "spliced" in kinds and kinds[-4:] == ["suffix"] * 4
    assert rows.counts["suffix"] >= 4 and rows.counts["trained"] >= 10


def _phrase_after_new_text(times: int = 3) -> list[int]:
    """New text, then a phrase, each later time after other new text (whose last token was never seen before it)."""
    novel = [(7 * i + 3) % 50 + 10 for i in range(40)]
    phrase = [90, 91, 92, 93, 94, 95, 96, 97]
    target = list(novel)
    for t in range(times):
        target += phrase + [100 + 12 * t + i for i in range(12)]
    return target


def test_a_trained_first_token_is_continued_by_the_suffix_drafter(monkeypatch):
    """Where the text turns to a phrase seen before, the suffix drafter has no match until the phrase's first token is
    decoded; a trained drafter that guesses that token lets the suffix drafter continue it in the same chain (the
    spliced chain): the phrase takes one step, not two, and the whole answer fewer steps than without splicing."""
    from selfspec.serve.vllm_hybrid import SPLICE_ENV

    curve = CostCurve.from_relative({1: 1.0, 9: 1.2})
    target = _phrase_after_new_text()

    def trained_of(done):  # its first token right, its second never
        return ([target[done], 0] if done < len(target) else [0, 0]), [0.7, 0.7]

    rows = HybridRows(k=6, max_model_len=512, curve=curve)
    kinds = _decode(rows, target, [1, 2, 3], trained_of)
    assert rows.counts["spliced"] >= 2  # the phrase's second and third times
    monkeypatch.setenv(SPLICE_ENV, "0")
    plain = HybridRows(k=6, max_model_len=512, curve=curve)
    plain_kinds = _decode(plain, target, [1, 2, 3], trained_of)
    assert "spliced" not in plain_kinds and len(kinds) <= len(plain_kinds) - 2


def test_a_spliced_chain_learns_both_parts_under_sampling():
    """Under sampling only the chain sent learns, from what vLLM accepted: the trained part up to what was seen of it,
    and the suffix drafter's continuation once the trained part was accepted."""
    curve = CostCurve.from_relative({1: 1.0, 9: 1.2})
    prompt = [5, 6, 7, 90, 91, 92, 93, 94, 8, 9]
    rows = HybridRows(k=6, max_model_len=512, curve=curve)
    history = prompt + [30]
    pending = rows.prepare(0, "r", history, [30], greedy=False)
    assert not pending.suffix_tokens
    chain = rows.choose(pending, [90, 0], [0.7, 0.7])
    assert rows.sent["r"].kind == "spliced" and chain[:4] == [90, 91, 92, 93]
    drafter = rows.suffix.rows[0].drafter
    assert not drafter.calibration.scored
    rows.prepare(0, "r", history + [90, 91, 92, 50], [90, 91, 92, 50], greedy=False)  # 3 accepted, then the bonus
    assert rows.calibration.seen == {(0, 7): 1.0} and rows.calibration.accepted == {(0, 7): 1.0}
    depths = {d: a for (_, d), a in drafter.calibration.accepted.items()}
    assert depths[1] == 1.0 and depths[2] == 1.0 and depths[3] == 0.0  # 91, 92 accepted; 93 rejected


def test_the_trained_bound_is_never_below_what_any_chain_of_the_drafter_would_be_worth():
    """needs_trained may only skip the trained drafter where no confidences it could give would be chosen: the bound
    is at least the rate of every chain, before and after learning."""
    import random

    rng = random.Random(0)
    curve = CostCurve.from_relative({1: 1.0, 4: 1.2, 9: 2.0})
    rows = HybridRows(k=4, max_model_len=512, curve=curve)
    for learned in range(3):
        for _ in range(300):
            conf = [rng.random() for _ in range(3)]
            n, expected = expected_prefix(rows.calibration.probs(conf), curve)
            assert (1.0 + expected) / curve.cost(1 + n) <= rows.trained_bound(3) + 1e-12
        for _ in range(50):  # learn: the first token accepted half the time, the second seldom
            conf = [rng.random() for _ in range(3)]
            accepted = int(rng.random() < 0.5) + int(rng.random() < 0.1)
            rows.calibration.record(conf, accepted, min(accepted + 1, 3))
    assert rows.trained_bound(0) == pytest.approx(1.0)  # no chain: the bonus token at one step's cost


def test_the_trained_drafter_is_not_run_where_the_text_repeats_and_its_chain_could_not_win():
    """Once the trained drafter's acceptance is learned and the suffix drafter's chain of a repeated phrase is worth
    more than the trained chain at its best, the proposer need not run it (needs_trained False) and the suffix chain
    is sent without it (choose with trained=None); on new text the trained drafter is needed again."""
    curve = CostCurve.from_relative({1: 1.0, 4: 1.0, 8: 1.5})
    novel = [(7 * i + 3) % 50 + 10 for i in range(40)]
    loop = [90, 91, 92, 93, 94, 95, 96, 97]
    target = novel + loop * 8
    rows = HybridRows(k=6, max_model_len=512, curve=curve)
    prompt = [1, 2, 3]
    history, new, skipped, needed_on_new_text = prompt + target[:1], target[:1], 0, []
    while len(history) - len(prompt) < len(target):
        done = len(history) - len(prompt)
        pending = rows.prepare(0, "r", list(history), list(new), greedy=True)
        if rows.needs_trained(pending, 3):
            needed_on_new_text.append(done < len(novel))
            trained = [target[done], 0, 0] if done < len(target) else [0, 0, 0]  # its first token right
            chain = rows.choose(pending, trained, [0.95, 0.95, 0.95])
        else:
            skipped += 1
            assert done >= len(novel)  # never on the new text, whose suffix chains are short
            chain = rows.choose(pending, None, None)
            assert chain == pending.suffix_tokens and rows.sent["r"].kind == "suffix"
        accepted, _ = matched(chain, target[done:])
        new = target[done:done + accepted + 1]
        history += new
    assert skipped >= 3 and all(needed_on_new_text[:10])
    # a fresh drafter's calibration is its own probability: at 1.0 the bound is the whole chain accepted
    fresh = HybridRows(k=6, max_model_len=512, curve=curve)
    assert fresh.trained_bound(3) == pytest.approx(4.0 / curve.cost(4))


def test_the_trained_drafter_runs_only_where_its_chains_are_worth_its_time():
    """Past the warm-up, needs_trained weighs what the trained chain's recent rates would add to the suffix chain's
    (the mean of the better of the two) against the drafter's measured time in verify cost units: a drafter costing
    a tenth of a step runs on new text, where the suffix chain is empty, and not beside a long suffix chain its
    chains seldom beat; a free drafter runs wherever any of its chains could win."""
    curve = CostCurve.from_relative({1: 1.0, 4: 1.0, 9: 1.5})
    rows = HybridRows(k=8, max_model_len=512, curve=curve)
    empty = Pending("r", None, [], 1.0 / curve.cost(1))
    long = Pending("r", None, [5] * 4, 2.0 / curve.cost(5))  # a suffix chain worth 1 + 1.0 tokens a step
    assert rows.needs_trained(long, 2)  # nothing measured: wherever its chain could be chosen (the bound)
    for i in range(RATE_WARMUP):  # its chains: a token and a half on one step in eight, else the bonus token alone
        rows.trained_rates.append(2.5 / curve.cost(3) if i % 8 == 0 else 1.0)
    assert rows.drafter_cost() is None and rows.needs_trained(long, 2)  # not timed yet
    for _ in range(5):
        rows.timed(True, 0.012, 0.030)  # drafting: 12 ms
        rows.timed(False, 0.002, 0.030)  # its skip path: 2 ms; a verify cost unit: 30 ms
    assert rows.drafter_cost() == pytest.approx(1 / 3)
    # new text: it adds (2.5 - 1) / 8 = 0.19 tokens a unit, and takes 1.0 * 1/3
    assert not rows.needs_trained(empty, 2)
    for _ in range(TIME_SAMPLES):
        rows.timed(True, 0.005, 0.030)  # drafting 5 ms: 0.1 of a unit
    assert rows.needs_trained(empty, 2)  # 0.19 > 0.1: it pays
    assert not rows.needs_trained(long, 2)  # its chains never beat 2.0 / 1.0 tokens a unit: never worth 0.1
    best = Pending("r", None, [5], 1.2 / curve.cost(2))
    gain = sum(max(r - 1.2, 0.0) for r in rows.trained_rates) / RATE_WARMUP  # (2.5 / 1.0 - 1.2) / 8 = 0.1625
    assert gain > 1.2 * 0.1 and rows.needs_trained(best, 2)  # worth more than its 0.12 a unit
    for _ in range(TIME_SAMPLES):
        rows.timed(True, 0.002, 0.030)  # as cheap as skipping
    assert rows.needs_trained(best, 2)
    rows.trained_rates.clear()
    rows.trained_rates.extend([1.0] * RATE_WARMUP)  # its chains never add a token: not worth even a free run
    assert not rows.needs_trained(best, 2)


def test_each_request_learns_from_its_own_last_chain_and_finished_ones_are_forgotten():
    rows = HybridRows(k=3, max_model_len=512, curve=FLAT)
    rows.step(0, "a", [1, 2, 3, 4], [4], [5, 6, 7], [0.9, 0.9, 0.9], greedy=True)
    rows.step(1, "b", [8, 9, 10], [10], [11, 12, 13], [0.9, 0.9, 0.9], greedy=True)
    assert set(rows.sent) == {"a", "b"}
    # a's chain [5, 6, 7]: the target's next tokens were 5, 9 (one accepted, then its own): a rejection at position 1
    rows.step(0, "a", [1, 2, 3, 4, 5, 9], [5, 9], [1, 1, 1], [0.9, 0.9, 0.9], greedy=True)
    assert rows.calibration.seen == {(0, 9): 1.0, (1, 9): 1.0} and rows.calibration.accepted == {(0, 9): 1.0,
                                                                                                    (1, 9): 0.0}
    rows.finish({"a"})
    assert set(rows.sent) == {"a"}


def test_the_bench_and_serve_check_run_the_hybrid_around_the_familys_own_export(monkeypatch, tmp_path):
    """scripts/bench.py's vllm_hybrid row and serve_check's hybrid format: the family's own vLLM export (dflash,
    eagle3) with the hook as vLLM's worker_extension_cls and the counts asked back; selfspec on vLLM's PYTHONPATH;
    heads without a hybrid (Medusa) get no such row."""
    from types import SimpleNamespace

    import selfspec.bench.vllm as bench_vllm
    from selfspec.bench.vllm import vllm_runs
    from selfspec.serve.serving import default_formats, formats_for, needs_selfspec
    from selfspec.serve.vllm_hybrid import COUNTS_RPC, HOOK

    exported = []

    def fake_export(heads_path, out, target, fmt, verifier, speculative_tokens):
        exported.append(fmt)
        return out, fmt

    monkeypatch.setattr(bench_vllm, "export_heads", fake_export)
    heads = {"dflash:d": (SimpleNamespace(heads_config={"head_type": "dflash", "head_config": {"block_size": 3}},
                                          target=None), "d"),
             "medusa:m": (SimpleNamespace(heads_config={"head_type": "medusa", "head_config": {"num_heads": 3}},
                                          target=None), "m")}
    runs = vllm_runs(["vllm_heads", "vllm_hybrid"], heads, tmp_path, tmp_path, k=3, suffix_k=8)
    by_name = {r["name"]: r for r in runs}
    assert sorted(by_name) == ["vllm:dflash:d", "vllm:medusa:m", "vllm_hybrid:dflash:d"]
    hybrid = by_name["vllm_hybrid:dflash:d"]
    plain = by_name["vllm:dflash:d"]["speculative_config"]
    assert plain["method"] == "dflash" and plain["num_speculative_tokens"] == 2  # its block less one
    # the hybrid: the same export, chains as long as the suffix proposer's (the DFlash drafter drafts its own block)
    assert hybrid["speculative_config"] == {**plain, "num_speculative_tokens": 8}
    assert hybrid["engine"] == {"worker_extension_cls": HOOK} and hybrid["rpc"] == COUNTS_RPC
    assert exported == ["dflash", "vllm"]  # one export serves both DFlash rows
    assert needs_selfspec([hybrid]) and not needs_selfspec([by_name["vllm:dflash:d"]])
    assert formats_for("eagle3", {"layout": "midlayer"})[-1] == "hybrid"
    assert default_formats("dflash", {}) == ["dflash"]  # the serve check asks for the hybrid by name


def test_the_trained_drafter_drafts_its_own_length_inside_the_hybrids_longer_chains(monkeypatch):
    """A DFlash drafter drafts its own block less one whatever vLLM's k (a longer block would draft other tokens); an
    EAGLE-3 drafter what $SELFSPEC_VLLM_HYBRID_TRAINED says, else 3; neither more than k."""
    from types import SimpleNamespace

    monkeypatch.delenv("SELFSPEC_VLLM_HYBRID_TRAINED", raising=False)
    assert trained_tokens("dflash", SimpleNamespace(block_size=3), 8) == 2
    assert trained_tokens("dflash", SimpleNamespace(dflash_config={"block_size": 16}), 8) == 8
    assert trained_tokens("eagle3", SimpleNamespace(), 8) == 3
    monkeypatch.setenv("SELFSPEC_VLLM_HYBRID_TRAINED", "5")
    assert trained_tokens("eagle3", SimpleNamespace(), 8) == 5 and trained_tokens("eagle3", SimpleNamespace(), 4) == 4


class _FakeProposer:
    """The few parts of vLLM's EAGLE/DFlash proposer the hybrid subclass calls, recording the calls."""

    def __init__(self, vllm_config, device, runner=None):
        self.method = vllm_config.speculative_config.method
        self.calls: list[tuple] = []
        self.model = self

    def combine_hidden_states(self, hidden):
        return hidden * 2  # stands for the drafter's fc over the target's layers

    def prepare_next_token_ids_padded(self, sampled, requests, input_batch, discard):
        return None

    def propose(self, **kwargs):
        import torch

        self.calls.append(("propose", kwargs["num_speculative_tokens"]))
        n = kwargs["num_speculative_tokens"]
        if hasattr(self, "_confidences"):  # the hybrid keeps each token's probability from its _greedy_sample
            self._confidences.append(torch.full((n,), 0.9))
        return torch.full((1, n), 7, dtype=torch.int64)

    def set_inputs_first_pass(self, **kwargs):
        self.calls.append(("set_inputs_first_pass", kwargs["target_hidden_states"].tolist()))
        return 5, None, None

    def build_model_inputs_first_pass(self, num_tokens, num_input_tokens, mm):
        self.calls.append(("store_context", num_tokens))


def _fake_hybrid(method: str):
    from types import SimpleNamespace

    from selfspec.serve.vllm_hybrid import HOOK, _hybrid

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(worker_extension_cls=HOOK),
        speculative_config=SimpleNamespace(method=method, num_speculative_tokens=8,
                                           draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(block_size=3))),
        model_config=SimpleNamespace(max_model_len=512))
    return _hybrid(_FakeProposer)(config, "cpu")


def _propose(h, history: list[int], new: list[int]):
    import numpy as np
    import torch
    from types import SimpleNamespace

    done = len(history) - len(new)
    batch = SimpleNamespace(req_ids=["r"], num_tokens_no_spec=np.array([done]),
                            token_ids_cpu=np.array([history[:done] + [0] * 8]))
    sampled = torch.tensor([new + [-1] * (9 - len(new))])
    h.prepare_next_token_ids_padded(sampled, None, batch, torch.tensor([False]))
    h.calls.clear()
    return h.propose(num_speculative_tokens=8, target_hidden_states=torch.ones(2, 3), target_token_ids=None,
                     target_positions=None, next_token_ids=None, common_attn_metadata=None,
                     sampling_metadata=SimpleNamespace(all_greedy=True))


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_the_proposer_runs_the_trained_drafter_only_where_its_chain_could_be_sent(method):
    """Inside vLLM's proposer (faked here; tests/test_serving.py runs the real one): on new text the trained drafter
    drafts its own length (a DFlash block of 3: 2 tokens); where the suffix drafter's chain beats any chain the trained
    drafter could give, a DFlash drafter only stores the context of the step's hidden states (combined as vLLM's
    propose combines them) and an EAGLE-3 drafter drafts one token to keep its cache; the suffix chain is sent."""
    h = _fake_hybrid(method)
    own = 2 if method == "dflash" else 3
    prompt = [1, 2, 3, 4]
    assert _propose(h, prompt + [5], [5]) == [[7] * own] and h.calls == [("propose", own)]
    # the trained drafter learned it is never right: no chain of it beats the bonus token alone
    for _ in range(200):
        h._rows.calibration.record([0.95] * 3, 0, 1)
        h._rows.calibration.record([0.05] * 3, 0, 1)
    for b in range(10):
        for _ in range(200):
            h._rows.calibration.record([b / 10 + 0.01] * 3, 0, 1)
    loop = [20, 21, 22, 23, 24, 25, 26, 27]
    history = prompt + loop * 4 + [20]
    out = _propose(h, history, history[-1:])
    assert out[0] and out[0] == (loop * 2)[1:1 + len(out[0])]  # the loop's next tokens
    assert h._rows.counts["skipped"] == 1 and h._rows.sent["r"].kind == "suffix"
    if method == "dflash":
        assert h.calls == [("set_inputs_first_pass", [[2.0] * 3] * 2), ("store_context", 5)]
    else:
        assert h.calls == [("propose", 1)]



@pytest.mark.parametrize("kind", ["suffix", "trained"])
def test_under_sampling_a_chain_cut_by_exploration_teaches_only_what_was_sent(kind):
    """The curve's exploration may cut the chosen chain (serve/vllm_suffix.py's MeasuredCurve): where all the tokens
    sent were accepted, the positions cut off were never verified and are not counted as rejected, neither in the
    suffix drafter's calibration nor in the trained drafter's."""
    from selfspec.serve.vllm_suffix import CURVE_MIN, EXPLORE_EVERY, MeasuredCurve

    k = 4
    curve = MeasuredCurve(CostCurve.from_relative({1: 1.0, 9: 1.0}), k + 1, measure=True)
    for n in (1, 3, 4, 5):  # every length timed but 2 (one drafted token): exploration cuts chains to one token
        for _ in range(CURVE_MIN):
            curve.observe(n, 0.010)
    rows = HybridRows(k=k, max_model_len=512, curve=curve)
    # the suffix chain: a text that repeats, the trained drafter not run; the trained chain: new text, drafted right
    target = [40 + (7 * i) % 23 for i in range(80)] if kind == "suffix" else [100 + i for i in range(80)]
    done = 26
    for step in range(3 * EXPLORE_EVERY):
        pending = rows.prepare(0, "r", target[:done], target[done - 1:done], greedy=False)
        trained = (target[done:done + 3], [0.95] * 3) if kind == "trained" else (None, None)
        chosen = rows.choose(pending, *trained)
        sent = rows.sent_chain(time.perf_counter(), [pending], [chosen])[0]
        if len(sent) == 1 < len(chosen):
            break
        done += 1  # nothing accepted: the bonus token only
    else:
        pytest.fail("no step was cut by exploration")
    last = rows.sent["r"]
    assert last.kind == kind and last.sent == 1 and last.length == len(chosen)
    drafter = rows.suffix.rows[0].drafter
    suffix_before, trained_before = dict(drafter.calibration.scored), dict(rows.calibration.seen)
    rows.prepare(0, "r", target[:done + 2], target[done:done + 2], greedy=False)  # the token sent, then the bonus
    if kind == "suffix":
        learned = {key[1]: v - suffix_before.get(key, 0.0) for key, v in drafter.calibration.scored.items()}
    else:
        learned = {key[0] + 1: v - trained_before.get(key, 0.0) for key, v in rows.calibration.seen.items()}
    assert learned.get(1, 0) > 0  # the position sent learned
    assert all(v == 0 for d, v in learned.items() if d > 1)  # the positions cut off were not counted as rejected
