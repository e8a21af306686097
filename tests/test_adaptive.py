"""Adaptive speculation with an injected cost curve: the root alone when drafts are never accepted, the whole tree
when they always are; and decoding stays lossless (greedy equality, the sampling test) while the depth changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from selfspec.decode.adaptive import AdaptiveDepth, CostCurve
from selfspec.decode.drafters import MedusaDrafter
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.tree import load_tree

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU_LIKE = CostCurve.from_relative({1: 1.0, 4: 1.0, 8: 1.29, 16: 1.5, 32: 2.05, 64: 3.24})


def draft_of(tree):
    return SimpleNamespace(tree=tree)


def run_policy(policy: AdaptiveDepth, accepted_of, steps: int = 60, tree: str = "mc_sim_7b_63") -> list[int]:
    """Drive the policy as the engine does, with a tree of depth 4; returns the depths it chose."""
    tree = load_tree(tree, num_heads=4)
    chosen = []
    for _ in range(steps):
        depth = policy.choose(100)
        chosen.append(depth)
        if depth:
            cut = tree.truncate(min(depth, tree.max_depth))
            policy.observe(depth, draft_of(cut), accepted_of(cut.max_depth), 0.0)
        else:
            policy.observe(0, draft_of(tree.truncate(0)), 0, 0.0)
    return chosen


def run_chain(policy: AdaptiveDepth, length: int, steps: int, accepted_of, seconds_of) -> list[int]:
    """Drive the policy over a chain drafter of ``length`` tokens: ``accepted_of(step, depth)`` tokens accepted and
    ``seconds_of(step, depth)`` seconds of drafting at each step; returns the depths it chose."""
    tree = load_tree(f"chain-{length}", num_heads=length)
    chosen = []
    for step in range(steps):
        depth = policy.choose(100)
        chosen.append(depth)
        cut = tree.truncate(min(depth, tree.max_depth))
        policy.observe(depth, draft_of(cut), accepted_of(step, cut.max_depth), seconds_of(step, cut.max_depth))
    return chosen


def test_never_accepted_drafts_give_way_to_plain_decoding():
    chosen = run_policy(AdaptiveDepth(CPU_LIKE, measure_draft=False), lambda depth: 0)
    assert chosen[0] == 100  # the first step shows how deep the drafter goes
    late = chosen[20:]
    assert late.count(0) >= 0.9 * len(late)  # the root alone, but for a rare exploring step


def test_always_accepted_drafts_go_as_deep_as_the_tree():
    chosen = run_policy(AdaptiveDepth(CPU_LIKE, measure_draft=False), lambda depth: depth, tree="chain-4")
    assert chosen[5:].count(4) == len(chosen[5:])


def test_costly_drafting_is_counted():
    # accepted half the time at level 1 only; drafting costs as much as a forward: not worth it
    policy = AdaptiveDepth(CPU_LIKE, measure_draft=True)
    policy.draft_s = 1.0  # seconds per drafted step, against a one-token forward of 1 ms
    chosen = run_policy(policy, lambda depth: 1 if torch.rand(1).item() < 0.5 else 0)
    assert chosen[20:].count(0) >= 0.9 * len(chosen[20:])


def test_a_chain_drafter_paying_per_level_drafts_the_depth_that_pays():
    # layer-skip-like: drafting costs 0.13 of a forward per level, only the first level is accepted (a third of the
    # time). The first step drafts all 4 levels (0.52 of a forward); a cost averaged over depths would keep
    # charging depth 1 for that, and never draft; per depth, one level pays: (1 + 1/3) / (1 + 0.13) > 1.
    policy = AdaptiveDepth(CPU_LIKE, measure_draft=True)
    chosen = run_chain(policy, 4, 80, lambda step, depth: 1 if depth and step % 3 == 0 else 0,
                       lambda step, depth: 0.00013 * depth)  # forward: 1 ms
    assert chosen[0] == 100 and chosen[20:].count(1) >= 0.8 * len(chosen[20:])
    assert policy.draft_seconds(1) == pytest.approx(0.00013, rel=0.05)
    assert policy.draft_seconds(3) == pytest.approx(3 * policy.draft_seconds(1), rel=0.3)  # scaled from a neighbour


def test_a_cold_first_draft_does_not_switch_off_a_drafter_that_pays():
    # DFlash-like: one drafted block of 2 costs 7% of a forward, and its levels are accepted 3/4 and 1/2 of the time,
    # so it pays ((1 + 0.75 + 0.5) / (1 + 0.07) > 1). Its first draft runs cold, 50 forwards' time (kernels chosen,
    # buffers made on first use; on a GPU). Counted, that time would price every depth far above what it can give, no
    # depth would be drafted again, and no warm time would ever replace it.
    policy = AdaptiveDepth(CPU_LIKE, measure_draft=True)
    chosen = run_chain(policy, 2, 60, lambda step, depth: min(depth, (0, 1, 2, 2)[step % 4]),
                       lambda step, depth: 0.050 if step == 0 else 0.00007)  # forward: 1 ms
    assert chosen[0] == 100 and chosen[10:].count(2) >= 0.9 * len(chosen[10:])
    assert policy.draft_seconds(2) == pytest.approx(0.00007)


def test_unlucky_first_drafts_do_not_switch_off_a_drafter_that_pays():
    # layer-skip-like again: one level accepted a third of the time pays ((1 + 1/3) / (1 + 0.2) > 1). Its first
    # ten drafts are all rejected (a 2% chance at that rate). On the estimate alone (optimism 0) depth 1 then looks
    # worse than plain decoding, and only the rare looks one level deeper could bring it back; counting the
    # estimate's standard error (the default), it drafts on and learns the true rate.
    def run(optimism: float) -> list[int]:
        policy = AdaptiveDepth(CPU_LIKE, measure_draft=True, optimism=optimism, full_depth=1)
        tree = load_tree("chain-1", num_heads=1)
        chosen, drafted = [], 0
        for _ in range(300):
            depth = policy.choose(100)
            chosen.append(depth)
            cut = tree.truncate(min(depth, tree.max_depth))
            accepted = 0
            if depth:
                drafted += 1
                accepted = 1 if drafted > 10 and drafted % 3 == 2 else 0
            policy.observe(depth, draft_of(cut), accepted, 0.0002 * cut.max_depth)  # forward: 1 ms
        return chosen

    assert run(0.0)[100:].count(1) <= 0.1 * 200  # stuck on plain decoding
    assert run(1.0)[100:].count(1) >= 0.9 * 200


def test_a_verify_that_skips_the_drafted_layers_is_charged_only_for_the_rest():
    # layer-skip: drafting ran the first layers on the chain (their time is in the 0.2 of a forward that drafting
    # costs per level), so its verify pass runs the other 85% of the target. Level 1 is accepted 15% of the time:
    # charged a whole forward, one drafted level does not pay (1.15 / 1.2); charged 85% of one, it does.
    def policy(share: float) -> AdaptiveDepth:
        p = AdaptiveDepth(CPU_LIKE, measure_draft=True, verify_share=share, full_depth=1, prior_steps=0.0)
        p.tried, p.reached, p.draft_by_depth = {1: 100.0}, {1: 15.0}, {1: 0.0002}  # s; a one-token forward: 1 ms
        return p

    whole, skipping = policy(1.0), policy(0.85)
    assert whole.rate(1) == pytest.approx(1.15 / 1.2) and whole.choose(1) == 0
    assert skipping.rate(1) == pytest.approx(1.15 / (0.85 + 0.2)) and skipping.choose(1) == 1
    assert skipping.rate(0) == whole.rate(0) == 1.0  # plain decoding runs the whole target either way


def test_greedy_and_sampling_stay_lossless_while_the_depth_adapts(tiny_llama):
    from test_engine import (OracleDrafter, exact_first_three, prompts, random_heads, reference,
                             sampled_first_three, small_vocab_target)
    from test_verify import chi_square_pvalue

    model, _ = tiny_llama
    # greedy: an oracle that hides the target's continuation in the tree's branches, so the depth the policy picks
    # decides how much of it is accepted (greedy output does not depend on the draft: accepted drafts are the test)
    policy = AdaptiveDepth(CPU_LIKE, measure_draft=False, explore_every=3)
    oracle = OracleDrafter(load_tree("mc_sim_7b_63"), model.config.vocab_size, seed=5)
    decoder = SpeculativeDecoder(model, oracle, depth_policy=policy)
    accepted = 0
    for i in range(6):
        ref, eos = reference("llama", model, i)
        oracle.reset(ref, eos)
        decoder.eos_token_ids = frozenset([eos])
        res = decoder.generate(prompts()[i], max_new_tokens=20)
        assert res.tokens == ref
        accepted += res.stats.accepted
    assert len(policy.nodes) >= 2  # several depths were verified
    assert accepted >= 20 and oracle.longest_accept >= 2

    small = small_vocab_target()
    exact = exact_first_three(small, torch.tensor([3, 5, 7, 1])).reshape(-1)
    drafter = MedusaDrafter(random_heads(small, num_heads=2, seed=3), [[0], [1], [2], [0, 0], [1, 0]])
    counts, _ = sampled_first_three(small, drafter, seeds=800,
                                    depth_policy=AdaptiveDepth(CPU_LIKE, measure_draft=False, explore_every=2))
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_the_cached_curve_never_charges_a_smaller_tree_more():
    from selfspec.decode.adaptive import monotone

    assert monotone([70.9, 108.7, 96.2, 103.4, 123.0, 156.2, 225.3]) == (70.9, 96.2, 96.2, 103.4, 123.0, 156.2, 225.3)
    assert monotone([1.0, 2.0, 3.0]) == (1.0, 2.0, 3.0)


class BusyMachine:
    """A deterministic clock and a fake verify forward: a forward of n nodes takes ``true_ms(n)``, plus ``burst_ms``
    when the machine is busy, which it is on the forwards numbered in ``busy`` (counted from 0, in call order)."""

    def __init__(self, busy=(), burst_ms: float = 4.0, slower: float = 1.0):
        self.now, self.count, self.busy, self.burst_ms, self.slower = 0.0, 0, set(busy), burst_ms, slower

    @staticmethod
    def true_ms(n: int) -> float:
        return 1.0 + 0.05 * n

    def clock(self) -> float:
        return self.now

    def forward(self, n: int) -> None:
        extra = self.burst_ms if self.count in self.busy else 0.0
        self.now += (self.slower * self.true_ms(n) + extra) / 1000.0
        self.count += 1

    def measure(self, sizes, repeats):
        from selfspec.decode.adaptive import time_interleaved

        return time_interleaved(self.forward, sizes, repeats, self.clock)


def test_the_fastest_of_interleaved_repeats_recovers_the_curve_through_noise_bursts(tmp_path):
    from selfspec.decode.adaptive import CURVE_REPEATS, CURVE_SIZES, settled_curve

    sizes = len(CURVE_SIZES)
    # every size loses 4 of its 9 repeats to bursts (the busy forwards are spread over the repeats)
    busy = [r * sizes + i for i in range(sizes) for r in range(CURVE_REPEATS) if (r + i) % 2 == 0 and r < 8]
    machine = BusyMachine(busy=busy)
    curve = settled_curve(tmp_path / "curve.json", machine.measure)
    assert curve.ms == pytest.approx(tuple(BusyMachine.true_ms(n) for n in CURVE_SIZES))
    assert (tmp_path / "curve.json").is_file()  # the fastest repeats agree: kept for later sessions
    assert settled_curve(tmp_path / "curve.json", BusyMachine().measure) == curve  # a quiet check confirms it


def test_a_curve_measured_while_the_machine_was_busy_is_not_kept(tmp_path):
    from selfspec.decode.adaptive import CURVE_REPEATS, CURVE_SIZES, settled_curve

    sizes = len(CURVE_SIZES)
    # the one-node forward is busy on all repeats but one: its fastest is not confirmed by a second one
    busy = [r * sizes for r in range(1, CURVE_REPEATS)]
    curve = settled_curve(tmp_path / "curve.json", BusyMachine(busy=busy).measure)
    assert curve.ms[0] == pytest.approx(BusyMachine.true_ms(1))  # this process still uses its fastest reading
    assert not (tmp_path / "curve.json").exists()
    # busy through every repeat: each size's readings agree (all slow), so the next check must catch it
    slow = settled_curve(tmp_path / "curve.json", BusyMachine(slower=2.0).measure)
    assert (tmp_path / "curve.json").is_file() and slow.ms[0] == pytest.approx(2 * BusyMachine.true_ms(1))
    quiet = BusyMachine()
    again = settled_curve(tmp_path / "curve.json", quiet.measure)  # a fresh one-token timing: the kept one is slow
    assert again.ms == pytest.approx(tuple(BusyMachine.true_ms(n) for n in CURVE_SIZES))
    assert quiet.count > 3  # measured again, not only checked
    assert settled_curve(tmp_path / "curve.json", BusyMachine(slower=1.5).measure) == again  # busy now: kept as is


def test_a_curve_measured_while_other_processes_used_the_cpus_is_not_kept(tmp_path, monkeypatch):
    from selfspec.cpu_kernels import machine_load
    from selfspec.cpu_kernels.machine_load import CpuTimes
    from selfspec.decode.adaptive import settled_curve

    # every repeat agrees (the others were busy throughout), but the others used 45% of the CPUs' time meanwhile
    busy = iter([CpuTimes(0.0, 0.0, 0.0), CpuTimes(busy=500.0, total=1000.0, own=50.0)])
    monkeypatch.setattr(machine_load, "cpu_times", lambda: next(busy))
    curve = settled_curve(tmp_path / "curve.json", BusyMachine(slower=1.3).measure)
    assert curve.ms[0] == pytest.approx(1.3 * BusyMachine.true_ms(1))  # this process's own reading
    assert not (tmp_path / "curve.json").exists()
    monkeypatch.setattr(machine_load, "cpu_times", lambda: None)  # quiet: kept
    settled_curve(tmp_path / "curve.json", BusyMachine().measure)
    assert (tmp_path / "curve.json").is_file()


def test_the_measured_curve_is_checked_once_per_process(tiny_llama, monkeypatch, tmp_path):
    from selfspec.decode import adaptive

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(adaptive, "_SETTLED", {})
    calls = []
    monkeypatch.setattr(adaptive, "settled_curve", lambda path, measure: calls.append(path) or CPU_LIKE)
    model, _ = tiny_llama
    assert adaptive.measured_cost_curve(model) is CPU_LIKE and adaptive.measured_cost_curve(model) is CPU_LIKE
    assert len(calls) == 1 and calls[0].parent == tmp_path / "cost_curves"


def test_beside_a_confident_suffix_a_drafter_drafts_only_where_it_adds():
    """A chain drafter accepted at level 1 half the time, at a tenth of a forward a draft, pays alone. Beside
    suffix nodes that already yield 3.5 tokens and miss at their first level one step in ten, its tokens count only
    on those steps and its nodes widen the tree: it stops drafting. Beside a suffix that has nearly nothing (one
    node, missed nine times in ten) it drafts as it would alone."""
    from selfspec.decode.types import Beside

    policy = AdaptiveDepth(CPU_LIKE, measure_draft=True, explore_every=1000)
    tree = load_tree("chain-4", num_heads=4)
    for step in range(60):  # whole chains: level 1 accepted every other step, nothing deeper; 0.1 ms a level
        policy.observe(4, draft_of(tree), int(step % 2 == 0), 0.0004)  # (a forward: 1 ms)
    assert policy.choose(100) == 1
    confident = Beside(nodes=5, expected=3.5, miss=0.1)
    weak = Beside(nodes=2, expected=1.1, miss=0.9)
    assert [policy.choose(100, confident) for _ in range(10)] == [0] * 10
    assert [policy.choose(100, weak) for _ in range(10)] == [1] * 10
    # what each choice weighs: beside the confident suffix, drafting adds 0.1 * 0.5 tokens for a wider tree and a
    # draft, less than the tokens per cost the suffix's nodes already give
    assert policy.rate(1, beside=confident) < policy.rate(0, beside=confident)
    assert policy.rate(0, beside=confident) == pytest.approx(3.5 / CPU_LIKE.cost(5))


# the SmolLM2-135M verify curve of a 2-core AVX-512 CPU with the padded products (ms, cached by selfspec.decode.adaptive; the
# machine's curve where oneDNN's packed product is not offered): flat to 4 nodes, then steep
SMOLLM2_CPU = CostCurve(sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
                        ms=(26.65, 27.51, 27.86, 28.17, 41.15, 47.37, 61.04, 62.0, 80.41, 87.66, 134.17))


def test_a_static_tree_is_weighed_at_its_size_from_the_first_step():
    """mc_sim_7b_63's first level alone is 10 nodes, which cost as much as two forwards on a CPU. Guessed as a
    chain before the first draft (depth + 1 nodes), its first drafts looked cheap and whole 60-node trees were
    drafted at the start of every answer; told each depth's size, the policy drafts nothing until drafts pay."""
    tree = load_tree("mc_sim_7b_63", num_heads=4)
    sizes = {d: int(tree.truncate(d).num_nodes) for d in range(1, tree.max_depth + 1)}
    assert AdaptiveDepth(SMOLLM2_CPU, full_depth=tree.max_depth).choose(100) >= 3  # a chain guess: deep and costly
    told = AdaptiveDepth(SMOLLM2_CPU, full_depth=tree.max_depth, nodes=dict(sizes))
    assert told.choose(100) == 0
    # once a shallower cut was seen, a deeper one is never guessed smaller than it
    seen = AdaptiveDepth(SMOLLM2_CPU, full_depth=tree.max_depth)
    seen.observe(3, draft_of(tree.truncate(3)), 0, 0.0)
    assert seen.choose(100) == 0
    assert seen.rate(4, optimistic=True) <= seen.expected(4, optimistic=True) / SMOLLM2_CPU.cost(sizes[3] + 1)


