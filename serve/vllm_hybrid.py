"""selfspec's hybrid drafter as a vLLM proposer: each step a trained drafter (EAGLE-3 or DFlash, run by vLLM's own
proposer on the target's hidden states) and selfspec's suffix drafter (decode/suffix.py) both draft, and each request
is sent the chain expected to yield the most tokens per verify cost. Started with vLLM's ``worker_extension_cls``:

    LLM(target, speculative_config={"method": "dflash", "model": "<heads exported with format=dflash>",
                                    "num_speculative_tokens": k},
        worker_extension_cls="selfspec.serve.vllm_hybrid.HybridHook")

(``"method": "eagle3"`` with an EAGLE-3 export), with this repository on vLLM's ``PYTHONPATH``; docs/serving.md.

**How it hooks in (vLLM 0.32, the V1 model runner, as vLLM's CPU build runs it).** vLLM picks a proposer by the
method's name, and only its EAGLE/DFlash proposers are handed the target's hidden states; a ``custom_class`` proposer
sees token ids alone. vLLM's worker imports the module named by ``worker_extension_cls`` before it builds its model
runner, so importing this module replaces the runner module's ``EagleProposer`` and ``DFlashProposer`` with
subclasses (:func:`install`). The subclasses behave exactly as vLLM's own unless the engine's
``parallel_config.worker_extension_cls`` names :data:`HOOK`, so another engine in the same process is untouched.

**Each step, per request** (:class:`HybridRows`):

1. the suffix drafter plans its chain as serve/vllm_suffix.py does (adaptive length, calibrated online);
2. if the trained drafter's chain is not expected to pay on any row of the batch, the trained drafter does not draft
   this step (:meth:`HybridRows.needs_trained`): where no chain it could give would be chosen (its calibrated
   acceptance at its best, :meth:`HybridRows.trained_bound`), or, once measured, where its recent chains would
   not have beaten the suffix chain by more than its own time costs. A DFlash drafter then only stores the context
   keys and values of the step's hidden states, as vLLM's own ``propose`` does before its query forward; an EAGLE-3
   drafter runs its first forward, which writes its cache, and drafts one token;
3. otherwise vLLM's proposer drafts its chain as it always does (greedy), and the subclass keeps each drafted token's
   probability under the drafter (its softmax, from the logits it already computes); the trained chain's tokens are
   worth their calibrated acceptance probabilities (:class:`ChainCalibration`: per position and per bin of the
   drafter's probability, learned from what vLLM accepted), cut to the prefix with the most expected tokens per
   verify cost;
4. where the trained drafter ran, the suffix drafter also looks for what would follow the trained chain's first m
   tokens (m = 1 ... its length) had they been accepted, without taking them in
   (:meth:`selfspec.decode.suffix.SuffixDrafter.rank_after`): the *spliced* chain, those m tokens and that
   continuation, is worth the trained tokens' calibrated chances and then the suffix drafter's for what follows
   (:meth:`HybridRows.spliced`). Where text turns to a phrase seen before, the suffix drafter finds no match until
   the phrase's first token is decoded; a trained drafter that guesses it lets the whole phrase go in one step;
5. of the suffix, trained and spliced chains, the one with the most expected tokens (one for the bonus token, plus
   the chain's) per verify cost is returned, as a list per request (vLLM's CPU runner schedules drafts of any length
   up to ``num_speculative_tokens``). ``$SELFSPEC_VLLM_HYBRID_SPLICE=0`` leaves the spliced chain out.

What was accepted comes back with the next step (the sampled tokens, ``-1`` after the first rejection): the chain that
was sent learns from it; under greedy decoding the chain that was not sent learns too, from the target's own tokens
(its tokens up to the first that differs from them), so neither drafter's estimate starves while the other is chosen.
A spliced chain's continuation teaches the suffix drafter's calibration where its trained part was accepted.

Every chain is verified by vLLM's own rejection sampler: the output is the target's. With vLLM's default greedy
drafting (``draft_sample_method="greedy"``) a draft carries no probabilities, so a swapped row is a point-mass draft
and stays lossless under sampling too.

The verify cost of a chain is measured on the engine's own steps, as for serve/vllm_suffix.py (``MeasuredCurve``:
``$SELFSPEC_VLLM_COST_CURVE`` until then).
"""

