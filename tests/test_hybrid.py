"""Hybrid trees (decode/hybrid.py): merging keeps every proposed branch once and respects the budget; a trained
drafter (Medusa, EAGLE, EAGLE-3) with the suffix drafter's proposals stays lossless (greedy equality with HF
generate, and the sampling test); each part learns from its own share of the accepted branch; decode/run.py builds
it with draft.suffix=true."""

from __future__ import annotations

import random

import pytest
import torch

from selfspec.decode.adaptive import AdaptiveDepth, CostCurve
from selfspec.decode.drafters import MedusaDrafter, OracleDrafter, random_medusa_heads
from selfspec.decode.eagle_drafter import random_eagle_heads
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.hybrid import HybridDrafter, accepted_from, merge_drafts
from selfspec.decode.suffix import SuffixArray
from selfspec.decode.tree import Tree
from selfspec.decode.types import Draft, DrafterBase
from test_suffix import suffix_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLAT = CostCurve.from_relative({1: 1.0, 64: 1.0})  # verifying is free: the suffix drafts whatever it has


def random_draft(rng: random.Random, root: int, nodes: int, vocab: int) -> Draft:
    parents, tokens = [-1], [root]
    for _ in range(1, nodes):
        parent = rng.randrange(len(tokens))
        taken = {tokens[j] for j in range(1, len(tokens)) if parents[j] == parent}
        free = [t for t in range(vocab) if t not in taken]
        if not free:
            continue
        parents.append(parent)
        tokens.append(rng.choice(free))
    return Draft(tokens=torch.tensor(tokens), tree=Tree.from_parents(parents))


def node_paths(draft: Draft) -> list[tuple[int, ...]]:
    """Each non-root node's token path from the root (root excluded), in node order."""
    parents, tokens = draft.tree.parents.tolist(), draft.tokens.tolist()
    out = []
    for node in range(1, len(tokens)):
        path, n = [], node
        while n > 0:
            path.append(tokens[n])
            n = parents[n]
        out.append(tuple(reversed(path)))
    return out


def branches(draft: Draft) -> set[tuple[int, ...]]:
    """Every node's token path from the root (root excluded)."""
    return set(node_paths(draft))


@pytest.mark.parametrize("seed", range(6))
def test_merge_keeps_every_branch_once_within_the_budget(seed):
    rng = random.Random(seed)
    a, b = random_draft(rng, 7, rng.randrange(1, 15), 4), random_draft(rng, 7, rng.randrange(1, 15), 4)
    merged, (mine_a, mine_b) = merge_drafts([a, b], max_nodes=64)
    assert branches(merged) == branches(a) | branches(b)  # nothing lost, shared prefixes once
    assert merged.tree.num_nodes - 1 == len(branches(a) | branches(b))
    assert int(merged.tokens[0]) == 7
    # each node sits at its path's length (its position id) and the merged tree is as deep as the deeper draft
    assert [len(path) for path in node_paths(merged)] == merged.tree.depth[1:].tolist()
    assert merged.tree.max_depth == max(a.tree.max_depth, b.tree.max_depth)
    by_node = {}
    parents, tokens = merged.tree.parents.tolist(), merged.tokens.tolist()
    for node in range(1, len(tokens)):  # sibling tokens are distinct (point-mass verification relies on it)
        assert (parents[node], tokens[node]) not in by_node
        by_node[(parents[node], tokens[node])] = node
    assert len(mine_a) == a.tree.num_nodes - 1 and len(mine_b) == b.tree.num_nodes - 1

    cap = rng.randrange(0, 6)
    small, (first, _) = merge_drafts([a, b], max_nodes=cap)
    assert small.tree.num_nodes - 1 == min(cap, len(branches(a) | branches(b)))
    assert branches(small) <= branches(a) | branches(b)
    # closed under parents (Tree.from_parents checks order) and the first draft is served first
    assert len(first) == min(cap, a.tree.num_nodes - 1)


def test_each_part_is_credited_with_its_own_accepted_prefix():
    assert accepted_from([0, 3, 5, 9], {3, 5}) == 2
    assert accepted_from([0, 3, 5, 9], {5, 9}) == 0
    assert accepted_from([0], {1, 2}) == 0


