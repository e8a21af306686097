"""One target, several decoders (e.g. one set of heads under several trees) on the same prompts: what
scripts/sweep_trees.py prints to choose a tree."""

from __future__ import annotations

from tqdm.auto import tqdm

from selfspec.bench.prompts import first_turn_ids
from selfspec.decode.engine import SpeculativeDecoder
from selfspec.decode.session import Session
from selfspec.decode.types import DecodeSetupError


def sweep_decoders(session: Session, decoders: dict[str, SpeculativeDecoder], questions: list[dict],
                   warmup: bool = True, progress: bool = True) -> dict[str, dict]:
    """First turns of ``questions`` decoded by each of ``decoders`` (name -> an engine on the session's target, from
    :meth:`Session.decoder_for`: e.g. one set of heads under several trees), prompt by prompt: tau, tokens/s,
    draft/verify seconds per decoder, and on how many prompts its tokens equal the first decoder's (all of them under
    greedy acceptance: trees change speed, never the output). What scripts/sweep_trees.py prints to choose a tree."""
    s = session.settings
    if not decoders:
        raise DecodeSetupError("Give at least one decoder to sweep (--trees, --eagle or --layerskip, or leave out "
                               "--no-vanilla).")
    if warmup:
        ids = first_turn_ids(session, {"turns": ["Hi"]})
        for decoder in decoders.values():
            decoder.generate(ids, max_new_tokens=4, sampling=s.sampling)
    ways = {name: {"new_tokens": 0, "total_s": 0.0, "steps": 0, "step_tokens": 0, "draft_s": 0.0, "verify_s": 0.0,
                   "same_as_first": 0} for name in decoders}
    first = next(iter(decoders))
    for q in tqdm(questions, desc="prompts", unit="prompt", disable=not progress):
        ids = first_turn_ids(session, q)
        reference = None
        for name, decoder in decoders.items():
            res = decoder.generate(ids, max_new_tokens=s.max_new_tokens, sampling=s.sampling, stop=s.stop, seed=s.seed,
                                   timings=True)
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
