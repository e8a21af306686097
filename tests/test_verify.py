"""Acceptance rules on given distributions: greedy picks the right branch; speculative sampling over siblings and down
a tree emits exactly the target's distribution (many vectorised draws, chi-square + total variation), and rules
that are subtly wrong fail the same test; typical acceptance applies its threshold; bad settings fail clearly."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from selfspec.decode.tree import Tree
from selfspec.decode.verify import (
    Sampling,
    accept_among_siblings,
    sample_tree,
    target_probs,
    typical_ok,
    verify,
    verify_greedy,
)

DRAWS = 200_000


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = max(int(keep.sum()) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def assert_same_distribution(samples: torch.Tensor, probs: torch.Tensor, tv_bound: float = 0.01):
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    tv = 0.5 * (counts / counts.sum() - probs.double()).abs().sum()
    assert tv < tv_bound, f"total variation {tv:.4f}"
    assert chi_square_pvalue(counts, probs) > 1e-4


def assert_different_distribution(samples: torch.Tensor, probs: torch.Tensor):
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert chi_square_pvalue(counts, probs) < 1e-6


def make_p(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g) * 1.5).softmax(-1)


# --- the target's distribution --------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.8, 8, 0.6)])
def test_target_probs_match_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    scores = logits.clone()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)
    assert torch.allclose(target_probs(logits, temperature, top_k, top_p), expected, atol=1e-6)


# --- greedy ---------------------------------------------------------------------------------------------------------


def test_greedy_keeps_the_deepest_argmax_branch():
    # root -> [a=1, b=2]; a -> [c=3]; b -> [d=4, e=5]; e -> [f=6]
    tree = Tree.from_parents([-1, 0, 0, 1, 2, 2, 5])
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 6])
    vocab = 8

    def logits_for(best_after):  # best_after[node] = the target's argmax after that node
        out = torch.zeros(len(best_after), vocab)
        out[torch.arange(len(best_after)), torch.tensor(best_after)] = 5.0
        return out

    v = verify_greedy(logits_for([2, 3, 5, 0, 0, 6, 7]), tokens, tree)  # root->b, b->e, e->f, then 7
    assert v.path == [0, 2, 5, 6] and v.next_token == 7
    v = verify_greedy(logits_for([1, 4, 0, 0, 0, 0, 0]), tokens, tree)  # root->a, but a's child is 3, target says 4
    assert v.path == [0, 1] and v.next_token == 4
    v = verify_greedy(logits_for([7, 3, 5, 0, 0, 6, 7]), tokens, tree)  # first token already rejected
    assert v.path == [0] and v.next_token == 7
    assert verify(logits_for([7, 3, 5, 0, 0, 6, 7]), tokens, tree, Sampling()).path == [0]


# --- lossless sampling among siblings -------------------------------------------------------------------------------


def emit_one_level(p, tokens, q=None, seed=0, rule=accept_among_siblings):
    """Emit one token per draw: an accepted child's token, or a sample from what is left of p."""
    g = torch.Generator().manual_seed(seed)
    b, c = tokens.shape
    slot, residual = rule(p.expand(b, -1), tokens, torch.ones(b, c, dtype=torch.bool), torch.rand(b, c, generator=g), q)
    fallback = torch.multinomial(residual, 1, generator=g)[:, 0]
    picked = tokens.gather(1, slot.clamp(min=0)[:, None])[:, 0]
    return torch.where(slot >= 0, picked, fallback)


def test_siblings_with_deterministic_drafts_emit_the_target_distribution():
    p = make_p(10, seed=0)
    p[7] = 0.0  # a drafted token the target never emits
    p = p / p.sum()
    tokens = torch.tensor([[int(p.argmax()), 7, 3]]).expand(DRAWS, -1)  # top-1, an impossible token, another
    assert_same_distribution(emit_one_level(p, tokens), p)
    # Child j is accepted with probability p(x_j), by the one-draw form and by the general loop with one-hot q.
    one_hot = torch.nn.functional.one_hot(tokens[:1], 10).float().expand(DRAWS, -1, -1)
    for q in (None, one_hot):
        u = torch.rand(DRAWS, 3, generator=torch.Generator().manual_seed(5))
        slot, _ = accept_among_siblings(p.expand(DRAWS, -1), tokens, torch.ones(DRAWS, 3, dtype=torch.bool), u, q)
        rates = torch.stack([(slot == j).double().mean() for j in range(3)])
        assert torch.allclose(rates, p[tokens[0]].double(), atol=0.005)


