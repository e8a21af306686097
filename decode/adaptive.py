"""Adaptive speculation: each step, verify the number of drafted nodes that maximises expected tokens per second.

A step that verifies the root plus k drafted nodes costs ``cost(1 + k)`` (one target forward over 1 + k tree nodes,
as a multiple of a one-token forward) and emits ``1 + sum(p_i)`` tokens in expectation, where ``p_i`` is the
probability that drafted node i is accepted (the node's whole branch matches the target). With nodes ranked by
``p_i`` (a parent never ranks below its child), the best k maximises::

    (1 + p_1 + ... + p_k) / cost(1 + k)            k = 0 (the root alone: plain decoding) .. budget

- :func:`verify_cost_curve`: the time of one tree-verify forward of 1..64 nodes over a filled KV cache (cheap to grow
  on a GPU until it is compute bound, expensive on a CPU); :class:`CostCurve`: ``cost(n)`` from it, measured once per
  model, dtype, device, thread count and linear kernel on this machine and cached as JSON under the selfspec cache
  (:func:`measured_cost_curve`). A first decode may run beside other work, so the measurement takes each size's
  fastest of interleaved repeats, keeps a curve only when those repeats agree and other processes left the CPUs
  quiet meanwhile, and a kept curve is checked against a fresh one-token timing once per process
  (:func:`settled_curve`).
- :class:`Calibration`: a drafter's raw scores are not probabilities. Per bucket (e.g. a match length), it keeps the
  drafted nodes' summed scores and how many of them were accepted, and scales scores by their ratio, shrunk towards
  the ratio over all buckets, itself shrunk towards a prior of ``prior_weight`` nodes at ``prior_rate``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from selfspec.decode.cache import new_cache
from selfspec.decode.step import synchronize, tree_forward
from selfspec.cpu_kernels.linear_kernels import measured_decoding_kernels, measured_row_plan, use_small_batch
from selfspec.cpu_kernels.machine_load import OthersLoad
from selfspec.decode.tree import Tree, load_tree
from selfspec.decode.types import ROOT, Beside, DecodeState, Draft
from selfspec.core.archs import context_limit
from selfspec.core.kv import crop_cache
from selfspec.core.target import cache_dir, cache_kwarg, fingerprint

CURVE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # dense where CPU kernels change: costs step, not slope
CURVE_REPEATS = 9  # forwards per size, sizes interleaved; the fastest of each
CURVE_CHECK_REPEATS = 3  # one-token forwards that check a kept curve, once per process
CURVE_AGREEMENT = 0.15  # repeats that agree: the two fastest of a size within 15%; a kept curve still holds: its one-
# node time within 15% of a fresh one
CURVE_METHOD = 6  # part of the cache key: curves measured by an earlier method are measured again


@dataclass(frozen=True)
class CostCurve:
    """Verify cost of n tree nodes, relative to one node, interpolated linearly between measured sizes."""

    sizes: tuple[int, ...]
    ms: tuple[float, ...]

    def cost(self, n: int) -> float:
        if n <= self.sizes[0]:
            return self.ms[0] / self.ms[0]
        for (a, ta), (b, tb) in zip(zip(self.sizes, self.ms), zip(self.sizes[1:], self.ms[1:])):
            if n <= b:
                return (ta + (tb - ta) * (n - a) / (b - a)) / self.ms[0]
        # past the last size: grow linearly with the last segment's slope
        a, b = self.sizes[-2], self.sizes[-1]
        slope = (self.ms[-1] - self.ms[-2]) / (b - a)
        return (self.ms[-1] + slope * (n - b)) / self.ms[0]

    @classmethod
    def from_relative(cls, costs: dict[int, float]) -> "CostCurve":
        """From {nodes: cost relative to one node}, e.g. an injected curve in tests."""
        sizes = tuple(sorted(costs))
        return cls(sizes=sizes, ms=tuple(float(costs[n]) for n in sizes))


def best_size(scores: Sequence[float], curve: CostCurve, budget: int, base_nodes: int = 1,
              base_expected: float = 1.0) -> int:
    """How many of the ranked drafted nodes (``scores``: acceptance probabilities, best first) to verify, at most
    ``budget``: the k that maximises (base_expected + sum of the first k) / cost(base_nodes + k). 0 means none: the
    root alone (base 1 node, 1 token), or only what another drafter put in the tree (a hybrid tree's base)."""
    best_k, best_rate, expected = 0, base_expected / curve.cost(base_nodes), base_expected
    for k, p in enumerate(scores[:budget], start=1):
        expected += p
        rate = expected / curve.cost(base_nodes + k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


@dataclass
class Calibration:
    """Scales a drafter's scores into acceptance probabilities, per bucket (e.g. a match length) and tree depth, from
    what was accepted so far.

    A node is accepted only with its whole branch, so the same score means less the deeper the node (a single earlier
    occurrence scores every token of its continuation alike): each depth keeps its own ratio of accepted nodes to
    summed scores. A (bucket, depth) with few verified nodes leans on the depth above it in the same bucket times the
    chance that a branch accepted so far goes on one more token; depth 1 leans on every bucket's depth 1, and that on
    a prior of ``prior_weight`` nodes at ``prior_rate``. The chance of going on starts at ``prior_continue`` and
    follows what the bucket showed: past depth 2, the ratio of the two levels above, as far as they were verified.
    So a bucket whose branches went on at the levels seen (a long copy) is hoped to go on deeper, and is tried there;
    one whose branches died off level by level is not.

    Before any evidence a depth-d node is worth ``prior_rate * prior_continue ** (d - 1)`` of its score. With every
    depth at the prior rate instead, the suffix drafter verified one earlier occurrence's whole 16-token continuation
    (a costly verify on a CPU) at the start of each answer on text it had not seen; on unseen chat answers a match of
    one token was measured to go on at about ``prior_rate`` a level (docs/journal/2026-12-01-figures-from-code.md).
    """

    prior_rate: float = 0.5
    prior_weight: float = 4.0
    prior_continue: float = 0.5
    scored: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, depth) -> summed raw scores
    accepted: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, depth) -> how many accepted

    def factors(self, bucket: int, depth: int = 1) -> list[float]:
        """accepted / scored for depths 1..``depth`` of ``bucket``, each shrunk towards the one above it times the
        chance of going on (depth 1 towards every bucket's depth 1, itself shrunk towards the prior). A bucket pulled
        down by others' failures learns its own ratio from the drafter's occasional looks."""
        w = self.prior_weight
        top = ((sum(v for (_, d), v in self.accepted.items() if d == 1) + self.prior_rate * w)
               / (sum(v for (_, d), v in self.scored.items() if d == 1) + w))
        out = []
        go_on = self.prior_continue
        for d in range(1, depth + 1):
            seen = self.scored.get((bucket, d - 1), 0.0)
            if d >= 3 and seen > 0:  # the bucket's own rate of going on, from the depth above and the one before
                go_on = (seen * min(1.0, out[-1] / out[-2]) + w * go_on) / (seen + w)
            target = top if d == 1 else top * go_on
            top = (self.accepted.get((bucket, d), 0.0) + target * w) / (self.scored.get((bucket, d), 0.0) + w)
            out.append(top)
        return out

    def factor(self, bucket: int, depth: int = 1) -> float:
        return self.factors(bucket, depth)[-1]

    def probabilities(self, scores: Sequence[float], bucket: int,
                      depths: Sequence[int] | None = None) -> list[float]:
        """Acceptance probabilities of nodes with these raw ``scores`` at these ``depths`` (default: all at 1)."""
        depths = list(depths) if depths is not None else [1] * len(scores)
        f = self.factors(bucket, max(depths, default=1))
        return [min(1.0, f[d - 1] * s) for s, d in zip(scores, depths)]

    def update(self, bucket: int, scores: Sequence[float], accepted: int, depth: int = 1) -> None:
        """``accepted`` of the verified nodes at ``depth`` with these raw ``scores`` were accepted."""
        key = (bucket, depth)
        self.scored[key] = self.scored.get(key, 0.0) + float(sum(scores))
        self.accepted[key] = self.accepted.get(key, 0.0) + float(accepted)


