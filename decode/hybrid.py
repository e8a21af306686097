"""Hybrid trees: a trained drafter's tree and the suffix drafter's proposals, verified as one tree.

Each step (:class:`HybridDrafter`):

1. the suffix drafter (decode/suffix.py) ranks its candidates; the trained drafter (Medusa, EAGLE, DFlash, ...)
   drafts as deep as the engine's adaptive depth policy says pays beside the nodes the suffix would verify alone
   (:class:`selfspec.decode.adaptive.AdaptiveDepth` with a :class:`selfspec.decode.types.Beside`: its tokens count where the suffix's
   first level misses; the whole tree with ``adaptive: false``). The engine owns the policy and hands it over with
   its step clock (:meth:`HybridDrafter.depth_control`); the engine then verifies the merged tree whole;
2. the suffix drafter keeps those of its candidates whose expected tokens pay for what they add to the cost of the
   *whole* tree, the trained drafter's nodes included (:func:`selfspec.decode.adaptive.best_size` with that tree as its
   base);
3. with ``splice`` (``draft.splice``, off by default: conf/decode/hybrid.yaml), where the trained drafter's draft
   starts with a chain (one node a level, as a DFlash or EAGLE chain's), the suffix drafter also looks up what would
   follow that chain's first m tokens had they been accepted (:meth:`SuffixDrafter.rank_after`, which changes
   nothing): a *spliced* branch, those m nodes and the continuation under them, each continuation node worth the
   depth policy's acceptance of level m times the suffix drafter's calibrated chance, kept as far as it pays for its
   cost in the whole tree (:func:`selfspec.decode.adaptive.best_size`). Where the text turns to a phrase seen before,
   the suffix drafter has no match until the phrase's first token is decoded; a trained drafter that guesses it lets
   the phrase go in the same step;
4. :func:`merge_drafts` merges them into one tree under one node budget (``merged_nodes``): a node's token under the
   same parent is one node, whichever drafter proposed it, so shared prefixes are verified once. The suffix's nodes
   come first (they were chosen by their calibrated acceptance), then the trained drafter's, then the spliced
   continuation, each after its parent; what does not fit the budget is dropped with its subtree. A drafter with its
   own verify forward (layer-skip, whose draft already ran the first layers on its chain and holds their KV rows in
   that order) comes first instead, and verifies the merged tree: the suffix's nodes are the ones its draft did not
   run. By default such a drafter and the suffix take turns instead (``exclusive``): the suffix drafts when it has
   candidates worth verifying, the layer-skip chain only when it has none.

After the verify, each part learns from its own share of the accepted branch (the accepted nodes it proposed, from
the root down): the suffix drafter's calibration (a spliced continuation's too, where its m trained nodes were
accepted) and the depth policy's acceptance per level. The trained drafter's own hooks (an EAGLE draft cache) see
the merged draft and the accepted branch, whichever part proposed it.

Every part's draft is deterministic, so the merged draft is too (``probs=None``): greedy and sampling verification
stay lossless, and merging keeps sibling tokens distinct, as point-mass verification expects.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from selfspec.decode import registry
from selfspec.decode.adaptive import best_size
from selfspec.decode.suffix import SuffixDrafter, SuffixPlan, candidates_draft
from selfspec.decode.tree import Tree
from selfspec.decode.types import (ROOT, Beside, DecodeState, DepthControl, Draft, DrafterBase, Drafter, ForwardOutput,
                                   root_only)
from selfspec.decode.verify import Verdict


def merge_drafts(drafts: Sequence[Draft], max_nodes: int) -> tuple[Draft, list[set[int]]]:
    """One tree from drafts with the same root: each draft's nodes in its own order (parents first), a node with
    the same token under the same parent shared, at most ``max_nodes`` drafted nodes (a node that does not fit is
    dropped with its subtree). Returns the merged draft and, per input draft, the merged node ids it proposed."""
    root = int(drafts[0].tokens[0])
    tokens, parents = [root], [-1]
    index: dict[tuple[int, int], int] = {}
    sources: list[set[int]] = []
    for draft in drafts:
        if int(draft.tokens[0]) != root:
            raise ValueError("merge_drafts: the drafts have different roots.")
        mine: dict[int, int] = {0: 0}  # this draft's node id -> merged id
        for node, (parent, token) in enumerate(zip(draft.tree.parents.tolist(), draft.tokens.tolist())):
            if node == 0 or parent not in mine:
                continue
            key = (mine[parent], int(token))
            if key not in index:
                if len(tokens) - 1 >= max_nodes:
                    continue
                index[key] = len(tokens)
                tokens.append(int(token))
                parents.append(mine[parent])
            mine[node] = index[key]
        sources.append(set(mine.values()) - {0})
    device = drafts[0].tokens.device
    merged = Draft(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                   tree=Tree.from_parents(parents).to(device))
    return merged, sources


def chain_prefix(draft: Draft) -> list[int]:
    """The tokens of the draft's levels that hold one node each, from the first down (a chain draft: all of them)."""
    parents = draft.tree.parents.tolist()
    tokens = draft.tokens.tolist()
    chain, node = [], 0
    while True:
        children = [i for i, p in enumerate(parents) if p == node]
        if len(children) != 1:
            return chain
        node = children[0]
        chain.append(int(tokens[node]))