def hybrid(model, family: str, corpus=None) -> HybridDrafter:
    if family == "medusa":
        inner = MedusaDrafter(random_medusa_heads(model, seed=1), tree="small_16")
    elif family.startswith("layerskip"):  # the target's own exit after layer 1, or a trained adapter exit there
        from test_layerskip_train import trained_like_exit

        from selfspec.decode.layerskip import LayerSkipDrafter

        exit = trained_like_exit(model, 1, "adapter", None) if family == "layerskip_adapter" else None
        inner = LayerSkipDrafter(model, exit_layer=1, threshold=0.0, max_depth=3, exit=exit)
    else:
        from selfspec.decode.eagle_drafter import EagleTreeDrafter

        inner = EagleTreeDrafter(random_eagle_heads(model, seed=1, variant=family), depth=3, top_k=2, total_tokens=6)
    suffix = suffix_drafter(model, corpus=corpus, max_nodes=8, cost_curve=FLAT)
    exclusive = False if family == "layerskip_merged" else None  # layer-skip: turns by default, or one merged tree
    return HybridDrafter(inner, suffix, max_nodes=16, marginal=True, exclusive=exclusive, splice=True)


@pytest.mark.parametrize("family", ["medusa", "eagle", "eagle3", "layerskip", "layerskip_merged", "layerskip_adapter"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_equals_hf_generate(family, arch, adaptive, tiny_llama, tiny_qwen2):
    if family.startswith("layerskip"):  # exits that are often right, so chain and suffix nodes both get accepted
        from test_layerskip import confident_target

        model, _ = confident_target(arch)
    else:
        model, _ = tiny_llama if arch == "llama" else tiny_qwen2
    corpus = SuffixArray.build([[9, 10, 11, 12, 13] * 4, list(range(20, 60))])
    policy = AdaptiveDepth(FLAT, measure_draft=False, explore_every=2) if adaptive else None
    drafter = hybrid(model, family, corpus)
    decoder = SpeculativeDecoder(model, drafter, depth_policy=policy)
    suffix_accepted = 0
    for prompt in ([9, 10, 11, 12], [5, 6, 7, 5, 6, 7, 5, 6], list(range(20, 40))):
        ref = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=24,
                             pad_token_id=0)[0]
        res = decoder.generate(prompt, max_new_tokens=24)
        assert res.tokens == ref[len(prompt):].tolist()[: len(res.tokens)]
        assert len(res.tokens) == min(24, len(ref) - len(prompt)) or res.finish_reason == "eos"
        suffix_accepted += sum(drafter.suffix.calibration.accepted.values())
    assert res.stats.drafted > 0
    assert suffix_accepted > 0  # the suffix's part was verified and accepted, not only the heads'


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_layerskip_hybrid_commit_leaves_every_layer_as_a_fresh_forward(arch):
    """The suffix's nodes run layers 0..E-1 in the verify pass under the tree mask, beside the chain rows drafting
    cached: after each commit (accepted branches through either part), every layer holds what a plain forward over
    the committed text gives."""
    from test_layerskip import assert_caches_equal_fresh_forwards, confident_target

    from selfspec.decode.cache import layer_lengths

    model, _ = confident_target(arch)
    prompt = [9, 10, 11, 12, 13, 9, 10]
    with torch.no_grad():  # the target's own answer as the corpus: the suffix drafts deeper than the chain, and right
        own = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=16,
                             eos_token_id=None, pad_token_id=0)[0].tolist()
    drafter = hybrid(model, "layerskip_merged", SuffixArray.build([own]))
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[])
    states, original = [], drafter.on_commit

    def check(state, draft, verdict, out):
        original(state, draft, verdict, out)
        branch = list(verdict.path[1:])
        states.append((state.length, [(layer.keys.clone(), layer.values.clone()) for layer in state.cache.layers],
                       layer_lengths(state.cache), branch, len(drafter.inner._tokens)))

    drafter.on_commit = check
    res = decoder.generate(prompt, max_new_tokens=16)
    # some step accepted a node past the chain (a suffix node verified by the layer-skip pass)
    assert any(any(node >= chain for node in branch) for _, _, _, branch, chain in states)
    assert_caches_equal_fresh_forwards(model, prompt + res.tokens, states)