@dataclass
class AdaptiveDepth:
    """How deep each draft goes, for drafters whose trees can be cut by depth (Medusa's static trees, EAGLE's dynamic
    ones): the depth d (0: the root alone, no drafting) that maximises the expected tokens per second::

        (1 + a_1 + ... + a_d) / (cost(nodes at depth d) + drafting cost)

    ``a_j`` is the share of verified trees deep enough to reach level j whose accepted branch did reach it (a prior
    of ``prior_steps`` steps at ``prior_accept ** j`` keeps the first steps hopeful), node counts are the ones the
    drafter proposed at each depth (first estimated from a deeper tree's levels), and the drafting cost is the
    measured seconds per drafted step over one forward's, kept per depth drafted (a chain drafter such as layer-skip
    pays per level: a depth not drafted yet is estimated from the nearest one measured, in proportion; the first
    draft's time is not counted, as it runs cold). Every
    ``explore_every`` steps a depth one level deeper than the best is verified, so the estimates follow the text;
    while those looks do not pay, they come half as often (down to one in ``32 * explore_every`` steps). A depth that
    could not beat the best even if every level were accepted is never looked at (the next deeper one that could is
    looked at instead, or none).
    ``verify_share`` scales the verify cost of a drafted step: 1 for a verify pass over the whole target; a layer-skip
    drafter's pass skips the first layers its draft already ran on the chain, whose time is in the drafting cost.
    The choice is optimistic under uncertainty (as UCB bandits are): each ``a_j`` counts ``optimism`` standard errors
    above its estimate, a bonus that shrinks as verified trees accumulate. Without it a few unlucky first drafts
    switched off a drafter that pays (a layer-skip exit whose first drafts all missed), and the rare looks that
    followed took many steps to bring it back (docs/journal/2026-12-01-figures-from-code.md).
    """

    curve: CostCurve
    measure_draft: bool = True  # False: drafting counted free (tests with injected curves)
    verify_share: float = 1.0  # share of cost(n) a verify pass after a draft runs (layer-skip: the layers after E)
    explore_every: int = 16
    prior_steps: float = 2.0
    prior_accept: float = 0.6
    optimism: float = 1.0  # standard errors added to each level's acceptance when choosing (0: the estimate alone)
    tried: dict[int, float] = field(default_factory=dict)  # level j -> verified trees that reached it
    reached: dict[int, float] = field(default_factory=dict)  # level j -> of those, accepted branches that reached it
    nodes: dict[int, int] = field(default_factory=dict)  # depth asked -> nodes the drafter proposed (or said it would)
    full_depth: int | None = None  # the deepest draft the drafter proposes (given, or seen on the first step); a
    # drafter that stops early by itself (a confidence threshold) gives it, so a short first draft does not cap it
    draft_s: float = 0.0  # moving average of seconds spent drafting a step, any depth (the estimate before any
    # depth was measured)
    draft_by_depth: dict[int, float] = field(default_factory=dict)  # depth drafted -> moving average of its seconds
    cold: bool = True  # no draft timed yet: the first one's time is not counted (below)
    since_explore: int = 0  # steps since the last look one level deeper than the best
    interval: int = 0  # steps between such looks (explore_every at first); doubles while they do not pay
    last_best: int = 0

    def __post_init__(self) -> None:
        self.interval = self.interval or self.explore_every

    def acceptance(self, level: int, optimistic: bool = False) -> float:
        """The estimated share of trees reaching ``level`` whose accepted branch does too; ``optimistic``: plus
        ``optimism`` standard errors of that estimate (a binomial share over the trees tried and the prior's)."""
        prior = self.prior_steps * self.prior_accept ** level
        count = self.tried.get(level, 0.0) + self.prior_steps
        mean = (self.reached.get(level, 0.0) + prior) / count
        if not optimistic:
            return mean
        return min(1.0, mean + self.optimism * math.sqrt(mean * (1.0 - mean) / count))

    def _nodes(self, depth: int) -> int:
        """Tree nodes of a draft to ``depth``: as seen (or as the drafter said), else the nearest deeper depth's, else
        a chain grown from the deepest shallower one's (never fewer nodes than a shallower cut holds)."""
        if depth in self.nodes:
            return self.nodes[depth]
        deeper = [d for d in self.nodes if d > depth]
        if deeper:
            return self.nodes[min(deeper)]
        shallower = [d for d in self.nodes if d < depth]
        return self.nodes[max(shallower)] + depth - max(shallower) if shallower else depth + 1

    def expected(self, depth: int, optimistic: bool = False) -> float:
        """Expected tokens of a step that drafts to ``depth``: the target's own plus the accepted drafted ones."""
        return 1.0 + sum(self.acceptance(j, optimistic) for j in range(1, depth + 1))

    def rate(self, depth: int, optimistic: bool = False, beside: Beside = ROOT, ceiling: bool = False) -> float:
        """Expected tokens per one-token forward time when drafting to ``depth`` (``optimistic``: see
        :meth:`acceptance`), in a tree that already holds ``beside`` (another drafter's nodes: see :class:`Beside`).
        This drafter's tokens count only where that drafter's first level misses, and its nodes add to the tree.
        ``ceiling``: the rate if every level were accepted, the most drafting to ``depth`` could ever give."""
        if depth == 0:
            return beside.expected / self.curve.cost(beside.nodes)
        drafted = float(depth) if ceiling else self.expected(depth, optimistic) - 1.0
        expected = beside.expected + beside.miss * drafted
        draft = self.draft_seconds(depth) / (self.curve.ms[0] / 1000.0) if self.measure_draft else 0.0
        return expected / (self.verify_share * self.curve.cost(beside.nodes + self._nodes(depth) - 1) + draft)

    def draft_seconds(self, depth: int) -> float:
        """Seconds to draft to ``depth``: measured there, else scaled from the nearest depth measured (a deeper one
        on a tie), else the estimate over all depths."""
        if depth in self.draft_by_depth:
            return self.draft_by_depth[depth]
        if not self.draft_by_depth:
            return self.draft_s
        near = min(self.draft_by_depth, key=lambda d: (abs(d - depth), -d))
        return self.draft_by_depth[near] * depth / near

    def choose(self, max_depth: int, beside: Beside = ROOT) -> int:
        if self.full_depth is None:
            return max_depth  # the first step shows how deep the drafter goes
        top = min(max_depth, self.full_depth)
        rates = [self.rate(d, optimistic=True, beside=beside) for d in range(top + 1)]
        best = max(range(top + 1), key=rates.__getitem__)
        if best > self.last_best:
            self.interval = self.explore_every  # deeper paid off: look further again soon
        self.last_best = best
        if best == top:
            self.since_explore = 0
            return best
        self.since_explore += 1
        if self.since_explore <= self.interval:
            return best
        # the shallowest deeper depth, the cheapest look; looked at less often while looking does not pay. A depth
        # that could not beat the best even if every level were accepted is not looked at (on a CPU, a Medusa
        # tree's 10-node first level costs more than the two tokens it could give)
        self.since_explore = 0
        look = next((d for d in range(best + 1, top + 1) if self.rate(d, beside=beside, ceiling=True) > rates[best]),
                    None)
        if look is None:
            return best
        self.interval = min(2 * self.interval, 32 * self.explore_every)
        return look

    def observe(self, asked: int, draft, accepted: int | None, draft_seconds: float) -> None:
        depth = int(draft.tree.max_depth)
        if asked == 0 or depth == 0:
            return
        if self.full_depth is None:
            self.full_depth = depth  # the drafter did not say how deep it drafts: its first draft shows it
        levels = draft.tree.depth.tolist()
        for level in range(1, depth):  # a first estimate of shallower cuts: this tree's nodes down to that level
            self.nodes.setdefault(level, sum(1 for d in levels if d <= level))
        self.nodes[min(asked, self.full_depth)] = int(draft.tree.num_nodes)
        if accepted is not None:  # None: this step's acceptance does not count (its size and time do)
            for level in range(1, depth + 1):
                self.tried[level] = self.tried.get(level, 0.0) + 1.0
                self.reached[level] = self.reached.get(level, 0.0) + float(accepted >= level)
        if self.cold:  # the first draft runs cold (kernels chosen, buffers made on first use): on a GPU it took many
            self.cold = False  # forwards' time, an estimate no later draft came to correct, as none was drafted
            return
        known = bool(self.draft_by_depth) or self.draft_s > 0
        before = self.draft_seconds(depth)
        self.draft_by_depth[depth] = 0.9 * before + 0.1 * draft_seconds if known else draft_seconds
        self.draft_s = draft_seconds if not self.draft_s else 0.9 * self.draft_s + 0.1 * draft_seconds


