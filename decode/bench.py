"""Decoding benchmarks (the library behind scripts/bench_decode.py). Batch size 1.

- :func:`verify_cost_curve`: target forward time for a tree of 1..64 nodes on top of a filled KV cache: what a
  bigger tree costs on this machine (cheap to grow on a GPU until it is compute bound, expensive on a CPU).
- :func:`compare_on_prompts`: tree decoding, plain decoding in the same engine, and Hugging Face ``generate`` on the
  same prompt ids in one run: tau, tokens/s, speedup, and whether greedy outputs agree.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from tqdm.auto import tqdm

from decode.cache import new_cache
from decode.drafters import VanillaDrafter
from decode.engine import SpeculativeDecoder, tree_forward
from decode.kernels import small_batch_linears, use_small_batch
from decode.pipeline import Session, hf_generate, prompt_ids, warm_up
from decode.tree import Tree, load_tree
from decode.types import DecodeState, Draft
from heads.kv import crop_cache
from heads.target import cache_kwarg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def verify_cost_curve(
    model: torch.nn.Module,
    cache_length: int = 256,
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    repeats: int = 5,
    tree: Tree | None = None,
    linear_kernel: str = "torch",
) -> list[dict]:
    """Median time of one tree-verify forward of N nodes (the first N nodes of ``tree``, default mc_sim_7b_63 and
    chains beyond its size) over a ``cache_length`` cache, with the linear layers of ``linear_kernel`` (see
    decode.kernels). Returns [{"nodes", "ms", "ms_per_node"}]."""
    device = next(model.parameters()).device
    with small_batch_linears(model, enabled=use_small_batch(linear_kernel, device)):
        return _verify_cost_curve(model, device, cache_length, sizes, repeats, tree)


def _verify_cost_curve(model, device, cache_length, sizes, repeats, tree) -> list[dict]:
    vocab = model.config.get_text_config(decoder=True).vocab_size
    shape = tree or load_tree("mc_sim_7b_63")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (cache_length,), generator=g).to(device)
    cache = new_cache()
    model(input_ids=prompt[None], use_cache=True, **{cache_kwarg(model): cache})
    for n in (max(sizes), min(sizes)):  # warm up kernels and allocator on both ends of the curve
        state = DecodeState(cache=cache, prompt_ids=prompt, length=cache_length, next_token=0,
                            hidden=torch.empty(0, device=device))
        tokens = torch.zeros(n, dtype=torch.long, device=device)
        tree_forward(model, state, Draft(tokens=tokens, tree=Tree.from_parents(list(range(-1, n - 1))).to(device)))
        crop_cache(cache, cache_length)
    rows = []
    for n in sizes:
        parents = shape.parents[:n].tolist() if n <= shape.num_nodes else list(range(-1, n - 1))
        sub = Tree.from_parents(parents).to(device)
        tokens = torch.randint(0, vocab, (n,), generator=g).to(device)
        state = DecodeState(cache=cache, prompt_ids=prompt, length=cache_length, next_token=int(tokens[0]),
                            hidden=torch.empty(0, device=device))
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            tree_forward(model, state, Draft(tokens=tokens, tree=sub))
            _sync(device)
            times.append(time.perf_counter() - t0)
            crop_cache(cache, cache_length)
        ms = 1000 * statistics.median(times)
        rows.append({"nodes": n, "ms": ms, "ms_per_node": ms / n})
    return rows


def format_cost_curve(rows: list[dict], cache_length: int) -> str:
    base = rows[0]["ms"] if rows else 1.0
    lines = [f"verify cost: one target forward over N tree nodes, {cache_length}-token cache",
             f"{'nodes':>6} {'ms':>9} {'x 1 node':>9}"]
    lines += [f"{r['nodes']:>6} {r['ms']:>9.2f} {r['ms'] / base:>9.2f}" for r in rows]
    return "\n".join(lines)


def _new_way(steps: bool = True) -> dict:
    way = {"new_tokens": 0, "total_s": 0.0}
    if steps:
        way.update(steps=0, step_tokens=0, draft_s=0.0, verify_s=0.0, same_as_hf=0)
    return way


def compare_on_prompts(session: Session, questions: list[dict], warmup: bool = True,
                       others: dict[str, Session] | None = None, progress: bool = True) -> dict[str, dict]:
    """First turns of ``questions`` decoded with the same settings by the session's drafter ("tree"), by each of
    ``others`` (sessions with other heads on the same target, named by their keys), by plain decoding in the same
    engine ("vanilla") and by HF generate ("hf"), prompt by prompt in that order. Per way: tokens, time, tau,
    tokens/s, speedup over HF, and on how many prompts the tokens equal HF's."""
    s, tokenizer = session.settings, session.target.tokenizer
    vanilla = SpeculativeDecoder(session.target.model, VanillaDrafter(), eos_token_ids=session.decoder.eos_token_ids,
                                 decode=session.decoder.decode, linear_kernel=session.decoder.linear_kernel)
    others = dict(others or {})
    clash = {"tree", "vanilla", "hf", "agreement"} & set(others)
    if clash:
        raise ValueError(f"Names {sorted(clash)} are taken by the built-in ways; name the other heads differently.")
    if warmup:
        warm_up(session, baseline=True)
        for other in others.values():
            warm_up(other, baseline=False)
    decoders = {"tree": session.decoder, **{name: o.decoder for name, o in others.items()}, "vanilla": vanilla}
    ways = {name: _new_way() for name in decoders}
    ways["hf"] = _new_way(steps=False)
    for q in tqdm(questions, desc="prompts", unit="prompt", disable=not progress):
        ids = prompt_ids(tokenizer, [{"role": "user", "content": q["turns"][0]}], s["chat"], s["system_prompt"])
        outputs = {}
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
            outputs[name] = res.tokens
        hf_tokens, hf_s = hf_generate(session, ids)
        ways["hf"]["new_tokens"] += len(hf_tokens)
        ways["hf"]["total_s"] += hf_s
        for name, tokens in outputs.items():
            ways[name]["same_as_hf"] += tokens == hf_tokens
    for name, w in ways.items():
        w["tokens_per_s"] = w["new_tokens"] / w["total_s"] if w["total_s"] else 0.0
        if "steps" in w:
            w["tau"] = w["step_tokens"] / w["steps"] if w["steps"] else 0.0
    hf_rate = ways["hf"]["tokens_per_s"]
    for w in ways.values():
        w["speedup_vs_hf"] = w["tokens_per_s"] / hf_rate if hf_rate else 0.0
    ways["agreement"] = {"prompts": len(questions), "tree_equals_hf": ways["tree"]["same_as_hf"],
                         "vanilla_equals_hf": ways["vanilla"]["same_as_hf"],
                         **{f"{name}_equals_hf": ways[name]["same_as_hf"] for name in others}}
    return ways


