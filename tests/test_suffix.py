"""The training-free suffix drafter: its indexes return what a brute-force scan finds, its drafts are lossless
(greedy equality with HF generate, and the sampling test), and adaptive speculation picks the root alone when drafts
are never accepted and a deep tree when they always are."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from selfspec.decode import registry
from selfspec.decode.adaptive import Calibration, CostCurve, best_size
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.suffix import (Candidates, NgramIndex, SuffixArray, SuffixDrafter, SuffixPlan, corpus_documents,
                           load_corpus)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU_CURVE = CostCurve.from_relative({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.29, 16: 1.5, 32: 2.05, 64: 3.24})


def suffix_drafter(model, corpus: SuffixArray | None = None, **settings) -> SuffixDrafter:
    """A suffix drafter under the suffix family's settings of conf/suffix.yaml, ``settings`` over them
    (its corpus there is a file: ``corpus`` here is the index itself)."""
    defaults = {k: v for k, v in registry.entry("suffix").defaults.items() if k != "corpus"}
    return SuffixDrafter(model, corpus, **{**defaults, **settings})


# --- indexes against brute force ------------------------------------------------------------------------------------


def brute_longest(seq: list[int], max_n: int) -> tuple[int, list[int]]:
    """The longest n <= max_n whose last n tokens occur earlier in seq, and the positions after those occurrences."""
    for n in range(min(max_n, len(seq) - 1), 0, -1):
        pattern = seq[-n:]
        hits = [i + n for i in range(len(seq) - n) if seq[i:i + n] == pattern]
        if hits:
            return n, hits
    return 0, []


@pytest.mark.parametrize("seed", range(5))
def test_ngram_index_finds_what_a_scan_finds(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(6) for _ in range(rng.randrange(2, 120))]
    index = NgramIndex(max_n=8)
    cut = rng.randrange(1, len(seq) + 1)
    index.extend(seq[:cut])
    index.extend(seq[cut:])  # grown in two steps, as decoding does
    assert index.longest_match() == brute_longest(seq, 8)
    n, hits = index.longest_match()
    assert index.continuations(hits, 3, limit=2) == [seq[p:p + 3] for p in reversed(hits[-2:])]


@pytest.mark.parametrize("seed", range(8))
def test_a_match_after_tokens_not_yet_indexed_is_what_a_scan_finds_and_changes_nothing(seed):
    """longest_match(extra): the longest n whose last n tokens of seq + extra occur ending inside seq before
    its end (so that something follows them), the positions after them; the index is left as it was."""
    rng = random.Random(seed)
    seq = [rng.randrange(5) for _ in range(rng.randrange(2, 100))]
    extra = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
    index = NgramIndex(max_n=8)
    index.extend(seq)
    before = (list(index.tokens), {k: list(v) for k, v in index.follows.items()})
    whole = seq + extra
    expected = (0, [])
    for n in range(min(8, len(whole) - 1), 0, -1):
        hits = [i + n for i in range(len(seq) - n) if whole[i:i + n] == whole[-n:]]
        if hits:
            expected = (n, hits)
            break
    assert index.longest_match(extra) == expected
    assert (index.tokens, index.follows) == before


def test_the_suffix_drafter_continues_another_drafters_guess_without_taking_it_in(tiny_llama):
    """rank_after(extra): the continuations that follow ``extra`` where it occurred before, as rank would find them
    once ``extra`` was decoded, and the drafter's index is unchanged."""
    from types import SimpleNamespace

    model, _ = tiny_llama
    drafter = suffix_drafter(model, cost_curve=CPU_CURVE, chain=True)
    prompt = [5, 6, 7, 20, 21, 22, 23, 24, 8, 9]  # 20 21 22 23 24 seen once; the answer turns to it at 20
    drafter.start(SimpleNamespace(prompt_ids=torch.tensor(prompt), prompt_length=len(prompt), next_token=30,
                                  new_tokens=[30]), None)
    state = SimpleNamespace(prompt_length=len(prompt), new_tokens=[30])
    now = drafter.rank(state, 4)
    assert not now.ranked  # 30 is new: nothing to continue
    tokens = list(drafter.index.tokens)
    after = drafter.rank_after([20], 4)
    assert [after.cands.tokens[n] for n in after.ranked] == [21, 22, 23, 24]
    assert drafter.index.tokens == tokens
    decoded = SimpleNamespace(prompt_length=len(prompt), new_tokens=[30, 20])
    assert drafter.rank(decoded, 4).cands.tokens == after.cands.tokens