# --- the measured curve, cached -------------------------------------------------------------------------------------


@torch.no_grad()
def verify_cost_curve(
    model: torch.nn.Module,
    cache_length: int = 256,
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    repeats: int = 5,
    tree: Tree | None = None,
    linear_kernel: str = "torch",
) -> list[dict]:
    """Median and fastest time of one tree-verify forward of N nodes (the first N nodes of ``tree``, default
    mc_sim_7b_63 and chains beyond its size) over a ``cache_length`` cache, with the linear layers of
    ``linear_kernel`` (see selfspec.cpu_kernels.linear_kernels; small-batch ones pad rows as this machine's measured
    plan says), sizes interleaved over ``repeats``. Returns [{"nodes", "ms" (median), "min_ms", "ms_per_node"}]."""
    with measured_decoding_kernels(model, linear_kernel=linear_kernel):
        forward, reset = _verify_forwards(model, cache_length, sizes, tree)
        times = time_interleaved(forward, sizes, repeats, reset=reset)
    rows = []
    for n, seconds in times.items():
        ms = 1000 * statistics.median(seconds)
        rows.append({"nodes": n, "ms": ms, "min_ms": 1000 * min(seconds), "ms_per_node": ms / n})
    return rows


def _verify_forwards(model: torch.nn.Module, cache_length: int, sizes: Sequence[int],
                     tree: Tree | None = None) -> tuple[Callable[[int], None], Callable[[], None]]:
    """After a ``cache_length`` prefill and a warm-up: (one verify forward over a tree of n nodes, waited for; the
    reset that drops its rows from the cache again)."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    shape = tree or load_tree("mc_sim_7b_63")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (cache_length,), generator=g).to(device)
    cache = new_cache()
    model(input_ids=prompt[None], use_cache=True, **{cache_kwarg(model): cache})
    layouts = {}
    for n in sorted(set(sizes) | {max(sizes), min(sizes)}):
        parents = shape.parents[:n].tolist() if n <= shape.num_nodes else list(range(-1, n - 1))
        tokens = torch.randint(0, vocab, (n,), generator=g).to(device)
        layouts[n] = Draft(tokens=tokens, tree=Tree.from_parents(parents).to(device))

    def forward(n: int) -> None:
        state = DecodeState(cache=cache, prompt_ids=prompt, length=cache_length,
                            next_token=int(layouts[n].tokens[0]), hidden=torch.empty(0, device=device))
        tree_forward(model, state, layouts[n])
        synchronize(device)

    def reset() -> None:
        crop_cache(cache, cache_length)
        synchronize(device)

    for n in (max(sizes), min(sizes)):  # warm up kernels and allocator on both ends of the curve
        forward(n)
        reset()
    return forward, reset


def time_interleaved(forward: Callable[[int], None], sizes: Sequence[int], repeats: int,
                     clock: Callable[[], float] = time.perf_counter,
                     reset: Callable[[], None] = lambda: None) -> dict[int, list[float]]:
    """Seconds of ``forward(n)`` for each of ``sizes``, ``repeats`` times, read from ``clock``; the sizes interleaved,
    so that a drift of the machine's speed hits every size alike. ``reset`` runs after each forward, untimed."""
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            t0 = clock()
            forward(n)
            times[n].append(clock() - t0)
            reset()
    return times


