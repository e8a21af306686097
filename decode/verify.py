"""Acceptance rules: given the target's logits at every tree node, which drafted nodes to keep and which token the
target adds after them. Pure functions over tensors; each one is unit tested on given distributions.

- ``greedy``: keep the longest branch whose every token is the target's argmax (lossless: the output equals the
  target's own greedy decoding).
- ``sample``: speculative sampling over the tree with recursive rejection across siblings (lossless: every emitted
  token follows the target's distribution after temperature / top-k / top-p). At a node with target distribution p,
  each child x_i (drafted from q_i) is tried in order: accept with probability min(1, p(x_i) / q_i(x_i)); on
  rejection set p <- norm(max(p - q_i, 0)) and try the next sibling. After the last rejection (or at a leaf, or
  after a fully accepted branch) one token is sampled from the current p. Drafts that are deterministic (Medusa's
  top-k ranks, EAGLE-2's top-k) have a point-mass q: accept x with probability p(x), and on rejection p loses x.
- ``typical``: Medusa's typical acceptance, LOSSY (the output distribution is not the target's): keep a node when
  its token's target probability exceeds min(threshold, alpha * exp(-entropy)) at its parent. Opt-in.

Temperature, top-k and top-p are applied to the target's logits (in the order Hugging Face ``generate`` uses:
temperature, top-k, top-p) before acceptance; greedy ignores them.

Shapes: N tree nodes, V vocabulary, B independent draws (the engine uses B = 1; tests use many).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.decode.tree import Tree
from selfspec.core.errors import SettingError

ACCEPTANCE_RULES = ("greedy", "sample", "typical")


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen and drafts accepted."""

    acceptance: str = "greedy"  # greedy | sample | typical (lossy)
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    typical_threshold: float = 0.09  # typical acceptance: epsilon (Medusa's posterior_threshold)
    typical_alpha: float = 0.3  # typical acceptance: delta (Medusa's posterior_alpha)

    def __post_init__(self):
        if self.acceptance not in ACCEPTANCE_RULES:
            raise SettingError(f"acceptance={self.acceptance!r}: use one of {', '.join(ACCEPTANCE_RULES)}.")
        if self.acceptance != "greedy" and not self.temperature > 0:
            raise SettingError(
                f"acceptance={self.acceptance} needs temperature > 0 (got {self.temperature}); "
                "for deterministic output use acceptance=greedy."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SettingError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise SettingError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}.")


@dataclass
class Verdict:
    """Result of verifying one tree (B = 1)."""

    path: list[int]  # accepted node ids, root first (len 1..depth+1)
    next_token: int  # the token the target adds after the last accepted node (the bonus)


# --- the target's distribution --------------------------------------------------------------------------------------


def target_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) after temperature, top-k, top-p (as HF generate)."""
    scores = logits.float() / temperature
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1)  # ascending
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1:] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


# --- greedy ---------------------------------------------------------------------------------------------------------


def deepest_accepted(node_ok: torch.Tensor, tree: Tree) -> torch.Tensor:
    """node_ok [N] bool (root True) -> the deepest node whose whole branch is ok (first such node on ties). [] long"""
    branch_ok = ~(tree.ancestor_mask & ~node_ok[None, :]).any(-1)  # [N]: every ancestor-or-self is ok
    score = torch.where(branch_ok, tree.depth + 1, 0)  # [N]
    return score.argmax()  # first maximum: lowest rank among equally deep branches


def branch_of(node: int, tree: Tree) -> list[int]:
    """Node ids from the root down to ``node`` (ancestors come earlier in node order)."""
    return tree.ancestor_mask[node].nonzero()[:, 0].tolist()


def verify_greedy(logits: torch.Tensor, tokens: torch.Tensor, tree: Tree) -> Verdict:
    """logits [N, V], tokens [N]: keep the longest branch of argmax tokens; the bonus is the argmax after it."""
    best = logits.argmax(-1)  # [N] the target's token after each node
    node_ok = tokens == best[tree.parents.clamp(min=0)]  # [N]
    node_ok[0] = True
    last = int(deepest_accepted(node_ok, tree))
    return Verdict(path=branch_of(last, tree), next_token=int(best[last]))


# --- lossless speculative sampling ----------------------------------------------------------------------------------


def accept_among_siblings(
    p: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    uniforms: torch.Tensor,
    q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over one node's children, B draws at once.

    p [B, V] target distribution at the parent; tokens [B, C] children's tokens in order; valid [B, C] which slots
    hold a child; uniforms [B, C] in [0, 1); q [B, C, V] the distribution each child was drafted from, or None for
    deterministic drafts (q is a point mass on the child's token).
    Returns (accepted slot [B] long, -1 when every child was rejected; p [B, V], the distribution to sample the
    next token from when every child was rejected, i.e. the residual; unchanged rows where one was accepted).
    """
    if q is None:
        return _accept_point_masses(p, tokens, valid, uniforms[:, 0])
    accepted = torch.full(tokens.shape[:1], -1, dtype=torch.long, device=p.device)  # [B]
    for j in range(tokens.shape[1]):
        live = valid[:, j] & (accepted < 0)  # [B]
        tok = tokens[:, j].clamp(min=0)[:, None]  # [B, 1]
        p_tok = p.gather(1, tok)[:, 0]  # [B]
        q_tok = q[:, j].gather(1, tok)[:, 0]  # [B]
        ratio = p_tok / q_tok.clamp(min=torch.finfo(p.dtype).tiny)
        take = live & (uniforms[:, j] < ratio)  # u < min(1, ratio)
        accepted = torch.where(take, j, accepted)
        residual = (p - q[:, j]).clamp(min=0.0)
        mass = residual.sum(-1, keepdim=True)  # [B, 1]; 0 only when p == q, where rejection has probability 0
        residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)
        p = torch.where((live & ~take)[:, None], residual, p)
    return accepted, p