def test_siblings_with_sampled_drafts_emit_the_target_distribution():
    p, q = make_p(10, seed=1), make_p(10, seed=2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.multinomial(q.expand(DRAWS, -1), 3, replacement=True, generator=g)  # 3 i.i.d. draft samples
    qs = q.expand(DRAWS, 3, -1)
    assert_same_distribution(emit_one_level(p, tokens, qs), p)


def accept_always(p, tokens, valid, uniforms, q=None):
    return torch.zeros(tokens.shape[0], dtype=torch.long), p


def no_residual(p, tokens, valid, uniforms, q=None):
    """Wrong: accepts with the right probability but samples the fallback from p instead of the residual."""
    slot, _ = accept_among_siblings(p, tokens, valid, uniforms, q)
    return slot, p


@pytest.mark.parametrize("wrong_rule", [accept_always, no_residual])
def test_wrong_sibling_rules_fail_the_same_test(wrong_rule):
    p = make_p(10, seed=0)
    tokens = torch.tensor([[int(p.argmax()), 3, 5]]).expand(DRAWS, -1)
    assert_different_distribution(emit_one_level(p, tokens, rule=wrong_rule), p)


# --- lossless sampling down a tree ----------------------------------------------------------------------------------

VOCAB = 8


def two_level_problem(seed: int = 0):
    """A tree with several siblings per level and the target's conditionals P1(x1), P2(x2 | x1), P3(x3 | x2)."""
    g = torch.Generator().manual_seed(seed)
    p1 = (torch.randn(VOCAB, generator=g) * 1.5).softmax(-1)
    p2 = (torch.randn(VOCAB, VOCAB, generator=g) * 1.5).softmax(-1)  # [x1, x2]
    p3 = (torch.randn(VOCAB, VOCAB, generator=g) * 1.5).softmax(-1)  # [x2, x3]
    top1 = p1.argsort(descending=True)
    # root -> three children (two likely first tokens and a random one), each with two or three children
    d1 = [int(top1[0]), int(top1[1]), int(top1[5])]
    parents, tokens = [-1], [0]
    for t in d1:
        parents.append(0)
        tokens.append(t)
    for i, t in enumerate(d1, start=1):
        for x2 in p2[t].argsort(descending=True)[: 3 if i == 1 else 2].tolist():
            parents.append(i)
            tokens.append(x2)
    tree = Tree.from_parents(parents)
    tokens = torch.tensor(tokens)
    probs = torch.stack([p1] + [p2[t] if tree.depth[i] == 1 else p3[t] for i, t in enumerate(tokens.tolist()) if i])
    return tree, tokens, probs, p1, p2


def first_two_tokens(tree, tokens, probs, p2, seed=0, walk=sample_tree, draft_probs=None):
    g = torch.Generator().manual_seed(seed)
    path, nxt = walk(probs, tokens, tree, draft_probs, g, DRAWS)
    n_acc = (path >= 0).sum(1) - 1  # drafted tokens accepted per draw
    first = torch.where(n_acc >= 1, tokens[path[:, 1].clamp(min=0)], nxt)
    second_from_tree = torch.where(n_acc >= 2, tokens[path[:, 2].clamp(min=0)], nxt)
    # A draw that emitted one token continues from the target itself (what the next step of a lossless engine does).
    second_fresh = torch.multinomial(p2[first], 1, generator=g)[:, 0]
    second = torch.where(n_acc >= 1, second_from_tree, second_fresh)
    return first * VOCAB + second


def test_tree_walk_emits_the_target_joint_distribution():
    tree, tokens, probs, p1, p2 = two_level_problem()
    joint = (p1[:, None] * p2).reshape(-1)
    pairs = first_two_tokens(tree, tokens, probs, p2)
    assert_same_distribution(pairs, joint, tv_bound=0.015)


def test_tree_walk_with_explicit_draft_probs_emits_the_target_joint_distribution():
    tree, tokens, probs, p1, p2 = two_level_problem(seed=1)
    # Deterministic drafts written out as explicit point-mass distributions take the general p/q ratio path.
    q = torch.nn.functional.one_hot(tokens, VOCAB).float()
    pairs = first_two_tokens(tree, tokens, probs, p2, draft_probs=q)
    joint = (p1[:, None] * p2).reshape(-1)
    assert_same_distribution(pairs, joint, tv_bound=0.015)


def accept_first_branch(probs, tokens, tree, draft_probs, generator, num_draws):
    """Wrong: always accepts the first child at every level, then samples the bonus from the target."""
    path = torch.full((num_draws, tree.max_depth + 1), -1)
    node = 0
    for level in range(tree.max_depth + 1):
        path[:, level] = node
        kids = tree.children[node]
        if kids[0] < 0:
            break
        node = int(kids[0])
    nxt = torch.multinomial(probs[node].expand(num_draws, -1), 1, generator=generator)[:, 0]
    return path, nxt


def test_wrong_tree_rule_fails_the_same_test():
    tree, tokens, probs, p1, p2 = two_level_problem()
    joint = (p1[:, None] * p2).reshape(-1)
    assert_different_distribution(first_two_tokens(tree, tokens, probs, p2, walk=accept_first_branch), joint)


def test_verify_sample_returns_a_branch():
    tree, tokens, probs, p1, p2 = two_level_problem()
    v = verify(probs.log(), tokens, tree, Sampling(acceptance="sample"), generator=torch.Generator().manual_seed(0))
    assert v.path[0] == 0 and all(int(tree.parents[b]) == a for a, b in zip(v.path, v.path[1:]))
    assert 0 <= v.next_token < VOCAB


# --- typical acceptance (lossy) -------------------------------------------------------------------------------------


def test_typical_acceptance_threshold():
    # root -> [1, 2]; the target at the root is confident in token 1 (low entropy)
    tree = Tree.from_parents([-1, 0, 0])
    tokens = torch.tensor([0, 1, 2])
    probs = torch.tensor([[0.0, 0.95, 0.05, 0.0], [0.25] * 4, [0.25] * 4])
    ok = typical_ok(probs, tokens, tree, threshold=0.09, alpha=0.3)
    assert ok.tolist() == [True, True, False]
    # A flat target (high entropy) lowers the bar below the fixed threshold: 0.2 > 0.3 * exp(-H) ~ 0.075
    flat = torch.tensor([[0.2, 0.2, 0.2, 0.4], [0.25] * 4, [0.25] * 4])
    assert typical_ok(flat, tokens, tree, threshold=0.09, alpha=0.3).tolist() == [True, True, True]
    v = verify(probs.log(), tokens, tree, Sampling(acceptance="typical"), generator=torch.Generator().manual_seed(0))
    assert v.path == [0, 1]


def test_bad_sampling_settings_fail_clearly():
    with pytest.raises(ValueError, match="acceptance=greedy"):
        Sampling(acceptance="sample", temperature=0.0)
    with pytest.raises(ValueError, match="one of greedy, sample, typical"):
        Sampling(acceptance="beam")
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        Sampling(top_k=-1)