from __future__ import annotations

import operator
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Sequence

import torch
from selfspec.decode.adaptive import CostCurve
from selfspec.decode.suffix import SuffixPlan
from selfspec.serve.vllm_suffix import MeasuredCurve, SuffixProposer, engine_curve, measured, record_chain

HOOK = "selfspec.serve.vllm_hybrid.HybridHook"
METHODS = ("eagle3", "dflash")  # vLLM's methods whose proposer the hybrid extends (heads/export.py's formats)
RATE_SAMPLES = 256  # the trained chain's recent rates that say what running it is worth (HybridRows.needs_trained)
RATE_WARMUP = 32  # until then it runs wherever its chain could be chosen
TIME_SAMPLES = 64  # recent steps whose median times say what it costs
SPLICE_ENV = "SELFSPEC_VLLM_HYBRID_SPLICE"  # "0": never send a trained chain continued by the suffix drafter


@dataclass
class ChainCalibration:
    """The chance that a trained drafter's token at chain position ``j`` is accepted, given that the positions before
    it were, by position (the last bucket holding every later one) and by the drafter's own probability of the token
    (``bins`` equal bins): accepted / seen per cell, shrunk towards the drafter's probability by ``prior_weight``
    tokens."""

    bins: int = 10
    positions: int = 4
    prior_weight: float = 4.0
    seen: dict[tuple[int, int], float] = field(default_factory=dict)
    accepted: dict[tuple[int, int], float] = field(default_factory=dict)

    def _cell(self, position: int, prob: float) -> tuple[int, int]:
        return min(position, self.positions - 1), min(int(prob * self.bins), self.bins - 1)

    def prob(self, position: int, prob: float) -> float:
        cell = self._cell(position, prob)
        w = self.prior_weight
        return (self.accepted.get(cell, 0.0) + w * prob) / (self.seen.get(cell, 0.0) + w)

    def probs(self, confidences: Sequence[float]) -> list[float]:
        return [self.prob(j, c) for j, c in enumerate(confidences)]

    def record(self, confidences: Sequence[float], accepted: int, observed: int) -> None:
        """The chain's first ``accepted`` tokens were accepted; of its first ``observed`` positions, those past them
        were not seen accepted (``observed`` = ``accepted`` + 1 when the next one was rejected, ``accepted`` when what
        followed is unknown)."""
        for j, c in enumerate(confidences[:observed]):
            cell = self._cell(j, c)
            self.seen[cell] = self.seen.get(cell, 0.0) + 1.0
            self.accepted[cell] = self.accepted.get(cell, 0.0) + float(j < accepted)


def expected_prefix(probs: Sequence[float], curve: CostCurve) -> tuple[int, float]:
    """The chain prefix length n (0 ... len(probs)) with the most expected tokens per verify cost, (1 + the
    expected accepted drafted tokens) / cost(1 + n), and its expected accepted drafted tokens. ``probs``: each
    token's chance of being accepted given that the ones before it were."""
    return best_prefix(list(accumulate(probs, operator.mul)), curve)


def best_prefix(cumulative: Sequence[float], curve: CostCurve) -> tuple[int, float]:
    """:func:`expected_prefix` for a chain given by each token's chance of being accepted with all before it: the
    prefix length with the most (1 + expected accepted tokens) per verify cost, and those expected tokens."""
    best_n, best_expected, best_rate = 0, 0.0, 1.0 / curve.cost(1)
    expected = 0.0
    for n, p in enumerate(cumulative, start=1):
        expected += p
        rate = (1.0 + expected) / curve.cost(1 + n)
        if rate > best_rate:
            best_n, best_expected, best_rate = n, expected, rate
    return best_n, best_expected


def matched(chain: Sequence[int], target: Sequence[int]) -> tuple[int, int]:
    """What greedy verification would have accepted of ``chain`` where the target's own next tokens were ``target``
    (the accepted tokens and the bonus token): (accepted, observed), ``observed`` as in
    :meth:`ChainCalibration.record` (a chain that agrees with all of ``target`` and goes on is cut there)."""
    n = 0
    while n < len(chain) and n < len(target) and chain[n] == target[n]:
        n += 1
    rejected = n < len(chain) and n < len(target)
    return n, n + int(rejected)