class _EveryDepth:
    """A depth policy that asks depths 1, 2, .. ``top`` in turn and keeps the node count of each cut draft."""

    def __init__(self, top: int):
        self.top, self.step, self.seen = top, 0, {}

    def choose(self, max_depth, beside=None):
        self.step += 1
        return min(max_depth, (self.step - 1) % self.top + 1)

    def observe(self, asked, draft, accepted, draft_seconds):
        if asked:  # not the last step's root alone
            self.seen.setdefault(asked, set()).add(int(draft.tree.num_nodes))


@pytest.mark.parametrize("family,settings", [
    ("medusa", {}), ("eagle3", {}), ("eagle3", {"top_k": 3, "total_tokens": 10}), ("dflash", {}), ("dflash", {"top_k": 3})])
def test_each_family_says_how_many_nodes_a_depth_drafts(tiny_llama, family, settings):
    """``draft_nodes(d)`` is the size of the draft the engine verifies when the policy asks depth d."""
    from selfspec.decode import registry
    from selfspec.core.target import Target

    model, tokenizer = tiny_llama
    entry = registry.entry(family)
    target = Target(model, tokenizer, "tiny-llama")
    drafter = entry.build(entry.random_heads(model), target, entry.settings(None, settings))
    policy = _EveryDepth(drafter.max_draft_depth)
    SpeculativeDecoder(model, drafter, depth_policy=policy).generate(torch.arange(3, 12), max_new_tokens=40)
    assert set(policy.seen) == set(range(1, drafter.max_draft_depth + 1))
    for depth, sizes in policy.seen.items():
        assert sizes == {drafter.draft_nodes(depth)}, (family, depth)


def test_a_depth_that_could_never_pay_is_not_looked_at():
    """On this CPU curve mc_sim_7b_63's cuts cost more forwards than the tokens they could give even if every level
    were accepted (10 nodes for at most 2 tokens, ...): heads that accept nothing are never looked at again. A chain
    of the same depth could pay, so it is still looked at every so often."""
    tree = load_tree("mc_sim_7b_63", num_heads=4)
    sizes = {d: int(tree.truncate(d).num_nodes) for d in range(1, tree.max_depth + 1)}
    policy = AdaptiveDepth(SMOLLM2_CPU, measure_draft=False, full_depth=tree.max_depth, nodes=dict(sizes))
    assert all(policy.rate(d, ceiling=True) <= policy.rate(0) for d in range(1, tree.max_depth + 1))
    assert run_policy(policy, lambda depth: 0, steps=200) == [0] * 200
    chain = AdaptiveDepth(SMOLLM2_CPU, measure_draft=False, full_depth=4)
    assert any(run_policy(chain, lambda depth: 0, steps=200, tree="chain-4")[100:])
