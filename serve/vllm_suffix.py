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
- **The verify cost** of a chain in vLLM is not measured inside vLLM: ``$SELFSPEC_VLLM_COST_CURVE`` gives it (a JSON
  object {nodes: cost relative to one}); bench/vllm.py passes selfspec's measured curve for the same model
  (vLLM's kernels differ, so that curve is an approximation). Without it, verifying up to 4 tokens is taken to cost
  what one does, then 10% more per token.
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
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from selfspec.decode.adaptive import CostCurve
from selfspec.decode.suffix import SuffixDrafter, SuffixPlan

COST_CURVE_ENV = "SELFSPEC_VLLM_COST_CURVE"


def record_chain(drafter: SuffixDrafter, plan: SuffixPlan, accepted: int) -> None:
    """``plan``'s chain was verified and its first ``accepted`` tokens accepted: the depths up to the first rejected
    one learn (all of them when the whole chain was accepted)."""
    drafter.record(plan, accepted, min(accepted + 1, len(plan.chosen)))


def default_curve(k: int) -> CostCurve:
    return CostCurve.from_relative({n: 1.0 if n <= 4 else 1.0 + 0.1 * (n - 4) for n in range(1, max(k, 4) + 2)})


def curve_from_env(k: int) -> CostCurve:
    text = os.environ.get(COST_CURVE_ENV)
    if not text:
        return default_curve(k)
    return CostCurve.from_relative({int(n): float(c) for n, c in json.loads(text).items()})


@dataclass
class _Row:
    history: list[int]  # prompt + answer so far, as last seen
    prompt_length: int
    drafter: SuffixDrafter
    plan: SuffixPlan | None = None  # the chain last proposed, to learn from what vLLM accepted


class SuffixProposer:
    """One :class:`selfspec.decode.suffix.SuffixDrafter` per batch row, sharing what the rows answered before."""

    def __init__(self, vllm_config: Any, remember: int = 200_000, max_match: int = 24):
        spec = vllm_config.speculative_config
        k = int(spec.num_speculative_tokens)
        self._setup(k, int(vllm_config.model_config.max_model_len), curve_from_env(k), remember, max_match)

    @classmethod
    def standalone(cls, k: int, max_model_len: int, curve: CostCurve, remember: int = 200_000,
                   max_match: int = 24) -> "SuffixProposer":
        """The proposer without a vLLM config (the hybrid's suffix part, serve/vllm_hybrid.py)."""
        out = cls.__new__(cls)
        out._setup(k, max_model_len, curve, remember, max_match)
        return out

    def _setup(self, k: int, max_model_len: int, curve: CostCurve, remember: int, max_match: int) -> None:
        self.k, self.max_model_len, self.curve = k, max_model_len, curve
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
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or n >= self.max_model_len:
                drafts.append([])
                continue
            history = [int(t) for t in token_ids_cpu[i, :n]]
            row = self.row(i, history, len(sampled))
            if row.plan is not None and history[: len(row.history)] == row.history:
                record_chain(row.drafter, row.plan, len(sampled) - 1)
            row.history = history
            plan = self.plan(row)
            row.plan = plan if plan.chosen else None  # kept to learn from what vLLM accepts
            drafts.append([plan.cands.tokens[n] for n in plan.chosen])
        return drafts

    def plan(self, row: _Row) -> SuffixPlan:
        """The row's drafter's plan for its history, one chain (``SuffixDrafter(chain=True)``)."""
        state = SimpleNamespace(prompt_length=row.prompt_length, new_tokens=row.history[row.prompt_length:])
        return row.drafter.plan(state, self.k)