def monotone(ms: Sequence[float]) -> tuple[float, ...]:
    """Costs made non-decreasing in the number of nodes (right to left: a smaller tree never costs more than a
    larger one, since it could be padded to it). What is left of timing noise, e.g. 2 nodes measured above 4 when
    both run the same 4-row kernel."""
    out = list(ms)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return tuple(out)


def _cache_file(model: torch.nn.Module, linear_kernel: str) -> Path:
    param = next(model.parameters())
    plan = measured_row_plan(model).widths if use_small_batch(linear_kernel, param.device) else None
    key = json.dumps({"model": fingerprint(model)["digest"], "row_plan": plan,
                      "layers": model.config.num_hidden_layers,
                      "dtype": str(param.dtype), "device": str(param.device), "threads": torch.get_num_threads(),
                      "cpu": platform.processor() or platform.machine(), "kernel": linear_kernel,
                      "torch": torch.__version__, "method": CURVE_METHOD}, sort_keys=True)
    return cache_dir() / "cost_curves" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def repeats_agree(times: dict[int, list[float]], tolerance: float = CURVE_AGREEMENT) -> bool:
    """Whether every size's fastest forward is matched within ``tolerance`` by a second one. Other work on the
    machine only ever adds time: on a quiet machine the fastest repeats agree; when it was busy through most of a
    size's repeats they do not, and the fastest is not the machine's own speed."""
    return all(len(t) >= 2 and sorted(t)[1] <= sorted(t)[0] * (1.0 + tolerance) for t in times.values())