@pytest.mark.parametrize("seed", range(5))
def test_suffix_array_finds_what_a_scan_finds(seed):
    rng = random.Random(seed)
    docs = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 6))]
    sa = SuffixArray.build(docs)
    flat = sa.tokens.tolist()
    # the order is the suffixes' order on their first tokens
    keys = [tuple(flat[s:s + 64]) for s in sa.order.tolist()]
    assert keys == sorted(keys)
    for _ in range(20):
        pattern = [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
        lo, hi = sa.find(pattern)
        starts = sorted(int(s) for s in sa.order[lo:hi])
        assert starts == [i for i in range(len(flat)) if flat[i:i + len(pattern)] == pattern]
        conts = sorted(map(tuple, sa.continuations((lo, hi), len(pattern), 3, limit=10**6)))
        expected = []
        for i in starts:
            cont = flat[i + len(pattern): i + len(pattern) + 3]
            expected.append(tuple(cont[: cont.index(-1)] if -1 in cont else cont))
        assert conts == sorted(expected)
    context = [rng.randrange(5) for _ in range(12)]
    n, (lo, hi) = sa.longest_match(context, 8)
    if n:
        assert hi > lo and sa.find(context[-n:]) == (lo, hi)
    if n < 8:
        assert sa.find(context[-(n + 1):])[1] == sa.find(context[-(n + 1):])[0]


def test_candidates_rank_parents_before_children_by_share():
    cands = Candidates()
    cands.add([[1, 2, 3], [1, 2, 4], [1, 5], [6]], 1.0)
    ranked = cands.ranked(10)
    assert [cands.tokens[n] for n in ranked[:2]] == [1, 2]  # 1 follows 3 of 4 occurrences, then 1 2 two of 4
    assert cands.scores[ranked[0]] == pytest.approx(0.75)
    for n in ranked:
        parent = cands.parents[n]
        assert parent < 0 or ranked.index(parent) < ranked.index(n)
        assert parent < 0 or cands.scores[n] <= cands.scores[parent]


# --- adaptive sizes --------------------------------------------------------------------------------------------------


def test_adaptive_size_follows_the_cost_curve_and_the_acceptance():
    never, always = Calibration(), Calibration()
    for _ in range(50):
        never.update(0, [1.0] * 8, accepted=0)
        always.update(0, [1.0] * 8, accepted=8)
    scores = [1.0] * 16
    assert best_size(never.probabilities(scores, 0), CPU_CURVE, 16) == 0  # the root alone: plain decoding
    assert best_size(always.probabilities(scores, 0), CPU_CURVE, 16) == 16  # every node pays for itself
    # a flat curve makes any positive probability worth verifying; a steep one makes none
    flat = CostCurve.from_relative({1: 1.0, 64: 1.0})
    steep = CostCurve.from_relative({1: 1.0, 2: 2.0, 64: 64.0})
    assert best_size([0.1] * 10, flat, 10) == 10 and best_size([0.9] * 10, steep, 10) == 0


def test_a_flat_scored_chain_is_calibrated_per_depth():
    # one earlier occurrence scores every token of its 16-token continuation 1.0; the target keeps only the first
    cal = Calibration()
    for _ in range(200):
        for depth in range(1, 17):
            cal.update(3, [1.0], accepted=int(depth == 1), depth=depth)
    probs = cal.probabilities([1.0] * 16, 3, range(1, 17))
    assert probs[0] > 0.95 and max(probs[1:]) < 0.03
    assert best_size(probs, CPU_CURVE, 16) == 1  # the first token alone is worth verifying
    # one ratio for the whole chain (the same evidence pooled at one depth) makes every node about 1/16, and on a
    # flat-enough curve the whole chain looks worth verifying: 16 nodes a step for one accepted token
    pooled = Calibration()
    for _ in range(200):
        pooled.update(3, [1.0] * 16, accepted=1)
    assert best_size(pooled.probabilities([1.0] * 16, 3), CPU_CURVE, 16) == 16
    # a depth never verified leans on the one above it in the same bucket (times the chance to go on, never above
    # 1); a new bucket on every bucket's depth 1
    assert cal.factor(3, 17) <= cal.factor(3, 16)
    assert cal.factor(5, 1) == pytest.approx(cal.factor(3, 1), rel=0.1)


def test_before_any_evidence_a_deep_node_is_worth_less():
    """On text not seen yet, one earlier occurrence's 16-token continuation: each level goes on at the prior's
    ``prior_continue``, so a few first tokens are verified, not the whole continuation. With every depth at the
    prior rate (``prior_continue`` 1) the whole chain looked worth more than two forwards' cost on a CPU. Evidence
    then decides how deep a bucket's branches go."""
    cpu = CostCurve.from_relative({1: 1.0, 4: 1.057, 6: 1.54, 16: 2.33, 32: 3.29})  # SmolLM2-135M, a 2-core CPU
    fresh = Calibration()
    probs = fresh.probabilities([1.0] * 16, 1, range(1, 17))
    assert probs == pytest.approx([fresh.prior_rate * fresh.prior_continue ** d for d in range(16)])
    assert 1 <= best_size(probs, cpu, 16) <= 3
    hopeful = Calibration(prior_continue=1.0)
    assert best_size(hopeful.probabilities([1.0] * 16, 1, range(1, 17)), cpu, 16) == 16
    # what a bucket showed at the levels it verified carries deeper: a long copy (every verified level accepted, the
    # first 3 of them) is hoped to go on and is tried whole; continuations that halved level by level are not
    copying, fading = Calibration(), Calibration()
    for step in range(40):
        for depth in range(1, 4):
            copying.update(8, [1.0], accepted=1, depth=depth)
            fading.update(1, [1.0], accepted=int(step % 2 ** depth == 0), depth=depth)  # 1/2, 1/4, 1/8
    assert min(copying.factors(8, 16)) > 0.75
    assert best_size(copying.probabilities([1.0] * 16, 8, range(1, 17)), cpu, 16) == 16
    assert fading.factor(1, 6) < 0.03 and best_size(fading.probabilities([1.0] * 16, 1, range(1, 17)), cpu, 16) <= 3


def test_the_drafter_records_each_depth_of_its_branch(tiny_llama):
    model, _ = tiny_llama
    drafter = suffix_drafter(model, cost_curve=CPU_CURVE, remember=0)
    cands = Candidates()
    cands.add([[10, 11, 12], [10, 13]], 1.0)  # 10 (score 1), then 11 and 13 (0.5 each), then 12 (0.5)
    chosen = cands.ranked(4)
    drafter.record(SuffixPlan(2, cands, chosen, cands.depths()), accepted=2)  # 10, then one of 11 / 13 accepted; not 12
    assert drafter.calibration.scored == {(2, 1): 1.0, (2, 2): 1.0, (2, 3): 0.5}
    assert drafter.calibration.accepted == {(2, 1): 1.0, (2, 2): 1.0, (2, 3): 0.0}
    probs = drafter.probabilities(cands, 2, cands.depths())
    assert all(probs[n] <= probs[p] for n, p in enumerate(cands.parents) if p >= 0)


def test_drafter_stops_drafting_when_nothing_is_accepted(tiny_llama, monkeypatch):
    model, _ = tiny_llama
    # this CPU's measured curve (2026-11-25): a second node costs 21% of a forward, so once the calibration has
    # fallen below that, nothing is worth verifying by the estimates alone
    measured = CostCurve.from_relative({1: 1.0, 2: 1.21, 4: 1.35, 8: 1.67, 16: 2.0, 32: 2.4, 64: 3.35})
    drafter = suffix_drafter(model, cost_curve=measured, remember=0)  # the rejections alone, no earlier answers
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[])
    import selfspec.decode.engine as engine_module
    from selfspec.decode.verify import Verdict, verify

    def reject_all(logits, tokens, tree, sampling, draft_probs=None, generator=None):
        v = verify(logits[:1], tokens[:1], tree.truncate(0), sampling, None, generator)
        return Verdict(path=[0], next_token=v.next_token)

    monkeypatch.setattr(engine_module, "verify", reject_all)
    prompt = [5, 6, 7, 8] * 10
    res = decoder.generate(prompt, max_new_tokens=40)
    assert res.stats.drafted > 0  # it tried while the prior was hopeful
    late = SpeculativeDecoder(model, drafter, eos_token_ids=[]).generate(prompt, max_new_tokens=40)
    assert late.stats.drafted <= 3  # after many rejections the root alone is the best rate, but for a rare look
    # the target's own verify again, and a corpus holding its own continuation: the matches are now right
    monkeypatch.undo()
    own = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=40,
                         eos_token_id=None, pad_token_id=0)[0].tolist()
    drafter.corpus = SuffixArray.build([own])
    drafter.max_depth = 1  # one candidate a step: it is verified only if its own estimate pays for a second node
    again = SpeculativeDecoder(model, drafter, eos_token_ids=[])
    recovered = [again.generate(prompt, max_new_tokens=40).stats for _ in range(4)]
    assert recovered[-1].accepted > 10  # the occasional looks were accepted, and drafting came back


