"""The benchmark's run (scripts/bench.py's body): every method on each prompt in turn, every output checked token by
token against HF generate's."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from selfspec.bench.cost import cost_curves, draft_step_cost
from selfspec.bench.early_exit import choose_early_exit, early_exit_candidates
from selfspec.bench.figures import source_groups, summarize_runs
from selfspec.bench.methods import Method, build_methods, heads_folders, load_sessions, method_names, vllm_methods
from selfspec.bench.prompts import first_turn_ids, load_prompts
from selfspec.bench.report import machine_info, write_outputs
from selfspec.bench.vllm import VLLM_METHODS
from selfspec.decode.prompts import prompt_ids
from selfspec.decode.session import Session
from selfspec.decode.settings import required
from selfspec.decode.types import DecodeSetupError
from selfspec.core.config import to_dict
from selfspec.core.folders import claim


def first_difference(reference: list[int], tokens: list[int]) -> int | None:
    """The first position where ``tokens`` differs from ``reference`` (a missing token counts); None if equal."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def check_lossless(results: dict[str, dict], where: dict) -> list[dict]:
    """Every method's tokens against HF generate's (``results["hf"]``): one record per method that differs."""
    reference = results["hf"]["tokens"]
    found = []
    for name, r in results.items():
        pos = first_difference(reference, r["tokens"])
        if pos is None:
            continue
        at = lambda toks: toks[pos] if pos < len(toks) else None  # noqa: E731
        found.append({"method": name, **where, "position": pos, "hf_token": at(reference),
                      "method_token": at(r["tokens"]), "hf_length": len(reference), "method_length": len(r["tokens"])})
        tqdm.write(f"LOSSLESSNESS MISMATCH: {name} on question {where['question_id']} turn {where['turn']}: first "
                   f"difference at new token {pos}: HF generate {at(reference)}, {name} {at(r['tokens'])}",
                   file=sys.stderr)
    return found