def fastest_curve(times: dict[int, list[float]]) -> CostCurve:
    """The curve of each size's fastest forward (noise only adds time), made non-decreasing."""
    return CostCurve(sizes=tuple(times), ms=monotone([1000.0 * min(t) for t in times.values()]))


def settled_curve(path: Path, measure: Callable[[Sequence[int], int], dict[int, list[float]]],
                  tolerance: float = CURVE_AGREEMENT) -> CostCurve:
    """The cost curve kept at ``path``, or measured with ``measure(sizes, repeats)`` (seconds per size, sizes
    interleaved) and kept there. A kept curve is checked against a fresh one-token timing first: if it is slower
    than the machine is now by more than ``tolerance``, it was measured beside other work, and is measured again. A
    measured curve is kept only if its repeats agree (:func:`repeats_agree`) and other processes left the CPUs
    quiet meanwhile (cpu_kernels/machine_load.py); otherwise it serves this process alone."""
    kept = _read_curve(path)
    if kept is not None:
        one = kept.sizes[0]
        fresh_ms = 1000.0 * min(measure((one,), CURVE_CHECK_REPEATS)[one])
        if kept.ms[0] <= fresh_ms * (1.0 + tolerance):
            return kept
    with OthersLoad() as load:
        times = measure(CURVE_SIZES, CURVE_REPEATS)
    curve = fastest_curve(times)
    if repeats_agree(times, tolerance) and load.quiet:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"sizes": list(curve.sizes), "ms": list(curve.ms)}))
        os.replace(tmp, path)
    return curve