@dataclass
class Splice:
    """A trained chain's first ``m`` tokens followed by the suffix drafter's continuation of them (``plan``'s
    chosen branch, found as if those tokens were accepted: :meth:`selfspec.decode.suffix.SuffixDrafter.rank_after`)."""

    rate: float  # (1 + its expected accepted tokens) / the verify cost of the whole chain
    m: int
    tokens: list[int]  # the whole chain: the trained tokens, then the continuation
    plan: SuffixPlan


@dataclass
class _Sent:
    """What a request was sent last step: the trained and suffix chains (whichever was sent, ``kind``)."""

    kind: str  # "trained", "suffix", "spliced" (:class:`Splice`) or "" (nothing)
    length: int  # the chain's tokens, as chosen
    sent: int  # the tokens sent: fewer or more where the curve's exploration cut or padded it (HybridRows.sent_chain)
    trained: list[int]
    confidences: list[float]
    suffix: SuffixPlan | None
    suffix_tokens: list[int]
    splice: Splice | None = None  # the spliced chain, when it was sent


@dataclass
class Pending:
    """A request's step between its suffix plan and the choice (:meth:`HybridRows.prepare`)."""

    request: str
    plan: SuffixPlan
    suffix_tokens: list[int]
    suffix_rate: float  # (1 + its expected accepted tokens) / the verify cost of its chain
    row: Any = None  # the request's suffix row (serve/vllm_suffix.py), whose drafter continues a trained chain
    continuing: bool = False  # the request was drafted for last step too