def test_sampled_tokens_follow_the_target_distribution():
    from test_engine import SAMPLE_TREE, random_heads, sampled_first_three, small_vocab_target
    from test_suffix import own_samples_corpus
    from test_verify import chi_square_pvalue

    model = small_vocab_target()
    exact, corpus = own_samples_corpus(model)
    inner = MedusaDrafter(random_heads(model, num_heads=2, seed=3), SAMPLE_TREE)
    drafter = HybridDrafter(inner, suffix_drafter(model, corpus=corpus, budget=4), max_nodes=12, marginal=True,
                            splice=True)
    counts, accept_rate = sampled_first_three(model, drafter, seeds=1500)
    assert accept_rate > 0.5
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_a_layerskip_hybrid_takes_turns_by_default(tiny_llama):
    """Each step either the suffix drafts (it chose candidates) or the layer-skip chain does, never both; a Medusa
    hybrid merges both every step."""
    from test_layerskip import confident_target

    model, _ = confident_target("llama")
    prompt = [9, 10, 11, 12, 13, 9, 10]
    with torch.no_grad():
        own = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=8,
                             eos_token_id=None, pad_token_id=0)[0].tolist()
    corpus = SuffixArray.build([own])  # the suffix has candidates for the first 8 tokens, then none
    for family, exclusive, target in (("layerskip", True, model), ("medusa", False, tiny_llama[0])):
        drafter = hybrid(target, family, corpus)
        assert drafter.exclusive is exclusive
        steps = []
        original = drafter.propose

        def propose(state, max_depth):
            draft = original(state, max_depth)
            _, inner, plan, _, _ = drafter._step
            steps.append((len(plan.chosen), int(inner.tree.num_nodes) - 1))
            return draft

        drafter.propose = propose
        SpeculativeDecoder(target, drafter, eos_token_ids=[]).generate(prompt, max_new_tokens=20)
        if exclusive:
            assert all(suffix == 0 or inner == 0 for suffix, inner in steps)
            assert any(suffix > 0 for suffix, _ in steps) and any(inner > 0 for _, inner in steps)
        else:
            assert all(inner > 0 for _, inner in steps)  # the heads draft every step (no policy), beside the suffix


@pytest.mark.parametrize("exclusive", [None, False])
def test_sampled_tokens_of_a_layerskip_hybrid_follow_the_target_distribution(exclusive):
    from test_engine import sampled_first_three
    from test_suffix import own_samples_corpus
    from test_verify import chi_square_pvalue

    from selfspec.decode.layerskip import LayerSkipDrafter
    from selfspec.core.target import build_tiny

    model, _ = build_tiny("llama", vocab_size=12, hidden_size=32, num_hidden_layers=2, intermediate_size=64, seed=1)
    exact, corpus = own_samples_corpus(model)
    inner = LayerSkipDrafter(model, exit_layer=1, threshold=0.0, max_depth=2)
    drafter = HybridDrafter(inner, suffix_drafter(model, corpus=corpus, budget=4), max_nodes=12, marginal=True,
                            exclusive=exclusive, splice=True)
    counts, accept_rate = sampled_first_three(model, drafter, seeds=1500)
    assert accept_rate > 0.5
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_the_depth_policy_learns_the_heads_share_only(tiny_llama):
    """Heads whose drafts are never accepted are switched off by the policy while the suffix keeps drafting."""
    model, _ = tiny_llama
    steep = CostCurve.from_relative({1: 1.0, 2: 1.2, 4: 1.4, 8: 1.8, 16: 2.6, 64: 8.0})
    policy = AdaptiveDepth(steep, measure_draft=False, explore_every=1000)
    drafter = hybrid(model, "medusa")
    drafter.suffix.cost_curve = steep
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[], depth_policy=policy)
    for seed in range(4):  # random heads on a random model: their drafts are almost never the target's
        decoder.generate([5, 6, 7, 8] * 6 + [seed + 20], max_new_tokens=30)
    assert policy.reached.get(1, 0.0) < 0.2 * policy.tried[1]
    assert policy.choose(8) == 0


def test_decode_run_builds_a_hybrid_by_default_and_the_heads_alone_with_draft_suffix_false(tmp_path):
    from conftest import compose

    from selfspec.decode.session import load_session

    session = load_session(compose("decode", ["model=tiny", "draft.tree=small_16", "max_new_tokens=12"]))
    drafter = session.decoder.drafter
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.inner, MedusaDrafter)
    assert session.decoder.depth_policy is not None  # the engine's, which it hands the hybrid for the heads' part
    ids = [5, 6, 7, 8, 5, 6, 7]
    ref = session.target.model.generate(torch.tensor([ids], device=session.target.model.device), do_sample=False,
                                        max_new_tokens=12, pad_token_id=0)
    assert session.decoder.generate(ids, max_new_tokens=12).tokens == ref[0, len(ids):].tolist()
    # the engine handed the hybrid its policy and its step clock, which waits for the device when the policy reads it
    assert drafter.control.policy is session.decoder.depth_policy and drafter.control.clock.sync
    alone = load_session(compose("decode", ["model=tiny", "draft.suffix=false", "max_new_tokens=12"]))
    assert isinstance(alone.decoder.drafter, MedusaDrafter) and alone.decoder.depth_policy is not None


