"""Token trees: the layout one verify forward runs over.

A tree has N nodes. Node 0 is the root: the last emitted token, not yet in the KV cache (the target picked it at the
previous step). Every other node is a drafted token whose parent is an earlier node (``parents[i] < i``), so node
order is a topological order and a node's ancestors are earlier nodes. A chain of k drafted tokens is a tree with one
branch; the root alone is a plain autoregressive step.

Static trees (Medusa) are written as rank paths: ``[0, 2]`` is the node reached by head 0's top-1 token, then head 1's
top-3 token. They are data (``conf/trees/*.yaml``), loaded by name or file with :func:`load_tree`. Dynamic trees
(EAGLE) build a :class:`Tree` from a parents list at every step with :meth:`Tree.from_parents`.

Everything a verify forward needs is built once per tree: the ancestor mask (turned into an additive 4D attention
mask by :func:`tree_attention_mask`), depths (position ids), each node's ordered children (for verification) and
the root-to-leaf paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import yaml

from selfspec.core.config import CONF_DIR
from selfspec.core.errors import SelfspecError
from selfspec.core.archs import attention_mask_for
from selfspec.core.kv import additive_mask

TREES_DIR = CONF_DIR / "trees"


class TreeError(SelfspecError, ValueError):
    """A tree is malformed or does not fit the drafter; the message says what to change."""


@dataclass(frozen=True, eq=False)
class Tree:
    """Structure of a token tree (no tokens). All tensors live on one device."""

    parents: torch.Tensor  # [N] long, -1 for the root
    depth: torch.Tensor  # [N] long, 0 for the root
    ancestor_mask: torch.Tensor  # [N, N] bool: [i, j] is True when j is i or an ancestor of i
    children: torch.Tensor  # [N, C] long: children of each node in proposal order, -1 padded (C >= 1)
    leaf_paths: torch.Tensor  # [L, max_depth + 1] long: node ids root -> leaf, -1 padded
    rank_paths: tuple[tuple[int, ...], ...] | None = None  # static trees: node i >= 1 is rank_paths[i - 1]

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]

    @property
    def max_depth(self) -> int:
        return int(self.leaf_paths.shape[1]) - 1

    @property
    def device(self) -> torch.device:
        return self.parents.device

    @classmethod
    def from_parents(cls, parents: Sequence[int], rank_paths: Sequence[Sequence[int]] | None = None) -> "Tree":
        """Build a tree from ``parents`` (parents[0] == -1, 0 <= parents[i] < i for i >= 1).

        Children keep the order in which they appear in ``parents``: for sampling, earlier siblings are tried first.
        """
        parents = [int(p) for p in parents]
        if not parents or parents[0] != -1:
            raise TreeError("A tree needs a root: parents[0] must be -1 (node 0 is the last emitted token).")
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise TreeError(f"Node {i} has parent {p}; every parent must be an earlier node (0 <= parent < {i}).")
        n = len(parents)
        depth = [0] * n
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(n):
            ancestors[i, i] = True
            if i:
                depth[i] = depth[parents[i]] + 1
                ancestors[i] |= ancestors[parents[i]]
                kids[parents[i]].append(i)
        width = max(1, max(len(k) for k in kids))
        children = torch.full((n, width), -1, dtype=torch.long)
        for i, k in enumerate(kids):
            children[i, : len(k)] = torch.tensor(k, dtype=torch.long)
        leaves = [i for i in range(n) if not kids[i]]
        max_depth = max(depth)
        leaf_paths = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            path = ancestors[leaf].nonzero()[:, 0]  # ascending index == ascending depth
            leaf_paths[row, : len(path)] = path
        return cls(
            parents=torch.tensor(parents, dtype=torch.long),
            depth=torch.tensor(depth, dtype=torch.long),
            ancestor_mask=ancestors,
            children=children,
            leaf_paths=leaf_paths,
            rank_paths=tuple(tuple(int(r) for r in p) for p in rank_paths) if rank_paths is not None else None,
        )

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "Tree":
        """A static tree from rank paths (the root is implicit). Nodes are ordered by (depth, path).

        Ordering by depth makes every depth-truncated tree a prefix of the node list (see :meth:`truncate`), and
        ordering by path makes siblings come in rank order.
        """
        cleaned = []
        for p in paths:
            path = tuple(int(r) for r in p)
            if not path:
                raise TreeError("An empty rank path is the root, which every tree has implicitly; remove it.")
            if any(r < 0 for r in path):
                raise TreeError(f"Rank path {list(path)} has a negative rank; ranks count from 0 (top-1).")
            cleaned.append(path)
        if len(set(cleaned)) != len(cleaned):
            dupes = sorted({p for p in cleaned if cleaned.count(p) > 1})
            raise TreeError(f"Rank paths appear twice: {[list(p) for p in dupes]}.")
        ordered = sorted(cleaned, key=lambda p: (len(p), p))
        index = {p: i + 1 for i, p in enumerate(ordered)}
        parents = [-1]
        for p in ordered:
            parent = p[:-1]
            if parent and parent not in index:
                raise TreeError(
                    f"Rank path {list(p)} has no parent path {list(parent)} in the tree; add it (every prefix of a "
                    "path must be a node)."
                )
            parents.append(index[parent] if parent else 0)
        return cls.from_parents(parents, rank_paths=ordered)

    def to(self, device: torch.device | str) -> "Tree":
        return Tree(
            parents=self.parents.to(device), depth=self.depth.to(device), ancestor_mask=self.ancestor_mask.to(device),
            children=self.children.to(device), leaf_paths=self.leaf_paths.to(device), rank_paths=self.rank_paths,
        )

    def truncate(self, max_depth: int) -> "Tree":
        """The subtree of nodes with depth <= max_depth (node ids renumbered in order)."""
        if max_depth >= self.max_depth:
            return self
        keep = (self.depth <= max(max_depth, 0)).nonzero()[:, 0].tolist()
        new_id = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [new_id[int(self.parents[i])] for i in keep[1:]]
        paths = [self.rank_paths[i - 1] for i in keep[1:]] if self.rank_paths is not None else None
        return Tree.from_parents(parents, rank_paths=paths).to(self.device)

    def candidate_index(self, top_k: int) -> torch.Tensor:
        """Static trees: for nodes 1..N-1, the index into per-head top-k candidates flattened as [heads * top_k].

        Node at depth d with last rank r reads head d-1's r-th candidate: index (d - 1) * top_k + r.  [N - 1] long.
        """
        if self.rank_paths is None:
            raise TreeError("candidate_index needs a static tree built from rank paths.")
        idx = [(len(p) - 1) * top_k + p[-1] for p in self.rank_paths]
        return torch.tensor(idx, dtype=torch.long, device=self.device)

    @property
    def max_rank(self) -> int:
        """Largest rank used by a static tree (top-k needed per head is max_rank + 1)."""
        if not self.rank_paths:
            return 0
        return max(max(p) for p in self.rank_paths)


# --- named trees ----------------------------------------------------------------------------------------------------


def chain_tree(length: int) -> Tree:
    """A chain of ``length`` drafted tokens (rank paths [0], [0, 0], ...): any drafter's top-1 continuation."""
    if length < 0:
        raise TreeError(f"A chain needs length >= 0, got {length}.")
    return Tree.from_paths([[0] * d for d in range(1, length + 1)])


