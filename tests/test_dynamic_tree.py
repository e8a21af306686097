"""EAGLE-2 dynamic trees: selection against a brute-force reference, tree invariants, and the draft's tree mask."""

from __future__ import annotations

import hashlib

import pytest
import torch

from selfspec.decode.dynamic_tree import Candidates, DraftTreeExpander, grow_dynamic_tree, select_top, topk_children

VOCAB = 7


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fake_logprobs(path: tuple[int, ...], peaked: bool = False) -> torch.Tensor:
    """A deterministic draft distribution [VOCAB] after ``path`` (random-looking, different for every path)."""
    seed = int(hashlib.sha256(repr(path).encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=g) * 2
    if peaked:  # one token certain: zero-cost children tie with their parent
        logits = torch.full((VOCAB,), -1e4)
        logits[seed % VOCAB] = 0.0
    return torch.log_softmax(logits, -1)


def fake_expand(peaked=False, calls=None):
    def expand(frontier: list[int], cands: Candidates):
        if calls is not None:
            calls.append(len(frontier))
        rows = [fake_logprobs(tuple(cands.tokens[a] for a in cands.ancestors(u)), peaked) for u in frontier]
        return topk_children(torch.stack(rows), VOCAB)

    return expand


def reference_tree(depth: int, top_k: int, total: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2 by brute force over token paths: kept path -> cumulative log-prob."""
    def children(path, score):
        lp = fake_logprobs(path)
        order = sorted(range(VOCAB), key=lambda t: -float(lp[t]))[:top_k]
        return [(path + (t,), score + float(lp[t])) for t in order]

    level = children((), 0.0)
    every = list(level)
    for _ in range(2, depth + 1):
        frontier = sorted(level, key=lambda c: -c[1])[:top_k]
        level = [c for path, score in frontier for c in children(path, score)]
        every += level
    return dict(sorted(every, key=lambda c: -c[1])[:total])


def grow(depth, top_k, total, peaked=False, calls=None):
    return grow_dynamic_tree(
        root_token=5, root_children=topk_children(fake_logprobs((), peaked), VOCAB),
        expand=fake_expand(peaked, calls), depth=depth, top_k=top_k, total_tokens=total,
    )


def paths_of(tree) -> dict[tuple[int, ...], float]:
    out = {}
    for i in range(1, len(tree.parents)):
        path, node = [], i
        while node > 0:
            path.append(int(tree.tokens[node]))
            node = tree.parents[node]
        out[tuple(path[::-1])] = float(tree.scores[i])
    return out


@pytest.mark.parametrize("depth,top_k,total", [(1, 3, 2), (2, 1, 2), (3, 2, 6), (4, 3, 10), (5, 4, 30), (3, 7, 100)])
def test_selection_matches_brute_force(depth, top_k, total):
    calls = []
    tree = grow(depth, top_k, total, calls=calls)
    expected = reference_tree(depth, top_k, total)
    got = paths_of(tree)
    assert set(got) == set(expected)
    for path, score in expected.items():
        assert got[path] == pytest.approx(score, abs=1e-5)
    assert calls == [min(top_k, VOCAB)] * (depth - 1)  # one draft call per level, on at most top_k nodes


@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("depth,top_k,total", [(2, 1, 2), (2, 2, 3), (4, 3, 12), (6, 4, 40)])
def test_tree_invariants(depth, top_k, total, peaked):
    tree = grow(depth, top_k, total, peaked=peaked)
    n_candidates = top_k + (depth - 1) * top_k * top_k
    assert len(tree.parents) == min(total, n_candidates) + 1  # the root plus total_tokens nodes
    assert tree.parents[0] == -1 and tree.depths[0] == 0 and int(tree.tokens[0]) == 5
    kept = set(tree.candidate_ids)
    for i in range(1, len(tree.parents)):
        p = tree.parents[i]
        assert 0 <= p < i  # closed under parent, parents first
        assert tree.depths[i] == tree.depths[p] + 1
        assert float(tree.scores[i]) <= float(tree.scores[p]) + 1e-6  # a branch only loses probability
    # Kept nodes are the best-scored candidates: nothing dropped beats anything kept.
    all_scores = _all_candidate_scores(depth, top_k, peaked)
    dropped = [s for c, s in enumerate(all_scores) if c not in kept]
    if dropped:
        assert min(float(s) for s in tree.scores[1:]) >= max(dropped) - 1e-6
    # Siblings come in descending score (the verifier tries earlier siblings first).
    t = tree.tree()
    for row in t.children.tolist():
        kids = [k for k in row if k >= 0]
        assert [float(tree.scores[k]) for k in kids] == sorted((float(tree.scores[k]) for k in kids), reverse=True)
    assert t.max_depth <= depth


def _all_candidate_scores(depth, top_k, peaked):
    """Every candidate's score, by candidate id (a budget larger than the candidate count keeps them all)."""
    tree = grow_dynamic_tree(5, topk_children(fake_logprobs((), peaked), VOCAB), fake_expand(peaked), depth, top_k,
                             10_000)
    return [float(s) for s in tree.scores[1:]]


def test_degenerate_sizes():
    assert len(grow(0, 3, 10).parents) == 1  # depth 0: the root alone
    assert len(grow(3, 3, 0).parents) == 1
    with pytest.raises(ValueError, match="top_k"):
        grow(2, 0, 5)


def test_select_top_is_stable():
    scores = torch.tensor([0.0, -1.0, 0.0, -1.0, 0.0])
    assert select_top(scores, 4).tolist() == [0, 2, 4, 1]


def _plain_branch_feature(drafter, feats, next_tokens, root_feature, branch_tokens):
    """The draft run as a plain sequence: committed prefix, then each branch token reading the previous feature."""
    from transformers import DynamicCache

    cache = DynamicCache()
    past = feats.shape[1]
    device = feats.device
    drafter(feats, next_tokens, torch.arange(past, device=device)[None], None, cache)
    feature = root_feature
    for depth, token in enumerate(branch_tokens, start=1):
        pos = torch.tensor([[past + depth - 1]], device=device)
        feature = drafter(feature[None, None], torch.tensor([[token]], device=device), pos, None, cache)[0, 0]
    return feature


@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_draft_tree_mask_matches_plain_forward_per_branch(tiny_llama, variant):
    """Every node's draft feature under the tree mask equals the draft run plainly over that node's own branch."""
    from transformers import DynamicCache

    from selfspec.heads.eagle import EagleConfig, EagleHeads
    from selfspec.core.kv import crop_cache

    model, _ = tiny_llama
    device = model.device
    config = EagleConfig.from_target(model, variant=variant, draft_vocab_size=200)
    drafter = EagleHeads(config, model).to(device).eval()
    prompt = torch.tensor([[7, 40, 41, 42, 99, 100]], device=device)
    next_tokens = torch.tensor([[40, 41, 42, 99, 100, 13]], device=device)  # token t+1 for t = 0..5; 13: the root
    past = prompt.shape[1]
    seen = {}

    with torch.no_grad():
        feats = drafter.target_features(model(prompt, output_hidden_states=True).hidden_states)  # [1, 6, H]
        cache = DynamicCache()
        root_feature = drafter(feats, next_tokens, torch.arange(past, device=device)[None], None, cache)[0, -1]
        expander = DraftTreeExpander(drafter, cache, past, root_feature, top_k=3)

        def expand(frontier, cands):
            seen["cands"] = cands
            return expander(frontier, cands)

        children = topk_children(torch.log_softmax(drafter.logits(root_feature), -1), 3, drafter.draft_to_target)
        grow_dynamic_tree(13, children, expand, depth=4, top_k=3, total_tokens=12)
        assert cache.get_seq_length() == past + 3 * 3  # three expanded levels of three nodes each
        cands = seen["cands"]
        for node, feature in expander.feature.items():
            branch = [cands.tokens[a] for a in cands.ancestors(node)]
            plain = _plain_branch_feature(drafter, feats, next_tokens, root_feature, branch)
            torch.testing.assert_close(feature, plain, atol=1e-5, rtol=1e-4)
        assert len(expander.feature) == 9
        crop_cache(cache, past)
        assert cache.get_seq_length() == past