class HybridRows:
    """The hybrid's choice per request and its learning, apart from vLLM (tests drive it with plain lists).

    Each step, per batch row: :meth:`prepare` learns from the row's last chain and plans the suffix drafter's;
    :meth:`needs_trained` says whether the trained drafter could beat that plan at all (when no row's can, the
    proposer does not run it); :meth:`choose` returns the chain to send. :meth:`step` is the three for one row."""

    def __init__(self, k: int, max_model_len: int, curve: CostCurve | MeasuredCurve, remember: int = 200_000,
                 max_match: int = 24):
        self.k, self.curve = k, measured(curve, k + 1)
        self.splice = os.environ.get(SPLICE_ENV, "1") != "0"  # the spliced chain is weighed too (:meth:`spliced`)
        self.suffix = SuffixProposer.standalone(k, max_model_len, self.curve, remember=remember, max_match=max_match)
        self.calibration = ChainCalibration()
        self.sent: dict[str, _Sent] = {}
        # chains sent, by kind; "skipped": rows on steps where no row needed the trained chain, so it did not run
        self.counts = {"trained": 0, "suffix": 0, "spliced": 0, "": 0, "skipped": 0}
        self.seconds = 0.0  # spent in the trained drafter (vLLM's proposer), all steps
        self.propose_seconds = 0.0  # spent in the whole proposer: the suffix plans, the trained drafter, the choice
        self.steps = 0  # proposer calls
        # what running the trained drafter is worth and costs (needs_trained): its chain's rate (or its spliced
        # chain's) each time it ran, and the recent seconds of a step that ran it, of one that skipped it, and of one
        # verify cost unit
        self.trained_rates: deque[float] = deque(maxlen=RATE_SAMPLES)
        self._ran_s: deque[float] = deque(maxlen=TIME_SAMPLES)
        self._skipped_s: deque[float] = deque(maxlen=TIME_SAMPLES)
        self._unit_s: deque[float] = deque(maxlen=TIME_SAMPLES)
        self._cost: float | None = None  # drafter_cost(), measured once a step (timed)

    def step(self, i: int, request: str, history: list[int], new: list[int], trained: list[int],
             confidences: list[float], greedy: bool) -> list[int]:
        """Batch row ``i`` holds ``request`` whose tokens so far are ``history`` (prompt and answer, the ``new``
        tokens of this step last); the trained drafter proposed ``trained`` with ``confidences``: the chain to
        send."""
        return self.choose(self.prepare(i, request, history, new, greedy), trained, confidences)

    def prepare(self, i: int, request: str, history: list[int], new: list[int], greedy: bool) -> Pending:
        row = self.suffix.row(i, history, len(new))
        last = self.sent.pop(request, None)
        if last is not None and new:
            self._learn(last, new, row, greedy)
        row.history = history
        plan = self.suffix.plan(row)
        tokens = [plan.cands.tokens[n] for n in plan.chosen]
        return Pending(request, plan, tokens, (1.0 + plan.expected) / self.curve.cost(1 + len(tokens)), row,
                       last is not None)

    def trained_bound(self, n: int) -> float:
        """The most tokens per verify cost any chain of ``n`` trained tokens could be expected to give: at each
        position the calibration's best bin, at the top of its range (:func:`expected_prefix` grows with every
        probability, so no confidences the drafter could give beat it)."""
        cal = self.calibration
        best = [max(cal.prob(j, min((b + 1) / cal.bins, 1.0)) for b in range(cal.bins)) for j in range(n)]
        m, expected = expected_prefix(best, self.curve)
        return (1.0 + expected) / self.curve.cost(1 + m)

    def timed(self, ran: bool, drafter_s: float, unit_s: float | None = None) -> None:
        """One step's times: ``drafter_s`` in the trained drafter (``ran``: it drafted; else its skip path) and, when
        known, ``unit_s``, the seconds of one verify cost unit (the step's period less the drafter, over the verify
        cost of the longest chain sent the step before)."""
        (self._ran_s if ran else self._skipped_s).append(drafter_s)
        if unit_s is not None and unit_s > 0:
            self._unit_s.append(unit_s)
        if self._ran_s and self._unit_s:
            skipped = statistics.median(self._skipped_s) if self._skipped_s else 0.0
            self._cost = max(0.0, statistics.median(self._ran_s) - skipped) / statistics.median(self._unit_s)

    def drafter_cost(self) -> float | None:
        """What drafting with the trained drafter adds to a step over its skip path, in verify cost units (the
        medians of recent steps, taken once a step by :meth:`timed`); None until a step that ran it and the cost
        unit are timed."""
        return self._cost

    def needs_trained(self, pending: Pending, n: int) -> bool:
        """Whether running the trained drafter for ``n`` tokens is expected to pay over ``pending``'s suffix chain.

        Never where no trained chain it could give would be chosen (:meth:`trained_bound`; a spliced chain is not
        bounded there: beside a suffix chain that strong, the suffix drafter's continuation of a trained token seldom
        beats the suffix chain itself). Past that, once its chain's rate (or its spliced chain's, the better)
        has been seen on :data:`RATE_WARMUP` steps and its time measured: where what those rates would add to the
        suffix chain's (their mean of max(trained rate - suffix rate, 0): the better chain is sent) beats what the
        drafter's own time takes away, ``suffix rate * drafter cost / the suffix chain's verify cost``. (On code,
        where the suffix chain is long, a drafter that costs a tenth of a step and seldom beats it is not run.)"""
        rate = pending.suffix_rate
        if pending.suffix_tokens and self.trained_bound(n) < rate:
            return False
        cost = self.drafter_cost()
        if len(self.trained_rates) < RATE_WARMUP or cost is None:
            return True
        gain = sum(max(r - rate, 0.0) for r in self.trained_rates) / len(self.trained_rates)
        return gain > rate * cost / self.curve.cost(1 + len(pending.suffix_tokens))

    def choose(self, pending: Pending, trained: list[int] | None, confidences: list[float] | None) -> list[int]:
        """The chain to send for ``pending``'s request: the suffix drafter's, the trained drafter's prefix or the
        spliced chain (:meth:`spliced`), whichever has the most expected tokens per verify cost. ``trained=None``: the
        trained drafter did not run this step."""
        trained, confidences = list(trained or []), list(confidences or [])
        probs = self.calibration.probs(confidences)
        n, trained_expected = expected_prefix(probs, self.curve)
        trained_rate = (1.0 + trained_expected) / self.curve.cost(1 + n)
        splice = self.spliced(pending, trained, probs) if trained and self.splice else None
        if trained:
            self.trained_rates.append(max(trained_rate, splice.rate if splice else 0.0))
        suffix_rate = pending.suffix_rate if pending.suffix_tokens else 0.0
        if splice is not None and splice.rate > max(suffix_rate, trained_rate):
            kind, chain = "spliced", splice.tokens
        elif suffix_rate > trained_rate:
            kind, chain, splice = "suffix", pending.suffix_tokens, None
        elif n:
            kind, chain, splice = "trained", trained[:n], None
        else:
            kind, chain, splice = "", [], None
        self.counts[kind] += 1
        plan = pending.plan
        self.sent[pending.request] = _Sent(kind, len(chain), len(chain), trained, confidences,
                                           plan if plan.chosen else None, pending.suffix_tokens, splice)
        return list(chain)

    def sent_chain(self, begun: float, pending: Sequence[Pending | None], chains: list[list[int]]) -> list[list[int]]:
        """The step's chains (:meth:`choose`'s, one per batch row) as sent, in a step whose ``propose`` call began at
        ``begun``: where the batch holds one request, the curve times the engine's last step and may explore, cutting
        or padding its chain (:meth:`MeasuredCurve.step`), and the request remembers how much of it was sent, so that
        only what was verified learns."""
        one = pending[0] if len(pending) == 1 else None
        if one is None:
            self.curve.step(begun, None, False, 0)
            return chains
        chains[0] = self.curve.step(begun, chains[0], one.continuing, one.row.history[-1])
        self.sent[one.request].sent = len(chains[0])
        return chains

    def spliced(self, pending: Pending, trained: list[int], probs: Sequence[float]) -> Splice | None:
        """The best chain that starts with the trained chain's first m tokens and goes on with what the suffix
        drafter finds after them (m = 1 ... len(trained)), cut to the prefix with the most expected tokens per
        verify cost; None where no such chain is longer than its trained part. Its tokens are worth the trained
        tokens' calibrated chances (``probs``, each given the ones before) and then the suffix drafter's calibrated
        chances for what follows, given that the trained ones are accepted."""
        drafter = getattr(pending.row, "drafter", None)
        if drafter is None:
            return None
        best: Splice | None = None
        alive, cumulative = 1.0, []
        for m in range(1, min(len(trained), self.k - 1) + 1):
            alive *= probs[m - 1]
            cumulative.append(alive)
            ranking = drafter.rank_after(trained[:m], self.k - m)
            branch = ranking.ranked[: self.k - m]
            if not branch:
                continue
            length, expected = best_prefix(cumulative + [alive * ranking.probs[node] for node in branch], self.curve)
            if length <= m:
                continue
            rate = (1.0 + expected) / self.curve.cost(1 + length)
            if best is None or rate > best.rate:
                chosen = branch[: length - m]
                plan = SuffixPlan(ranking.bucket, ranking.cands, chosen, ranking.depths,
                                  expected=sum(ranking.probs[node] for node in chosen))
                best = Splice(rate, m, trained[:m] + [ranking.cands.tokens[node] for node in chosen], plan)
        return best

    def _learn(self, last: _Sent, new: list[int], row: Any, greedy: bool) -> None:
        """Both chains learn from this step's tokens. Under greedy decoding the target's own tokens say how far
        either chain would have been accepted (:func:`matched`), so the one not sent learns too; under sampling only
        the chain sent learns, from what vLLM accepted of it."""
        accepted = len(new) - 1
        splice = last.splice
        if greedy:
            if last.trained:
                self.calibration.record(last.confidences, *matched(last.trained, new))
            if last.suffix is not None:
                row.drafter.record(last.suffix, *matched(last.suffix_tokens, new))
            if splice is not None and matched(splice.tokens[:splice.m], new)[0] == splice.m:
                row.drafter.record(splice.plan, *matched(splice.tokens[splice.m:], new[splice.m:]))
        elif splice is not None:  # the trained part learns up to what was seen of it, the continuation if reached
            n = min(accepted, splice.m)
            self.calibration.record(last.confidences, n, min(accepted + 1, splice.m, last.sent))
            if accepted >= splice.m:
                record_chain(row.drafter, splice.plan, accepted - splice.m, last.sent - splice.m)
        elif last.kind == "trained":
            n = min(accepted, last.length)
            self.calibration.record(last.confidences, n, min(n + 1, last.length, last.sent))
        elif last.kind == "suffix" and last.suffix is not None:
            record_chain(row.drafter, last.suffix, accepted, last.sent)

    def finish(self, live: set[str]) -> None:
        """Forget what was sent to requests no longer in the batch."""
        for request in [r for r in self.sent if r not in live]:
            del self.sent[request]


