"""Token trees: structure built from rank paths, the named trees, masks and position ids, and clear errors."""

from __future__ import annotations

import pytest
import torch

from selfspec.decode.tree import (
    Tree,
    TreeError,
    available_trees,
    chain_tree,
    load_tree,
    single_node_tree,
    tree_attention_mask,
    tree_position_ids,
)


def is_prefix(a: tuple, b: tuple) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


@pytest.mark.parametrize("name", ["mc_sim_7b_63", "small_16"])
def test_shipped_trees_are_consistent(name):
    tree = load_tree(name, num_heads=4)
    paths = [()] + list(tree.rank_paths)
    n = len(paths)
    assert tree.num_nodes == n and tree.max_depth == 4
    if name == "mc_sim_7b_63":
        assert n == 64
    # Nodes are ordered by (depth, path): depth never decreases, siblings come in rank order.
    assert tree.depth.tolist() == [len(p) for p in paths]
    assert list(tree.rank_paths) == sorted(tree.rank_paths, key=lambda p: (len(p), p))
    for i in range(1, n):
        assert paths[int(tree.parents[i])] == paths[i][:-1]
    expected = torch.tensor([[is_prefix(paths[j], paths[i]) for j in range(n)] for i in range(n)])
    assert torch.equal(tree.ancestor_mask, expected)
    for i in range(n):
        kids = [c for c in tree.children[i].tolist() if c >= 0]
        assert kids == [j for j in range(n) if tree.parents[j] == i]
        assert [paths[c][-1] for c in kids] == sorted(paths[c][-1] for c in kids)
    # Leaf paths: one row per leaf, each a root-to-leaf chain of parents.
    leaves = [i for i in range(n) if not (tree.parents == i).any()]
    assert sorted(int(r[r >= 0][-1]) for r in tree.leaf_paths) == leaves
    for row in tree.leaf_paths:
        ids = row[row >= 0].tolist()
        assert ids[0] == 0 and all(int(tree.parents[b]) == a for a, b in zip(ids, ids[1:]))


def test_candidate_index_reads_head_and_rank():
    tree = Tree.from_paths([[0], [2], [0, 1], [2, 0], [0, 1, 3]])
    top_k = tree.max_rank + 1
    assert top_k == 4
    expected = [(len(p) - 1) * top_k + p[-1] for p in tree.rank_paths]
    assert tree.candidate_index(top_k).tolist() == expected
    assert tree.rank_paths == ((0,), (2,), (0, 1), (2, 0), (0, 1, 3))


def test_chain_and_single():
    chain = chain_tree(3)
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(chain.ancestor_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert load_tree("chain", num_heads=5).max_depth == 5
    assert load_tree("chain-2").max_depth == 2
    single = single_node_tree()
    assert single.num_nodes == 1 and single.max_depth == 0 and single.children.tolist() == [[-1]]
    assert load_tree("single").num_nodes == 1


def test_truncate_is_a_prefix_of_a_static_tree():
    tree = load_tree("mc_sim_7b_63")
    for depth in range(0, 5):
        cut = tree.truncate(depth)
        kept = [p for p in tree.rank_paths if len(p) <= depth]
        assert cut.rank_paths == tuple(kept)
        n = cut.num_nodes
        assert torch.equal(cut.parents, tree.parents[:n]) and torch.equal(cut.ancestor_mask, tree.ancestor_mask[:n, :n])


def test_dynamic_tree_from_parents_keeps_sibling_order():
    tree = Tree.from_parents([-1, 0, 0, 1, 0, 3])
    assert tree.depth.tolist() == [0, 1, 1, 2, 1, 3]
    assert [c for c in tree.children[0].tolist() if c >= 0] == [1, 2, 4]
    cut = tree.truncate(1)
    assert cut.parents.tolist() == [-1, 0, 0, 0]


def test_mask_and_positions():
    tree = Tree.from_paths([[0], [1], [0, 0]])  # nodes: root, [0], [1], [0, 0]
    mask = tree_attention_mask(tree, past_length=5, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 9) and mask.dtype == torch.float32
    assert (mask[0, 0, :, :5] == 0).all()  # everyone sees the whole cache
    allowed = mask[0, 0, :, 5:] == 0
    assert allowed.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    assert (mask[0, 0, :, 5:][~allowed] == torch.finfo(torch.float32).min).all()
    assert tree_position_ids(tree, 5).tolist() == [[5, 6, 6, 7]]


def test_tree_file_roundtrip(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("paths:\n  - [0]\n  - [1]\n  - [0, 0]\n")
    tree = load_tree(str(path), num_heads=2)
    assert tree.rank_paths == ((0,), (1,), (0, 0))
    (tmp_path / "bad.yaml").write_text("nodes: [[0]]\n")
    with pytest.raises(TreeError, match="paths"):
        load_tree(str(tmp_path / "bad.yaml"))


def test_bad_trees_fail_clearly():
    with pytest.raises(TreeError, match="4 heads"):
        load_tree("chain-5", num_heads=4)
    with pytest.raises(TreeError, match="2 heads"):
        load_tree("mc_sim_7b_63", num_heads=2)
    with pytest.raises(TreeError, match=r"no parent path \[0\]"):
        Tree.from_paths([[1], [0, 1]])
    with pytest.raises(TreeError, match="twice"):
        Tree.from_paths([[0], [0]])
    with pytest.raises(TreeError, match="negative"):
        Tree.from_paths([[-1]])
    with pytest.raises(TreeError, match="earlier node"):
        Tree.from_parents([-1, 2, 0])
    with pytest.raises(TreeError, match="Unknown tree"):
        load_tree("no_such_tree")
    with pytest.raises(TreeError, match="chain-K"):
        load_tree("chain")
    assert "mc_sim_7b_63" in available_trees()