def _accept_point_masses(
    p: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sibling rule for deterministic drafts in one draw instead of a loop over children.

    With q a point mass, child j is accepted with probability p(x_j) / (1 - p(x_1) - ... - p(x_{j-1})) after its
    elder siblings were rejected, and each rejection removes that token from p. That is exactly the law of drawing
    y ~ p once and accepting the first child whose token is y; when no child has y, y follows p without the
    children's tokens, which is the residual returned (the caller samples the next token from it).
    p [B, V], tokens/valid [B, C], uniform [B] -> (slot [B], residual or p [B, V]).
    """
    cdf = p.cumsum(-1)  # [B, V]
    y = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None].contiguous(), right=True)[:, 0]
    y = y.clamp(max=p.shape[-1] - 1)  # [B] a draw from p by inverse CDF
    match = valid & (tokens == y[:, None])  # [B, C]
    found = match.any(-1)  # [B]
    slot = torch.where(found, match.int().argmax(-1), -1)  # the first matching child
    drafted = torch.zeros_like(p).scatter_add_(1, tokens.clamp(min=0), valid.to(p.dtype)) > 0  # [B, V]
    residual = p.masked_fill(drafted, 0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)
    return slot, torch.where(found[:, None], p, residual)


def sample_tree(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    tree: Tree,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    num_draws: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling down the tree, ``num_draws`` independent walks at once.

    probs [N, V] the target's (processed) distribution after each node; tokens [N] (tokens[0] is the root, already
    emitted); draft_probs [N, V] the distribution node i's token was drafted from (None: deterministic drafts).
    Returns (path [B, max_depth + 1] accepted node ids from the root, -1 padded; next_token [B]).
    """
    b, device = num_draws, probs.device
    node = torch.zeros(b, dtype=torch.long, device=device)  # [B] deepest accepted node
    path = torch.full((b, tree.max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    p = probs[node]  # [B, V]
    for level in range(tree.max_depth):
        kids = tree.children[node]  # [B, C], -1 padded; rows that stopped earlier are masked by `path`
        valid = (kids >= 0) & (path[:, level] >= 0)[:, None]  # [B, C]
        kid_ids = kids.clamp(min=0)
        q = draft_probs[kid_ids] if draft_probs is not None else None  # [B, C, V]
        u = torch.rand(kids.shape, generator=generator, device=device)
        slot, p = accept_among_siblings(p, tokens[kid_ids], valid, u, q)
        took = slot >= 0  # [B]
        child = kid_ids.gather(1, slot.clamp(min=0)[:, None])[:, 0]  # [B]
        node = torch.where(took, child, node)
        path[:, level + 1] = torch.where(took, child, -1)
        p = torch.where(took[:, None], probs[node], p)  # descend: the target's distribution after the child
    next_token = torch.multinomial(p, 1, generator=generator)[:, 0]  # [B]
    return path, next_token


def verify_sample(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Tree,
    sampling: Sampling,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """logits [N, V] -> one lossless speculative-sampling verdict."""
    probs = target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    path, next_token = sample_tree(probs, tokens, tree, draft_probs, generator)
    return Verdict(path=[i for i in path[0].tolist() if i >= 0], next_token=int(next_token[0]))


# --- typical acceptance (lossy) -------------------------------------------------------------------------------------


def typical_ok(probs: torch.Tensor, tokens: torch.Tensor, tree: Tree, threshold: float, alpha: float) -> torch.Tensor:
    """probs [N, V] (after temperature) -> node_ok [N]: p_parent(token) > min(threshold, alpha * exp(-entropy))."""
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)  # [N]
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))  # [N]
    parent = tree.parents.clamp(min=0)
    ok = probs[parent, tokens] > bar[parent]  # [N]
    ok[0] = True
    return ok


def verify_typical(
    logits: torch.Tensor, tokens: torch.Tensor, tree: Tree, sampling: Sampling, generator: torch.Generator | None = None
) -> Verdict:
    """Medusa's typical acceptance (LOSSY): the deepest typical branch, then a token sampled from the target."""
    probs = target_probs(logits, sampling.temperature)
    node_ok = typical_ok(probs, tokens, tree, sampling.typical_threshold, sampling.typical_alpha)
    last = int(deepest_accepted(node_ok, tree))
    bonus = target_probs(logits[last], sampling.temperature, sampling.top_k, sampling.top_p)
    next_token = int(torch.multinomial(bonus, 1, generator=generator)[0])
    return Verdict(path=branch_of(last, tree), next_token=next_token)


# --- dispatch -------------------------------------------------------------------------------------------------------


def verify(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tree: Tree,
    sampling: Sampling,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """logits [N, V] of the target after each tree node, tokens [N] -> accepted path and the target's next token."""
    if sampling.acceptance == "greedy":
        return verify_greedy(logits, tokens, tree)
    if sampling.acceptance == "sample":
        return verify_sample(logits, tokens, tree, sampling, draft_probs, generator)
    return verify_typical(logits, tokens, tree, sampling, generator)