def accepted_from(path: Sequence[int], nodes: set[int]) -> int:
    """How many accepted nodes (``path``: root first) a part proposed, counted from the root down while they are
    its own (a part's nodes are closed under parents, so its share of the branch is a prefix)."""
    count = 0
    for node in path[1:]:
        if node not in nodes:
            break
        count += 1
    return count


class HybridDrafter(DrafterBase):
    """A trained drafter (``inner``) and a :class:`SuffixDrafter` merged into one tree per step (module docstring).

    ``max_nodes``: the merged tree's drafted-node budget. ``marginal``: the depth policy weighs the inner drafter's
    draft beside what the suffix would verify alone (its tokens count on the steps where the suffix's first level
    misses, its nodes add to the suffix's), so a costly draft is skipped when the suffix already has the step in
    hand; False: the policy weighs it as if it drafted alone. ``exclusive``: each step either part drafts, not both:
    the suffix drafter when it chose candidates (on top of the root alone), else the inner drafter. By default for an
    inner drafter with its own verify forward (layer-skip): its chain is drafted one sequential pass per token, and
    beside the suffix's nodes its verify runs the first layers again in a pass of their own, which cost more than
    the merged nodes earned (docs/journal/2026-11-benchmarks.md); merged trees otherwise. ``splice``: add spliced
    branches (the module docstring, step 3); False: the two parts' trees alone.
    The depth policy is the engine's (:meth:`depth_control`); without one, the inner drafter drafts its whole tree.
    """

    def __init__(self, inner: Drafter, suffix: SuffixDrafter, max_nodes: int, marginal: bool,
                 exclusive: bool | None = None, *, splice: bool):
        self.inner, self.suffix, self.max_nodes, self.marginal = inner, suffix, max_nodes, marginal
        self.splice = splice
        self.exclusive = self._own_verify if exclusive is None else exclusive
        self.control = DepthControl(None)  # the engine's, from the start of each decode
        self._step: tuple[int, Draft, SuffixPlan, list[set[int]], float] | None = None
        self._splice: tuple[int, SuffixPlan, set[int]] | None = None  # this step's spliced branch: m, plan, nodes

    def depth_control(self, control: DepthControl) -> DepthControl:
        """The engine's depth policy and clock go to the inner drafter's part (the suffix's nodes are chosen by their
        own calibrated acceptance); the engine drafts the merged tree whole, on the same clock."""
        self.control = control
        return DepthControl(None, control.clock)

    def modules(self) -> Sequence[torch.nn.Module]:
        return self.inner.modules()

    @property
    def max_draft_depth(self) -> int | None:
        return self.inner.max_draft_depth

    @property
    def verify_forward(self) -> Callable[..., ForwardOutput] | None:
        """The inner drafter's own verify forward when it has one (a layer-skip drafter: the merged tree starts with
        its chain); None otherwise: the engine's one target forward over the tree."""
        return self.inner.verify_forward

    def start(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.inner.start(state, prefill)
        self.suffix.start(state, prefill)
        self._step = None

    @torch.no_grad()
    def propose(self, state: DecodeState, max_depth: int) -> Draft:
        device, control = self.suffix.device, self.control
        ranking = self.suffix.rank(state, max_depth)
        plan = self.suffix.choose(ranking) if self.exclusive else None
        beside = ROOT
        if self.marginal and plan is None and control.policy is not None:  # what the suffix would verify alone
            alone = self.suffix.choose(ranking, final=False)
            beside = Beside(nodes=1 + len(alone.chosen), expected=1.0 + alone.expected, miss=1.0 - alone.first)
        t0 = control.clock()
        if plan is not None and plan.chosen:  # exclusive: the suffix has this step
            asked, inner = 0, root_only(state, device)
        else:
            asked, inner = control.draft(self.inner, state, max_depth, device, beside)
        inner_seconds = control.clock() - t0
        expected = control.expected(int(inner.tree.max_depth))
        if plan is None:
            plan = self.suffix.choose(ranking, base_nodes=inner.tree.num_nodes, base_expected=expected)
        suffix = candidates_draft(state.next_token, plan.cands, sorted(plan.chosen), device)
        self._splice = None
        if self._own_verify:  # the inner drafter verifies its chain itself: its nodes first, as its cache holds them
            merged, (inner_nodes, suffix_nodes) = merge_drafts([inner, suffix], self.max_nodes)
        else:
            drafts = [suffix, inner]
            spliced = self.spliced(inner, plan, expected, max_depth)
            if spliced:
                _, chain, splice_plan = spliced
                drafts.append(candidates_draft(state.next_token, splice_plan.cands, sorted(splice_plan.chosen), device,
                                               chain=chain))
            merged, (suffix_nodes, inner_nodes, *splice_nodes) = merge_drafts(drafts, self.max_nodes)
            if spliced:
                self._splice = (len(chain), splice_plan, splice_nodes[0])
        self._step = (asked, inner, plan, (suffix_nodes, inner_nodes), inner_seconds)
        return merged

    def spliced(self, inner: Draft, plan: SuffixPlan, expected: float,
                max_depth: int) -> tuple[float, list[int], SuffixPlan] | None:
        """The spliced branch that adds most expected tokens per verify cost to the tree of ``inner`` (worth
        ``expected`` tokens) and the suffix's ``plan``: (that rate, the chain of inner's tokens it starts with, the
        suffix drafter's continuation of them as a plan), or None where none pays. Only under the depth policy, whose
        per-level acceptance says what the chain is worth, and where the suffix's own nodes do not already start with
        the chain's first token."""
        policy = self.control.policy
        if not self.splice or policy is None or not hasattr(policy, "acceptance") or self.suffix.budget != "auto":
            return None
        chain = chain_prefix(inner)[: max_depth - 1]
        if not chain:
            return None
        if any(plan.depths[n] == 1 and plan.cands.tokens[n] == chain[0] for n in plan.chosen):
            return None
        curve = self.suffix.curve()
        nodes, tokens = inner.tree.num_nodes + len(plan.chosen), expected + plan.expected
        best: tuple[float, list[int], SuffixPlan] | None = None
        base_rate = tokens / curve.cost(nodes)
        for m in range(1, len(chain) + 1):
            alive = policy.acceptance(m)
            ranking = self.suffix.rank_after(chain[:m], max_depth - m)
            scores = [alive * ranking.probs[n] for n in ranking.ranked]
            k = best_size(scores, curve, self.suffix.max_nodes, nodes, tokens)
            if not k:
                continue
            rate = (tokens + sum(scores[:k])) / curve.cost(nodes + k)
            if rate > (best[0] if best else base_rate):
                chosen = ranking.ranked[:k]
                best = (rate, chain[:m], SuffixPlan(ranking.bucket, ranking.cands, chosen, ranking.depths,
                                                    expected=sum(scores[:k])))
        return best

    @property
    def _own_verify(self) -> bool:
        return self.inner.verify_forward is not None

    @torch.no_grad()
    def on_commit(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput) -> None:
        t0 = self.control.clock()
        self.inner.on_commit(state, draft, verdict, out)
        inner_seconds = self.control.clock() - t0
        if self._step is None:
            return
        asked, inner, plan, (suffix_nodes, inner_nodes), propose_seconds = self._step
        self._step = None
        if self._splice is not None:  # the continuation learns where its chain was accepted
            m, splice_plan, splice_nodes = self._splice
            self._splice = None
            reached = accepted_from(verdict.path, splice_nodes)
            if reached >= m:
                self.suffix.record(splice_plan, reached - m)
        suffix_accepted = accepted_from(verdict.path, suffix_nodes)
        self.suffix.record(plan, suffix_accepted)
        # ``marginal``: the policy counts the inner drafter's tokens where the suffix's first level misses (Beside),
        # so its acceptance is learned on those steps only; a step the suffix's nodes won says nothing of that rate
        # (both parts are right on the same easy text). Its draft's size and time count on every step.
        accepted = None if self.marginal and suffix_accepted > 0 else accepted_from(verdict.path, inner_nodes)
        self.control.observe(asked, inner, accepted, propose_seconds + inner_seconds)


def build_hybrid(target, inner: Drafter, settings: dict) -> HybridDrafter:
    """``inner`` (built under ``settings``, a registry entry's with ``hybrid`` on) merged with a suffix drafter: the
    suffix family's settings, with the ``hybrid`` block's keys (its ``corpus``, ``remember``) as ``settings`` give
    them; ``merged_nodes``, ``marginal`` and ``splice`` from ``settings``. ``target``: the
    ``selfspec.core.target.Target`` decoded with."""
    suffix_entry = registry.entry("suffix")
    passed = {k: settings.get(k) for k in registry.defaults_of("hybrid") if k in registry.defaults_of("suffix")}
    suffix = suffix_entry.build(None, target, suffix_entry.settings(None, passed))
    return HybridDrafter(inner, suffix, max_nodes=int(settings["merged_nodes"]), marginal=bool(settings["marginal"]),
                         splice=bool(settings["splice"]))