COUNTS_RPC = "selfspec_hybrid_counts"
TRAINED_TOKENS_ENV = "SELFSPEC_VLLM_HYBRID_TRAINED"  # tokens an EAGLE-3 drafter drafts a step (default below)
EAGLE_TRAINED_TOKENS = 3  # an EAGLE-3 drafter's chain when not told (scripts/bench.py's vllm_speculative_tokens)


def trained_tokens(method: str, draft_config: Any, k: int) -> int:
    """How many tokens the trained drafter drafts a step inside vLLM's ``num_speculative_tokens`` = ``k`` (the
    longest chain the hybrid sends, the suffix drafter's): a DFlash drafter its own block less its first slot (vLLM
    fills 1 + n query slots of a block that attends non-causally, so another length drafts other tokens than the block
    it was trained on); an EAGLE-3 drafter ``$SELFSPEC_VLLM_HYBRID_TRAINED``, else :data:`EAGLE_TRAINED_TOKENS`;
    never more than ``k``."""
    if method == "dflash":
        block = getattr(draft_config, "block_size", None) or (getattr(draft_config, "dflash_config", None) or {}).get(
            "block_size")
        n = int(block) - 1 if block else k
    else:
        n = int(os.environ.get(TRAINED_TOKENS_ENV) or EAGLE_TRAINED_TOKENS)
    return max(1, min(n, k))


