"""EAGLE-2 dynamic draft trees: grown by the draft's confidence, not fixed in advance.

The tree's root is the last emitted token. Growing (:func:`grow_dynamic_tree`):

1. the root's top-k children are the depth-1 candidates, scored by their draft log-probability;
2. for each further level, the k best candidates of the last level (by cumulative log-probability, the score of the
   whole branch) form the frontier; the draft is run once on the whole frontier and each frontier node's top-k
   children become candidates with score = parent score + log q(child);
3. after ``depth`` levels the ``total_tokens`` best candidates are kept (plus the root).

Scores only fall along a branch (log q <= 0), so the kept set is closed under parents; ties are broken by creation
order (a stable sort, parents are created before their children), which keeps it closed even with zero-cost steps.
Kept nodes are output in creation order, which puts parents before children and each node's children in descending
score, so the engine's sibling order is the draft's preference order.

The draft itself is reached only through an ``expand`` callback (frontier ids -> top-k children), so the selection
logic is a small pure function tested against a brute-force reference. :class:`DraftTreeExpander` is the callback
for an :class:`selfspec.heads.eagle.EagleHeads`: it appends the frontier's entries to the draft's own KV cache and lets each
node attend to the committed prefix, its tree ancestors and itself (an additive 4D mask), at position
``past_length + depth - 1`` (a depth-d node reads the feature its parent predicted for position past + d - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from selfspec.decode.tree import Tree
from selfspec.core.kv import additive_mask


@dataclass
class Candidates:
    """Every node generated while growing (the root is implicit, id -1). Parents come before children."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # candidate id of the parent, -1 for the root
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability of the branch

    def add(self, tokens: list[int], parents: list[int], depths: list[int], scores: list[float]) -> list[int]:
        start = len(self.tokens)
        self.tokens += tokens
        self.parents += parents
        self.depths += depths
        self.scores += scores
        return list(range(start, len(self.tokens)))

    def ancestors(self, node: int) -> list[int]:
        """Candidate ids from node's depth-1 ancestor down to node itself."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


# frontier ids [f] and the candidates -> (log-probs [f, k] descending, tokens [f, k]) of each frontier node's children
ExpandFn = Callable[[list[int], Candidates], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DynamicTree:
    """A grown and pruned tree: node 0 is the root; the others are kept candidates in creation order."""

    tokens: torch.Tensor  # [N] long, tokens[0] = root token
    parents: list[int]  # [N] node ids, -1 for the root, parents[i] < i
    depths: list[int]  # [N], 0 for the root
    scores: torch.Tensor  # [N] float, cumulative draft log-probability (0 for the root)
    candidate_ids: list[int]  # [N - 1] which candidate each non-root node is

    def tree(self) -> Tree:
        return Tree.from_parents(self.parents)


def topk_children(logprobs: torch.Tensor, k: int, id_map: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """logprobs [..., V'] -> (top-k log-probs [..., k] descending, token ids [..., k]) with ids mapped by id_map."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return values, (id_map(ids) if id_map is not None else ids)


def select_top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` highest scores; ties go to lower indices (stable). Returned in score order."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:count]


def dynamic_tree_nodes(depth: int, top_k: int, total_tokens: int) -> int:
    """Nodes (the root included) of a tree :func:`grow_dynamic_tree` grows to ``depth`` when every expansion has
    ``top_k`` children: ``top_k`` at the first level, ``top_k`` children of each of ``top_k`` nodes at every level
    after it, the best ``total_tokens`` of them kept."""
    grown = top_k + (depth - 1) * top_k * top_k if depth > 0 else 0
    return 1 + min(total_tokens, grown)


def grow_dynamic_tree(
    root_token: int,
    root_children: tuple[torch.Tensor, torch.Tensor],
    expand: ExpandFn,
    depth: int,
    top_k: int,
    total_tokens: int,
) -> DynamicTree:
    """EAGLE-2 growing and pruning. ``root_children``: (log-probs [k'], tokens [k']) of the root's top children,
    descending (k' >= top_k is cut to top_k). Runs ``expand`` depth - 1 times, on at most top_k nodes each."""
    if depth < 0 or top_k < 1 or total_tokens < 0:
        raise ValueError(
            f"dynamic tree needs depth >= 0, top_k >= 1, total_tokens >= 0 (got {depth}, {top_k}, {total_tokens})"
        )
    cands = Candidates()
    if depth > 0 and total_tokens > 0:
        logp, toks = root_children
        logp, toks = logp[:top_k].float().cpu(), toks[:top_k].cpu()
        level = cands.add(toks.tolist(), [-1] * len(toks), [1] * len(toks), logp.tolist())
        for d in range(2, depth + 1):
            level_scores = torch.tensor([cands.scores[i] for i in level])
            frontier = [level[i] for i in sorted(select_top(level_scores, top_k).tolist())]
            logp, toks = expand(frontier, cands)  # [f, k], [f, k]
            logp, toks = logp[:, :top_k].float().cpu(), toks[:, :top_k].cpu()
            base = torch.tensor([cands.scores[i] for i in frontier])[:, None]  # [f, 1]
            f, k = toks.shape
            level = cands.add(
                toks.reshape(-1).tolist(),
                [p for p in frontier for _ in range(k)],
                [d] * (f * k),
                (base + logp).reshape(-1).tolist(),
            )
    scores = torch.tensor(cands.scores, dtype=torch.float32)
    kept = sorted(select_top(scores, total_tokens).tolist()) if len(scores) else []
    node_of = {c: i + 1 for i, c in enumerate(kept)}
    parents = [-1] + [node_of[cands.parents[c]] if cands.parents[c] >= 0 else 0 for c in kept]
    depths = [0] + [cands.depths[c] for c in kept]
    return DynamicTree(
        tokens=torch.tensor([root_token] + [cands.tokens[c] for c in kept], dtype=torch.long),
        parents=parents,
        depths=depths,
        scores=torch.cat([torch.zeros(1), scores[kept]]) if kept else torch.zeros(1),
        candidate_ids=kept,
    )


# --- the draft's side: tree expansion over its own KV cache ---------------------------------------------------------


class DraftTreeExpander:
    """``expand`` for an EagleHeads: runs a frontier through the draft layer under a tree mask.

    ``cache`` holds ``past_length`` committed entries (entry i read the target's feature of position i and token
    i + 1); ``root_feature`` [H] is the draft's predicted feature for position ``past_length``, which every depth-1
    node reads. Entries appended here are the caller's to crop (to ``past_length``) once the tree is grown.
    """

    def __init__(self, drafter, cache, past_length: int, root_feature: torch.Tensor, top_k: int):
        self.drafter = drafter
        self.cache = cache
        self.past_length = past_length
        self.root_feature = root_feature
        self.top_k = top_k
        self.slot: dict[int, int] = {}  # candidate id -> index of its entry after the committed ones
        self.feature: dict[int, torch.Tensor] = {}  # candidate id -> its output feature [H]

    def __call__(self, frontier: list[int], cands: Candidates) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.root_feature.device
        dtype = self.drafter.dtype
        f = len(frontier)
        entries = len(self.slot)
        inputs = torch.stack(
            [self.root_feature if cands.parents[u] < 0 else self.feature[cands.parents[u]] for u in frontier]
        )  # [f, H]
        tokens = torch.tensor([cands.tokens[u] for u in frontier], device=device)  # [f]
        positions = torch.tensor([self.past_length + cands.depths[u] - 1 for u in frontier], device=device)  # [f]
        allowed = torch.zeros(f, self.past_length + entries + f, dtype=torch.bool, device=device)
        allowed[:, : self.past_length] = True
        for row, u in enumerate(frontier):
            for a in cands.ancestors(u)[:-1]:
                allowed[row, self.past_length + self.slot[a]] = True
            allowed[row, self.past_length + entries + row] = True
        mask = additive_mask(allowed, dtype)
        out = self.drafter(inputs[None], tokens[None], positions[None], mask[None, None], self.cache)[0]  # [f, H]
        for row, u in enumerate(frontier):
            self.slot[u] = entries + row
            self.feature[u] = out[row]
        logprobs = torch.log_softmax(self.drafter.logits(out).float(), dim=-1)  # [f, V']
        return topk_children(logprobs, self.top_k, self.drafter.draft_to_target)