# --- lossless ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["auto", 1, 6])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_hf_generate(budget, arch, tiny_llama, tiny_qwen2, tmp_path):
    model, tokenizer = tiny_llama if arch == "llama" else tiny_qwen2
    corpus = SuffixArray.build([[9, 10, 11, 12, 13] * 4, list(range(20, 60))])
    always = CostCurve.from_relative({1: 1.0, 64: 1.0})  # every candidate is verified: the most drafted nodes
    drafter = suffix_drafter(model, corpus=corpus, budget=budget, max_nodes=12, cost_curve=always)
    decoder = SpeculativeDecoder(model, drafter)
    for prompt in ([9, 10, 11, 12], [5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 40))):
        ref = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=24,
                             pad_token_id=0)[0]
        res = decoder.generate(prompt, max_new_tokens=24)
        assert res.tokens == ref[len(prompt):].tolist()[: len(res.tokens)]
        assert len(res.tokens) == min(24, len(ref) - len(prompt)) or res.finish_reason == "eos"
    assert res.stats.drafted > 0


def own_samples_corpus(model) -> tuple[torch.Tensor, SuffixArray]:
    """The target's exact distribution of its first three tokens after the sampling tests' prompt [3, 5, 7, 1], and a
    corpus of 40 of its own samples there: drafts that are often right, and often wrong."""
    from test_engine import exact_first_three

    v = model.config.vocab_size
    exact = exact_first_three(model, torch.tensor([3, 5, 7, 1])).reshape(-1)
    draws = torch.multinomial(exact, 40, replacement=True, generator=torch.Generator().manual_seed(0)).tolist()
    return exact, SuffixArray.build([[3, 5, 7, 1, d // (v * v), d // v % v, d % v] for d in draws])


def test_sampled_tokens_follow_the_target_distribution():
    from test_engine import sampled_first_three, small_vocab_target
    from test_verify import chi_square_pvalue

    model = small_vocab_target()
    exact, corpus = own_samples_corpus(model)
    drafter = suffix_drafter(model, corpus=corpus, budget=8)
    counts, accept_rate = sampled_first_three(model, drafter, seeds=1500)  # temperature 0.9, top-p 0.9
    assert accept_rate > 0.5  # drafts were accepted often enough for the test to mean something
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


# --- corpora and the registry ----------------------------------------------------------------------------------------


def test_corpus_files_are_read_and_cached(tmp_path, tiny_llama, monkeypatch):
    import json

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    _, tokenizer = tiny_llama
    path = tmp_path / "regen.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "an answer"}]},
            {"question_id": 1, "answers": ["first", "second"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert corpus_documents(path) == ["hello there", "an answer", "first", "second"]
    index = load_corpus(path, tokenizer, verbose=False)
    assert list((tmp_path / "cache" / "suffix").glob("*.npz"))
    again = load_corpus(path, tokenizer, verbose=False)
    assert np.array_equal(index.tokens, again.tokens) and np.array_equal(index.order, again.order)
    hello = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    assert index.find(hello)[1] - index.find(hello)[0] == 1


def test_decode_run_drafts_with_the_suffix_drafter(tmp_path):
    from conftest import compose

    from selfspec.decode.session import load_session
    from selfspec.decode.types import DecodeSetupError

    session = load_session(compose("decode", ["model=tiny", "drafter=suffix", "draft.budget=4", "max_new_tokens=12"]))
    assert isinstance(session.decoder.drafter, SuffixDrafter) and session.heads is None
    ids = [5, 6, 7, 8, 5, 6, 7]
    ref = session.target.model.generate(torch.tensor([ids], device=session.target.model.device), do_sample=False,
                                        max_new_tokens=12, pad_token_id=0)
    assert session.decoder.generate(ids, max_new_tokens=12).tokens == ref[0, len(ids):].tolist()
    with pytest.raises(DecodeSetupError, match="draft.corpus=.*no such file"):
        load_session(compose("decode", ["model=tiny", "drafter=suffix", f"draft.corpus={tmp_path / 'none.jsonl'}"]))
    with pytest.raises(DecodeSetupError, match="draft.budget='many'"):
        load_session(compose("decode", ["model=tiny", "drafter=suffix", "draft.budget=many"]))


# --- earlier answers ---------------------------------------------------------------------------------------------------


def test_earlier_answers_are_indexed_and_the_oldest_dropped():
    def occurrences(pattern):
        lo, hi = drafter.history.find(pattern)
        return hi - lo

    drafter = suffix_drafter(None, remember=12, cost_curve=CPU_CURVE)
    drafter.remember_answer([1, 2, 3, 4, 5])
    assert drafter.history is not None and occurrences([3, 4]) == 1
    drafter.remember_answer([7])  # a one-token answer teaches nothing
    assert drafter.answers == [[1, 2, 3, 4, 5]]
    drafter.remember_answer([6, 7, 8, 9])
    drafter.remember_answer([10, 11, 12, 13])  # 13 tokens kept would pass remember=12: the oldest answer goes
    assert drafter.answers == [[6, 7, 8, 9], [10, 11, 12, 13]]
    assert occurrences([1, 2]) == 0 and occurrences([12, 13]) == 1  # the rebuilt index: the oldest answer gone
    # a context that ends like an earlier answer draws that answer's continuation
    drafter.index = NgramIndex(drafter.max_match)
    drafter.index.extend([50, 51, 6, 7])
    n, cands = drafter._candidates(depth=3)
    assert n == 2 and [cands.tokens[i] for i in cands.ranked(3)] == [8, 9]
    with pytest.raises(ValueError, match="draft.remember=-1"):
        suffix_drafter(None, remember=-1)


def test_rebuilding_waits_for_an_eighth_of_the_index():
    drafter = suffix_drafter(None, remember=10_000)
    drafter.remember_answer(list(range(800)))
    first = drafter.history
    drafter.remember_answer([1, 2])  # 2 new tokens: less than 800 / 8, the index is kept as it is
    assert drafter.history is first and drafter._indexed == 800
    drafter.remember_answer(list(range(1000, 1100)))  # 102 waiting >= 100: rebuilt with everything
    assert drafter.history is not first and drafter._indexed == 902 and len(drafter.history.tokens) == 902 + 3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_second_generation_drafts_from_the_first_answer_and_stays_lossless(arch, tiny_llama, tiny_qwen2):
    model, _ = tiny_llama if arch == "llama" else tiny_qwen2
    always = CostCurve.from_relative({1: 1.0, 64: 1.0})
    prompt = [3, 17, 29, 41, 2, 88, 61]
    ref = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=32,
                         pad_token_id=0)[0]
    ref = ref[len(prompt):].tolist()
    runs = {}
    for remember in (0, 200_000):
        decoder = SpeculativeDecoder(model, suffix_drafter(model, remember=remember, cost_curve=always),
                                     eos_token_ids=[])
        first, second = (decoder.generate(prompt, max_new_tokens=32) for _ in range(2))
        assert first.tokens == second.tokens == ref  # lossless with and without the history
        runs[remember] = (first.stats, second.stats)
    assert runs[0][1].steps == runs[0][0].steps  # no history: the second run drafts as the first did
    assert runs[200_000][1].steps < runs[200_000][0].steps  # the first answer, remembered, is drafted again
