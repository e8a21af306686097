"""Choose a tree by measurement: decode the same prompts with one set of heads under several trees, and print tau,
tokens/s and the draft/verify split of each (greedy by default, so every tree must give the same tokens; the last
column checks it). A bigger tree accepts more tokens per step but costs more per verify forward; which wins depends
on the heads and on the machine (scripts/bench.py writes the verify cost curve, verify_cost.png).

    # Medusa heads: static trees (names in conf/trees/, chain-K, single, or a tree YAML file)
    python scripts/sweep_trees.py heads=outputs/medusa-smollm2/heads prompts=../shared/data/mt_bench/question.jsonl \\
        max_questions=8 max_new_tokens=64 --trees single,chain-1,chain-2,chain,small_16,mc_sim_7b_63
    # EAGLE heads: dynamic trees as depth:top_k:total_tokens
    python scripts/sweep_trees.py heads=outputs/eagle-smollm2/heads prompts=../shared/data/mt_bench/question.jsonl \\
        max_questions=8 max_new_tokens=64 --eagle 4:4:8,5:8:16,5:8:32,6:10:60
    # layer-skip exits: exit_layer:max_depth:threshold (adaptive depth off, so each runs as given); an exit layer
    # other than the heads' own reads the exit train/layerskip.py saved in <run>/exits/layer-E; with heads=null
    # drafter=layerskip, the target's own norm and LM head at any E
    python scripts/sweep_trees.py heads=outputs/layerskip-smollm2 prompts=../shared/data/mt_bench/question.jsonl \\
        max_questions=8 max_new_tokens=64 --layerskip 11:2:0.5,15:2:0.5,22:1:0.5,22:3:0.7,22:6:0.9

Each setting runs as given (the whole tree every step, the heads alone). ``--as-decoded`` runs each as decode/run.py
would instead: adaptive depth and the suffix hybrid as the drafter's settings say (``draft.adaptive=false`` and
``draft.suffix=false`` switch them off for every setting), e.g. to compare EAGLE trees under the default decoder:

    python scripts/sweep_trees.py heads=outputs/eagle3-smollm2-cpu1h/heads \\
        prompts=../shared/data/mt_bench/question.jsonl max_new_tokens=128 --eagle 2:2:3,2:1:2 --as-decoded

Takes the overrides of conf/decode/decode.yaml (heads, model, device, dtype, max_new_tokens, acceptance, ...). Uses the first
turn of each question. ``--out`` also writes the figures as JSON.
"""

import argparse
import json
from pathlib import Path

from selfspec.decode import registry
from selfspec.bench import format_sweep, sweep_decoders
from selfspec.decode.prompts import read_questions
from selfspec.decode.session import load_session
from selfspec.decode.types import DecodeSetupError
from selfspec.core.config import CONF_DIR, compose, to_dict
from selfspec.core.errors import reported_errors
from selfspec.heads.io import heads_dir, load_heads
from selfspec.heads.layerskip import other_exit_dir


def parse_eagle(spec: str) -> dict:
    try:
        depth, top_k, total = (int(x) for x in spec.split(":"))
    except ValueError:
        raise DecodeSetupError(f"--eagle {spec!r}: give depth:top_k:total_tokens, e.g. 5:8:16.") from None
    return {"depth": depth, "top_k": top_k, "total_tokens": total}


def parse_layerskip(spec: str) -> dict:
    try:
        exit_layer, depth, threshold = spec.split(":")
        return {"exit_layer": int(exit_layer), "max_depth": int(depth), "threshold": float(threshold)}
    except ValueError:
        raise DecodeSetupError(f"--layerskip {spec!r}: give exit_layer:max_depth:threshold, e.g. 15:3:0.5.") from None


def exit_heads(session, heads_path, exit_layer: int):
    """The trained exit after ``exit_layer``: the session's own, or the one its training run saved in
    ``exits/layer-E`` beside it; None without heads (the target's own norm and LM head)."""
    if session.heads is None:
        return None
    if session.heads.exit_layer == exit_layer:
        return session.heads

    folder = other_exit_dir(heads_dir(heads_path), exit_layer)
    if not folder.is_dir():
        raise DecodeSetupError(f"No trained exit after layer {exit_layer}: {folder} does not exist (train it with "
                               f"python train/layerskip.py exit_layer={exit_layer}, or sweep with heads=null).")
    return load_heads(folder, target=session.target).module


def build_decoders(session, trees: list[str], eagle: list[str], vanilla: bool, layerskip: list[str] = (),
                   heads_path=None, as_decoded: bool = False, draft: dict | None = None) -> dict:
    """One decoder per swept setting (:meth:`Session.decoder_for`: the session's family under its settings, defaults
    < saved with the heads < ``draft``, the command's draft.* < the swept value), so a setting of another family is
    refused. Each runs as given: adaptive depth and the suffix hybrid off; ``as_decoded``: as decode/run.py builds it
    from those settings (adaptive depth, the suffix hybrid)."""
    sweeps = ([(f"tree {t}", {"tree": t}) for t in trees] + [(f"eagle {e}", parse_eagle(e)) for e in eagle]
              + [(f"layerskip {x}", parse_layerskip(x)) for x in layerskip])
    if not sweeps:
        raise DecodeSetupError("Nothing to sweep: give --trees (Medusa heads), --eagle (EAGLE heads) or --layerskip.")
    takes = registry.entry(session.family).defaults
    as_given = {} if as_decoded else {k: False for k in ("adaptive", "suffix") if k in takes}
    decoders = {}
    for name, overrides in sweeps:
        heads = None
        if "exit_layer" in overrides:
            heads = exit_heads(session, heads_path, overrides["exit_layer"])
            if heads is not None:
                overrides = {k: v for k, v in overrides.items() if k != "exit_layer"}
        decoders[name] = session.decoder_for(draft={**(draft or {}), **overrides, **as_given}, heads=heads)
    if vanilla:
        decoders["vanilla"] = session.decoder_for("vanilla")
    return decoders


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default="", help="comma-separated static trees for Medusa heads")
    parser.add_argument("--eagle", default="", help="comma-separated depth:top_k:total_tokens for EAGLE heads")
    parser.add_argument("--layerskip", default="", help="comma-separated exit_layer:max_depth:threshold")
    parser.add_argument("--no-vanilla", action="store_true", help="leave out plain decoding (one token per step)")
    parser.add_argument("--as-decoded", action="store_true",
                        help="each setting with adaptive depth and the suffix hybrid, as decode/run.py decodes")
    parser.add_argument("--out", help="also write the figures as JSON here")
    args, overrides = parser.parse_known_args(argv)
    cfg = compose("decode", overrides, config_dir=CONF_DIR / "decode")
    if not cfg.prompts:
        raise DecodeSetupError("Give prompts=FILE.jsonl (MT-bench form).")
    session = load_session(cfg)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    decoders = build_decoders(session, split(args.trees), split(args.eagle), not args.no_vanilla,
                              split(args.layerskip), cfg.heads, args.as_decoded, to_dict(cfg.draft))
    questions = read_questions(cfg.prompts, cfg.max_questions)
    print(f"target {session.target.name}, heads {cfg.heads}; {len(questions)} prompts (first turns), "
          f"max_new_tokens={cfg.max_new_tokens}, acceptance {cfg.acceptance}")
    ways = sweep_decoders(session, decoders, questions)
    print(format_sweep(ways))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"heads": str(cfg.heads), "prompts": len(questions),
                                              "max_new_tokens": cfg.max_new_tokens, "ways": ways}, indent=2) + "\n")
    return ways


if __name__ == "__main__":
    with reported_errors():
        main()