def half_known_answer(model) -> tuple[CostCurve, list[int], list[int]]:
    """A steep cost curve, a prompt and the target's own greedy 48-token answer after it (prompt included): the
    tests below give the suffix drafter the answer's first half (24 tokens) as its corpus."""
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        own = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48, eos_token_id=None,
                             pad_token_id=0)[0].tolist()
    return CostCurve.from_relative({1: 1.0, 2: 1.2, 4: 1.4, 8: 1.8, 16: 2.6, 64: 8.0}), prompt, own


def test_the_drafter_is_weighed_beside_the_suffix_and_skipped_where_the_suffix_has_the_step(tiny_llama):
    """``marginal`` (the default): an always-right chain drafter beside a suffix drafter that has the target's own
    answer in its corpus. Weighed alone, the chain pays every step; weighed beside the suffix's nodes, which are
    right too, it adds almost nothing where the suffix has candidates and is skipped there, and it still drafts
    where the suffix has none. The output is the target's either way."""
    model, _ = tiny_llama
    steep, prompt, own = half_known_answer(model)
    corpus = SuffixArray.build([own[: len(prompt) + 24]])
    calls, outputs = {}, {}
    for marginal in (False, True):
        inner = OracleDrafter(own[len(prompt):], depth=3)  # the target's answer: every draft accepted
        policy = AdaptiveDepth(steep, measure_draft=False, explore_every=1000)
        suffix = suffix_drafter(model, corpus=corpus, max_nodes=8, cost_curve=steep, remember=0)
        drafter = HybridDrafter(inner, suffix, max_nodes=16, marginal=marginal, splice=True)
        res = SpeculativeDecoder(model, drafter, eos_token_ids=[], depth_policy=policy).generate(prompt,
                                                                                                 max_new_tokens=40)
        calls[marginal], outputs[marginal] = inner.calls, res.tokens
        assert res.tokens == own[len(prompt): len(prompt) + 40]
    assert calls[True] < calls[False]
    assert calls[True] >= 3  # the second half, which the suffix cannot draft: the chain drafts there


def test_the_policy_learns_the_drafters_acceptance_only_where_the_suffix_missed(tiny_llama):
    """``marginal``: the policy counts the drafter's tokens on the steps where the suffix's first level misses
    (``Beside``), so it learns their acceptance on those steps only. A step the suffix's nodes won (both parts are
    right on the same text) counts the draft's size and time, not its acceptance. Without ``marginal`` every step's
    acceptance counts."""
    model, _ = tiny_llama
    steep, prompt, own = half_known_answer(model)
    corpus = SuffixArray.build([own[: len(prompt) + 24]])
    for marginal in (False, True):
        policy = AdaptiveDepth(steep, measure_draft=False, explore_every=1000)
        suffix = suffix_drafter(model, corpus=corpus, max_nodes=8, cost_curve=steep, remember=0)
        drafter = HybridDrafter(OracleDrafter(own[len(prompt):], depth=3), suffix, max_nodes=16, marginal=marginal,
                                splice=True)
        steps, won = [], []
        record, observe = suffix.record, policy.observe
        suffix.record = lambda plan, accepted: won.append(accepted) or record(plan, accepted)
        policy.observe = lambda asked, draft, accepted, s: (
            steps.append((won[-1], asked, accepted)) or observe(asked, draft, accepted, s))
        res = SpeculativeDecoder(model, drafter, eos_token_ids=[], depth_policy=policy).generate(prompt,
                                                                                                 max_new_tokens=40)
        assert res.tokens == own[len(prompt): len(prompt) + 40]
        drafted = [(w, a) for w, asked, a in steps if asked > 0]
        counted = [a for w, a in drafted if a is not None]
        assert all(a > 0 for a in counted)  # the drafter's chain is accepted wherever it counts
        if marginal:
            assert all((a is None) == (w > 0) for w, a in drafted)
            assert 0 < len(counted) < len(drafted)  # both kinds of step happened
        else:
            assert len(counted) == len(drafted)
        assert policy.tried.get(1, 0.0) == len(counted)  # acceptance counted on those steps only
        assert policy.full_depth == 3 and policy.nodes  # the draft's size learned on every drafted step