class HybridHook:
    """vLLM's ``worker_extension_cls``: importing this module installs the hybrid proposers. Its one method, called
    with ``llm.collective_rpc("selfspec_hybrid_counts")``, reports how many chains each drafter sent so far
    (``skipped``: rows on steps where the trained drafter did not run; ``trained_ms``: the time it did, its
    context store on skipped steps included; ``propose_ms``: the whole proposer's, over ``steps`` calls;
    ``drafter_cost_pct``: what drafting adds to a step, in percent of one verify cost unit, as last measured;
    ``cost_curve``: the verify cost of each chain length measured so far, {tokens verified: cost relative to one},
    from ``timed_steps`` steps)."""

    def selfspec_hybrid_counts(self) -> dict[str, Any]:
        rows = getattr(self.model_runner.drafter, "_rows", None)
        if rows is None:
            raise RuntimeError("selfspec's hybrid proposer is not this engine's drafter (speculative_config method "
                               f"must be one of {', '.join(METHODS)}).")
        cost = rows.drafter_cost()
        curve = rows.curve
        return {**rows.counts, "trained_ms": round(rows.seconds * 1000),
                "propose_ms": round(rows.propose_seconds * 1000), "steps": rows.steps,
                "drafter_cost_pct": None if cost is None else round(100 * cost),
                "cost_curve": {n: round(curve.measured[n], 3) for n in sorted(curve.measured)},
                "timed_steps": sum(len(t) for t in curve.times.values())}