def single_node_tree() -> Tree:
    """The root alone: one token per target forward (plain autoregressive decoding)."""
    return Tree.from_paths([])


def available_trees() -> list[str]:
    return sorted(p.stem for p in TREES_DIR.glob("*.yaml"))


def read_tree_file(path: str | Path) -> Tree:
    """A static tree from YAML: ``paths: [[0], [0, 0], [1], ...]`` (rank paths, root implicit)."""
    path = Path(path)
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict) or not isinstance(data.get("paths"), list):
        raise TreeError(f"{path}: a tree file needs a `paths:` list of rank paths, e.g. `paths: [[0], [0, 0], [1]]`.")
    return Tree.from_paths(data["paths"])


def load_tree(spec: "str | Path | Tree | Sequence[Sequence[int]]", num_heads: int | None = None) -> Tree:
    """Resolve a tree spec and check it fits ``num_heads`` drafting heads (depth <= num_heads).

    ``spec`` is a Tree, a list of rank paths, a YAML file path, a name in conf/trees/ (e.g. ``mc_sim_7b_63``),
    ``chain`` (one branch as deep as the heads), ``chain-K`` (K tokens), or ``single`` (the root alone).
    """
    if isinstance(spec, Tree):
        tree = spec
    elif isinstance(spec, (list, tuple)):
        tree = Tree.from_paths(spec)
    else:
        name = str(spec)
        if name == "single":
            tree = single_node_tree()
        elif name == "chain":
            if num_heads is None:
                raise TreeError("tree=chain takes its length from the drafter's heads; give chain-K for K tokens.")
            tree = chain_tree(num_heads)
        elif name.startswith("chain-") and name[6:].isdigit():
            tree = chain_tree(int(name[6:]))
        elif name.endswith((".yaml", ".yml")) or Path(name).is_file():
            if not Path(name).is_file():
                raise TreeError(f"Tree file {name} does not exist.")
            tree = read_tree_file(name)
        elif (TREES_DIR / f"{name}.yaml").is_file():
            tree = read_tree_file(TREES_DIR / f"{name}.yaml")
        else:
            raise TreeError(
                f"Unknown tree {name!r}: give a YAML file of rank paths, one of {available_trees()}, "
                "chain, chain-K or single."
            )
    if num_heads is not None and tree.max_depth > num_heads:
        raise TreeError(
            f"The tree is {tree.max_depth} levels deep but the drafter has {num_heads} heads (one head per level): "
            f"use a tree of depth <= {num_heads} (e.g. tree=chain-{num_heads}) or heads with more heads."
        )
    return tree


# --- forward inputs -------------------------------------------------------------------------------------------------


def tree_attention_mask(tree: Tree, past_length: int, dtype: torch.dtype, config=None
                        ) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive mask [1, 1, N, past_length + N]: 0 where a node may attend (the whole cache, its ancestors and
    itself), the dtype's minimum elsewhere. A float mask, not a boolean one: eager attention reads a boolean 4D mask
    wrongly, while an additive one gives the same logits under eager and sdpa. With the target's ``config``, sliding
    layers also drop keys outside their window, measured between positions (a node at depth d sits at
    past_length + d), and a target with mixed layers gets a dict of masks by layer kind (core/archs.py).
    """
    n = tree.num_nodes
    allowed = torch.ones(n, past_length + n, dtype=torch.bool, device=tree.device)  # [N, past + N]
    allowed[:, past_length:] = tree.ancestor_mask
    if config is None:
        return additive_mask(allowed, dtype)[None, None]
    keys = torch.cat([torch.arange(past_length, device=tree.device), tree.depth + past_length])
    return attention_mask_for(config, allowed, tree.depth + past_length, keys, dtype)


def tree_position_ids(tree: Tree, past_length: int) -> torch.Tensor:
    """Position ids [1, N]: a node at depth d sits at past_length + d, as it would in its own sequence."""
    return (tree.depth + past_length)[None]