def run_prompts(methods: list[Method], questions: list[dict], second_turns: bool, lossless: bool,
                progress: bool = True, fresh: bool = False) -> tuple[list[dict], list[dict]]:
    """Every method on each prompt in turn (all methods on prompt 1, then on prompt 2, ...); second turns carry HF
    generate's first answer as the assistant turn. ``fresh``: each engine method gets a new decoder for every
    question (its turns share it), as a process that answers one question starts. Returns the per-run records and
    the losslessness mismatches."""
    base = methods[0].session
    tokenizer, s = base.target.tokenizer, base.settings
    turns = [q["turns"][:2 if second_turns else 1] for q in questions]
    bar = tqdm(total=sum(map(len, turns)) * len(methods), desc="bench", unit="run", disable=not progress)
    records, mismatches = [], []
    for q, q_turns in zip(questions, turns):
        if fresh:
            for m in methods:
                m.fresh()
        messages: list[dict] = []
        for turn, text in enumerate(q_turns, start=1):
            messages.append({"role": "user", "content": text})
            ids = prompt_ids(tokenizer, messages, s.chat, s.system_prompt)
            where = {"question_id": q.get("question_id"), "category": q["category"], "turn": turn,
                     "source": q.get("source")}
            results = {}
            for m in methods:
                bar.set_postfix_str(m.name)
                results[m.name] = {**m.run(ids), **where, "prompt_tokens": len(ids)}
                bar.update()
            if lossless:
                mismatches += check_lossless(results, where)
            hf_answer = tokenizer.decode(results["hf"]["tokens"], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": hf_answer})
            records += [{k: v for k, v in r.items() if k != "tokens"} for r in results.values()]
    bar.close()
    return records, mismatches


BENCH_KEYS = ("methods", "prompts", "limit", "per_category", "heads", "prompt_lookup_num_tokens", "draft",
              "early_exit_sweep_prompts", "early_exit_layers", "early_exit_generate", "second_turns", "fresh", "out",
              "vllm_rounds")


def rounds_of(questions: list[dict], rounds: int) -> list[list[dict]]:
    """``questions`` in ``rounds`` runs of consecutive questions, as even as can be (at most one round a question)."""
    if rounds < 1:
        raise DecodeSetupError(f"vllm_rounds={rounds}: give 1 (vLLM's rows all before the others) or more.")
    n, r = len(questions), min(rounds, len(questions))
    return [questions[i * n // r:(i + 1) * n // r] for i in range(r)]


def run_bench(cfg: Any, command: str = "", progress: bool = True) -> dict:
    """scripts/bench.py's body over a composed conf/decode/bench.yaml: load, warm up, choose the early-exit layer,
    measure the verify cost curve, run every method on every prompt, write the outputs to ``out``. Returns the
    report (``report["mismatches"]`` non-empty: a method is not lossless)."""
    c = required(cfg, BENCH_KEYS)
    names = method_names(c["methods"])
    questions = load_prompts(c["prompts"], c["limit"], c["per_category"])
    folders = heads_folders(c["heads"]) if {"heads", "hybrid", "vllm_heads", "vllm_hybrid"} & set(names) else []
    # before anything loads: a folder of the user's at out is refused (or moved to a backup with overwrite=true)
    claim(Path(str(c["out"])), "bench", bool(cfg.get("overwrite", False)), setting="out")
    base, sessions = load_sessions(cfg, folders)
    methods = build_methods(base, sessions, names, int(c["prompt_lookup_num_tokens"]), to_dict(c["draft"]))
    rounds = rounds_of(questions, int(c["vllm_rounds"])) if set(names) & set(VLLM_METHODS) else [questions]
    log = "vllm.log" if len(rounds) == 1 else "vllm-round1.log"
    not_run: dict[str, str] = {}  # vLLM rows that did not load, with vLLM's error
    methods += vllm_methods(cfg, base, sessions, folders, names, rounds[0], log_name=log, not_run=not_run)
    early_exit = _warm_up(methods, base, questions, c)
    s, param = base.settings, next(base.target.model.parameters())
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": command,
              "machine": machine_info(param.device), "target": base.target.name, "dtype": str(param.dtype),
              "settings": {"prompts": str(c["prompts"]), "questions": len(questions),
                           "second_turns": bool(c["second_turns"]), "fresh": bool(c["fresh"]),
                           "vllm_rounds": len(rounds),
                           **{k: getattr(s, k) for k in ("max_new_tokens", "stop", "seed", "chat", "system_prompt")},
                           "acceptance": base.sampling.acceptance, "linear_kernel": base.decoder.linear_kernel,
                           "heads": heads_folders(c["heads"])},
              "methods": {m.name: {"engine": m.engine, **m.info} for m in methods}, "early_exit": early_exit,
              "verify_cost": cost_curves(base, cfg), "vllm_not_run": not_run}
    first = first_turn_ids(base, questions[0])
    report["draft_cost"] = {m.name: draft_step_cost(m, first) for m in methods if m.engine}
    lossless = base.sampling.acceptance == "greedy"
    records, mismatches = [], []
    vllm_rows = [m for m in methods if m.results is not None]
    for i, group in enumerate(rounds):
        if i and vllm_rows:  # vLLM's rows on this round's prompts, then the others (bench/vllm.py)
            vllm_methods(cfg, base, sessions, folders, names, group, log_name=f"vllm-round{i + 1}.log",
                         earlier=vllm_rows)
        found = run_prompts(methods, group, report["settings"]["second_turns"], lossless, progress,
                            fresh=bool(c["fresh"]))
        records, mismatches = records + found[0], mismatches + found[1]
    report["categories"], report["figures"] = summarize_runs(records, methods)
    report["sources"] = source_groups(records)
    report.update(lossless_checked=lossless, mismatches=mismatches, runs=records)
    report["outputs"] = [str(p) for p in write_outputs(report, Path(str(c["out"])))]
    return report


def _warm_up(methods: list[Method], base: Session, questions: list[dict], c: dict) -> dict | None:
    """One short run of each method before timing, hf_early_exit's after its layer is chosen (swept on the first
    ``early_exit_sweep_prompts`` prompts unless given); returns that choice (None without hf_early_exit)."""
    warm = first_turn_ids(base, {"turns": ["Hi"]})
    early_exit = None
    for m in methods:
        if m.name == "hf_early_exit":
            firsts = [first_turn_ids(base, q) for q in questions[:int(c["early_exit_sweep_prompts"])]]
            candidates = early_exit_candidates(base.target.model, c["early_exit_layers"])
            early_exit = choose_early_exit(m, candidates, firsts, to_dict(c["early_exit_generate"]))
        if m.results is None:  # vLLM's rows warmed up in their own process
            m.run(warm, max_new_tokens=8)
    return early_exit