def _hybrid(base: type) -> type:
    """``base`` (vLLM's EagleProposer or DFlashProposer) drafting as the hybrid when its engine names :data:`HOOK`."""
    class Hybrid(base):  # type: ignore[misc, valid-type]
        def __init__(self, vllm_config: Any, device: Any, runner: Any = None):
            super().__init__(vllm_config, device, runner)
            self._rows: HybridRows | None = None
            if getattr(vllm_config.parallel_config, "worker_extension_cls", None) != HOOK:
                return  # an engine that did not ask for the hybrid: vLLM's own proposer
            spec = vllm_config.speculative_config
            if spec.method not in METHODS:  # EAGLE-1's proposer; other methods: the runner's check (install)
                raise ValueError(f"selfspec's hybrid proposer extends vLLM's {' and '.join(METHODS)} proposers, not "
                                 f"{spec.method!r}: export the heads with format=eagle3 or dflash.")
            if getattr(self, "use_local_argmax_reduction", False):
                raise ValueError("selfspec's hybrid proposer needs the drafter's logits; this vLLM reduces them "
                                 "across tensor-parallel ranks (use_local_argmax_reduction): serve it with "
                                 "tensor_parallel_size=1.")
            k = int(spec.num_speculative_tokens)
            self._own_k = trained_tokens(spec.method, spec.draft_model_config.hf_config, k)
            self._rows = HybridRows(k, int(vllm_config.model_config.max_model_len), engine_curve(k))
            self._confidences: list[torch.Tensor] = []
            self._last: tuple[float, float, float] | None = None  # the last step's start, drafter seconds, cost
            self._sampled: Any = None
            self._discard: Any = None
            self._batch: Any = None

        def prepare_next_token_ids_padded(self, sampled_token_ids, requests, input_batch, discard_request_mask):
            if self._rows is not None:
                self._sampled, self._batch, self._discard = sampled_token_ids, input_batch, discard_request_mask
            return super().prepare_next_token_ids_padded(sampled_token_ids, requests, input_batch,
                                                         discard_request_mask)

        def _greedy_sample(self, hidden_states):
            if self._rows is None:
                return super()._greedy_sample(hidden_states)
            logits = self.model.compute_logits(hidden_states)
            if self.use_heterogeneous_vocab:
                logits = self.vocab_mapping.constrain_draft_logits(logits)
            ids = logits.argmax(dim=-1)  # vLLM's own draft, unchanged
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            self._confidences.append(probs)
            if self.use_heterogeneous_vocab:
                ids = self.vocab_mapping.map_draft_to_target_ids(ids)
            return ids

        def propose(self, *args, **kwargs):
            if self._rows is None:
                return super().propose(*args, **kwargs)
            if args:
                raise RuntimeError("selfspec's hybrid proposer needs vLLM's runner to pass propose() its inputs by "
                                   "name, as vLLM 0.32's does (.ci/vllm-constraints.txt).")
            if self._batch is None:
                raise RuntimeError("selfspec's hybrid proposer needs vLLM's padded drafter batch "
                                   "(speculative_config disable_padded_drafter_batch=false).")
            rows = self._rows
            begun = time.perf_counter()
            greedy = bool(getattr(kwargs.get("sampling_metadata"), "all_greedy", False))
            own_k = min(int(kwargs.get("num_speculative_tokens", 0)), self._own_k)
            kwargs["num_speculative_tokens"] = own_k  # the trained drafter's own length; the suffix's: k
            pending = self._prepare(greedy)
            self._confidences = []
            start = time.perf_counter()
            ran = any(p is not None and rows.needs_trained(p, own_k) for p in pending)
            if not ran:
                rows.counts["skipped"] += sum(p is not None for p in pending)
                self._without_chain(kwargs)  # no row's chain pays for the trained drafter: only its cache is kept
                trained, confidences = None, None
            else:
                drafts = super().propose(**kwargs)
                trained, confidences = self._drafted(drafts)
            drafter_s = time.perf_counter() - start
            rows.seconds += drafter_s
            out = []
            for i, p in enumerate(pending):
                out.append([] if p is None else rows.choose(
                    p, None if trained is None else trained[i], None if confidences is None else confidences[i]))
            rows.finish(set(self._batch.req_ids[:len(pending)]))
            out = rows.sent_chain(begun, pending, out)
            # a decode step's period, less the drafter's part, over the verify cost of the chains sent the step before
            unit = None
            if self._last is not None and all(p is not None for p in pending):
                last_begun, last_drafter_s, last_cost = self._last
                unit = (begun - last_begun - last_drafter_s) / last_cost
            rows.timed(ran, drafter_s, unit)
            self._last = (begun, drafter_s, rows.curve.cost(1 + max((len(c) for c in out), default=0)))
            rows.steps += 1
            rows.propose_seconds += time.perf_counter() - begun
            return out

        def _prepare(self, greedy: bool) -> list[Pending | None]:
            """Each batch row's suffix plan (None for a row with no token this step: a prefill chunk)."""
            batch, rows = self._batch, self._rows
            sampled = self._sampled.cpu().tolist()
            n_rows = len(sampled)
            discard = self._discard[:n_rows].cpu().tolist() if self._discard is not None else [False] * n_rows
            pending: list[Pending | None] = []
            for i in range(n_rows):
                new = []
                for t in sampled[i]:
                    if t < 0:
                        break
                    new.append(int(t))
                if discard[i] or not new:
                    pending.append(None)
                    continue
                n = int(batch.num_tokens_no_spec[i])
                history = [int(t) for t in batch.token_ids_cpu[i, :n]] + new
                pending.append(rows.prepare(i, batch.req_ids[i], history, new, greedy))
            return pending

        def _drafted(self, drafts) -> tuple[list[list[int]], list[list[float]]]:
            """The trained chains vLLM's proposer drafted, and each token's probability under the drafter."""
            n_rows, k = drafts.shape
            trained = drafts.cpu().tolist()
            if not self._confidences or k == 0:
                confidences = [[0.0] * k for _ in range(n_rows)]
            elif len(self._confidences) == 1:  # parallel drafting (DFlash) or one token: every position at once
                confidences = self._confidences[0].view(n_rows, k).cpu().tolist()
            else:
                confidences = torch.stack(self._confidences, dim=1).cpu().tolist()
            return trained, confidences

        def _without_chain(self, kwargs: dict) -> None:
            """A step on which the trained drafter drafts nothing, but keeps what later steps read. DFlash: the
            context keys and values of this step's target hidden states are stored, as vLLM's ``propose`` stores
            them before its query forward, and the query forward is not run. EAGLE-3: its first forward writes the
            drafter's own cache of these positions, so it runs, for one token (the rest of its chain does not)."""
            self._last_draft_probs = None
            if self.method != "dflash":
                super().propose(**{**kwargs, "num_speculative_tokens": 1})
                return
            self.num_speculative_tokens = kwargs["num_speculative_tokens"]
            hidden = self.model.combine_hidden_states(kwargs["target_hidden_states"])
            num_tokens, _, _ = self.set_inputs_first_pass(
                target_token_ids=kwargs["target_token_ids"], next_token_ids=kwargs["next_token_ids"],
                target_positions=kwargs["target_positions"], target_hidden_states=hidden,
                token_indices_to_sample=kwargs.get("token_indices_to_sample"),
                cad=kwargs["common_attn_metadata"], num_rejected_tokens_gpu=kwargs.get("num_rejected_tokens_gpu"))
            self.build_model_inputs_first_pass(num_tokens, num_tokens, None)  # stores the context keys and values

    Hybrid.__name__ = Hybrid.__qualname__ = f"Hybrid{base.__name__}"
    return Hybrid