def _read_curve(path: Path) -> CostCurve | None:
    try:
        data = json.loads(path.read_text())
        return CostCurve(sizes=tuple(int(n) for n in data["sizes"]), ms=tuple(float(t) for t in data["ms"]))
    except (OSError, ValueError, KeyError, TypeError):  # missing, or unreadable: measure it (again)
        return None


_SETTLED: dict[Path, CostCurve] = {}  # this process's curves, each checked or measured once


@torch.no_grad()
def measured_cost_curve(model: torch.nn.Module, linear_kernel: str = "torch", cache_length: int = 256,
                        clock: Callable[[], float] = time.perf_counter) -> CostCurve:
    """The verify cost curve of ``model`` on this machine: measured once and kept in the selfspec cache, checked
    once per process against a fresh one-token timing (:func:`settled_curve`); ``clock`` times the forwards."""
    path = _cache_file(model, linear_kernel)
    if path not in _SETTLED:
        length = max(1, min(cache_length, context_limit(model.config) - max(CURVE_SIZES)))
        with measured_decoding_kernels(model, linear_kernel=linear_kernel):
            forward, reset = _verify_forwards(model, length, CURVE_SIZES)
            _SETTLED[path] = settled_curve(
                path, lambda sizes, repeats: time_interleaved(forward, sizes, repeats, clock, reset))
    return _SETTLED[path]