def test_a_trained_first_token_is_continued_by_the_suffix_drafter_in_the_same_tree(tiny_llama):
    """The suffix drafter's corpus holds the second half of the target's answer, but not the token before it: at the
    half it has no match. A drafter that knows only the next token lets the suffix drafter continue that token in the
    same tree (a spliced branch), so the half is crossed in one step, not two; the continuation learns from what was
    accepted; the output is the target's either way."""
    model, _ = tiny_llama
    steep, prompt, own = half_known_answer(model)
    answer = own[len(prompt):]
    corpus = SuffixArray.build([answer[24:]])
    steps, spliced = {}, []
    for splice in (False, True):
        policy = AdaptiveDepth(steep, measure_draft=False, explore_every=1000)
        suffix = suffix_drafter(model, corpus=corpus, max_nodes=8, cost_curve=steep, remember=0)
        drafter = HybridDrafter(OracleDrafter(answer, depth=1), suffix, max_nodes=16, marginal=True, splice=splice)
        made, record, plans = [], suffix.record, drafter.spliced
        drafter.spliced = lambda *a: (lambda out: made.append(out and out[2]) or out)(plans(*a))
        suffix.record = lambda plan, accepted: (spliced.append(accepted) if any(plan is p for p in made) else
                                                None) or record(plan, accepted)
        res = SpeculativeDecoder(model, drafter, eos_token_ids=[], depth_policy=policy).generate(prompt,
                                                                                                 max_new_tokens=40)
        assert res.tokens == answer[:40]
        steps[splice] = res.stats.steps
    assert max(spliced) >= 2  # a continuation of the known token was accepted beyond it
    assert steps[True] < steps[False]


class RandomChainDrafter(DrafterBase):
    """Drafts one random token a step: right now and then, and seldom what the suffix drafter has first."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    @property
    def max_draft_depth(self) -> int:
        return 1

    def propose(self, state, max_depth: int) -> Draft:
        tokens = torch.tensor([state.next_token, self.rng.randrange(self.vocab)])
        return Draft(tokens=tokens, tree=Tree.from_parents([-1, 0]))


def test_sampled_tokens_with_spliced_branches_follow_the_target_distribution():
    """Sampling stays lossless with spliced branches in the tree, and they are accepted: a drafter of random tokens,
    the suffix drafter keeping one node of its own (so the random token is seldom among its nodes) with a corpus of
    the target's own samples. Four tokens are decoded, so that the first step has room for a continuation; the
    first three are counted."""
    from test_engine import SAMPLING, small_vocab_target
    from test_suffix import own_samples_corpus
    from test_verify import chi_square_pvalue

    model = small_vocab_target()
    exact, corpus = own_samples_corpus(model)
    suffix = suffix_drafter(model, corpus=corpus, max_nodes=1, cost_curve=FLAT, remember=0)
    drafter = HybridDrafter(RandomChainDrafter(model.config.vocab_size), suffix, max_nodes=12, marginal=True,
                            splice=True)
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=[],
                                 depth_policy=AdaptiveDepth(FLAT, measure_draft=False))
    made, record, plans = [], suffix.record, drafter.spliced
    drafter.spliced = lambda *a: (lambda out: made.append(out and out[2]) or out)(plans(*a))
    continued = []
    suffix.record = lambda plan, accepted: (continued.append(accepted) if any(plan is p for p in made) else
                                            None) or record(plan, accepted)
    v = model.config.vocab_size
    counts = torch.zeros(v ** 3)
    for seed in range(1500):
        a, b, c = decoder.generate(torch.tensor([3, 5, 7, 1]), max_new_tokens=4, sampling=SAMPLING,
                                   seed=seed).tokens[:3]
        counts[(a * v + b) * v + c] += 1
    assert sum(x is not None for x in made) > 300 and sum(x > 0 for x in continued) > 25
    assert 0.5 * (counts / counts.sum() - exact).abs().sum() < 0.1
    assert chi_square_pvalue(counts, exact) > 1e-3