def install() -> bool:
    """Replace vLLM's V1 model runner's EAGLE and DFlash proposers by their hybrid subclasses (once); False where
    vLLM is not importable (selfspec's own venv)."""
    try:
        # deferred: vLLM is only in its own venv, where this runs
        import vllm.v1.worker.gpu_model_runner as runner
    except ImportError:
        return False
    if getattr(runner, "_selfspec_hybrid", False):
        return True
    missing = [name for name in ("EagleProposer", "DFlashProposer") if not hasattr(runner, name)]
    if missing:
        raise ImportError(f"selfspec's hybrid proposer: this vLLM's model runner has no {', '.join(missing)}; it "
                          "needs vLLM 0.32's V1 runner (.ci/vllm-constraints.txt).")
    runner.EagleProposer = _hybrid(runner.EagleProposer)
    runner.DFlashProposer = _hybrid(runner.DFlashProposer)
    built = runner.GPUModelRunner.__init__

    def init(self, vllm_config, *args, **kwargs):  # an engine that names the hook drafts with the hybrid, or fails
        built(self, vllm_config, *args, **kwargs)
        spec = vllm_config.speculative_config
        if vllm_config.parallel_config.worker_extension_cls == HOOK and (spec is None or spec.method not in METHODS):
            raise ValueError(f"selfspec's hybrid proposer ({HOOK}) extends vLLM's {' and '.join(METHODS)} "
                             f"proposers; this engine's speculative method is {getattr(spec, 'method', None)!r}: "
                             "export the heads with format=eagle3 or dflash and name that method.")

    runner.GPUModelRunner.__init__ = init
    runner._selfspec_hybrid = True
    return True


install()