def format_comparison(ways: dict[str, dict], acceptance: str) -> str:
    names = [n for n in ways if n != "agreement"]
    lines = [f"{'decoding':<10} {'tau':>6} {'tokens/s':>10} {'vs HF':>7} {'draft s':>8} {'verify s':>9} {'tokens':>7}"]
    for name in names:
        w = ways[name]
        tau = f"{w['tau']:.2f}" if "tau" in w else "1.00"
        draft = f"{w['draft_s']:.2f}" if "draft_s" in w else "-"
        verify = f"{w['verify_s']:.2f}" if "verify_s" in w else "-"
        lines.append(f"{name:<10} {tau:>6} {w['tokens_per_s']:>10.1f} {w['speedup_vs_hf']:>6.2f}x {draft:>8} "
                     f"{verify:>9} {w['new_tokens']:>7}")
    prompts = ways["agreement"]["prompts"]
    note = "" if acceptance == "greedy" else " (sampling: outputs differ by design; compare distributions, not tokens)"
    same = ", ".join(f"{name} {ways[name]['same_as_hf']}/{prompts}" for name in names if "same_as_hf" in ways[name])
    lines.append(f"same tokens as HF generate: {same}{note}")
    return "\n".join(lines)


def sweep_drafters(session: Session, drafters: dict[str, object], questions: list[dict],
                   warmup: bool = True, progress: bool = True) -> dict[str, dict]:
    """First turns of ``questions`` decoded by the session's target with each of ``drafters`` (name -> drafter, e.g.
    one set of heads under several trees), prompt by prompt: tau, tokens/s, draft/verify seconds per drafter, and on
    how many prompts its tokens equal the first drafter's (all of them under greedy acceptance: trees change speed,
    never the output). What scripts/sweep_trees.py prints to choose a tree."""
    s, tokenizer = session.settings, session.target.tokenizer
    decoders = {name: SpeculativeDecoder(session.target.model, drafter, eos_token_ids=session.decoder.eos_token_ids,
                                         decode=session.decoder.decode, linear_kernel=session.decoder.linear_kernel)
                for name, drafter in drafters.items()}
    if not decoders:
        raise ValueError("Give at least one drafter to sweep.")
    if warmup:
        ids = prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}], s["chat"])
        for decoder in decoders.values():
            decoder.generate(ids, max_new_tokens=4, sampling=session.sampling)
    ways = {name: {**_new_way(), "same_as_first": 0} for name in decoders}
    for way in ways.values():
        del way["same_as_hf"]
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
