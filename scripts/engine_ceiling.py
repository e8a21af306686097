"""How fast the engine can go on this machine: the verify cost curve, plain decoding against HF ``generate``, and an
oracle drafter that proposes the target's own greedy continuation as a chain of D tokens.

    python scripts/engine_ceiling.py                                   # SmolLM2 on this machine
    python scripts/engine_ceiling.py -- device=cuda dtype=bfloat16
    python scripts/engine_ceiling.py --shape smollm2 -- model=tiny device=cuda   # SmolLM2's shapes, random weights

No drafter can beat the oracle: its speedup at depth D bounds what a drafter whose chains of D tokens are always
accepted would reach, so it separates what the engine (verify cost, per-step overhead) leaves from what drafts leave.
The cost of a forward depends on the shapes alone, so a random target with a real model's shapes (``--shape``) gives
that model's cost curve and ceiling where its weights are not at hand (a GPU machine with no network, say).
Prompts are ``--prompt-tokens`` random token ids (the oracle knows every continuation, so the text does not matter);
EOS is ignored, so each answer is ``--new-tokens`` long. Every engine answer is checked token for token against HF
``generate``; a mismatch is reported (low-precision dtypes can flip near-ties between a one-token and a tree forward).
The config is conf/decode/decode.yaml with the overrides after ``--`` (its ``model``, ``dtype``, ``device``). Writes
the report as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from selfspec.core.errors import SettingError, reported_errors


# Shapes of real targets, for a random stand-in (``model=tiny`` builds it): the cost of a forward depends on them only.
SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536, max_position_embeddings=8192,
                    tie_word_embeddings=True),
    "llama1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=8192,
                    tie_word_embeddings=True),
    "llama3b": dict(vocab_size=128256, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                    num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=8192,
                    tie_word_embeddings=True),  # conf/model/llama3b.yaml's Llama-3.2-3B
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="with model=tiny: a random target with this real model's shapes")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--depths", default="1,2,3,4,8")
    parser.add_argument("--curve-repeats", type=int, default=9)
    parser.add_argument("--out", default="outputs/engine_ceiling.json")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    return parser.parse_args(argv)


def load(args: argparse.Namespace):
    """The target the overrides name (a random stand-in with ``--shape``'s shapes under model=tiny)."""
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec.decode.settings import target_config_from_overrides
    from selfspec.core.target import load_target

    settings = target_config_from_overrides(args.overrides)
    if args.shape:
        if settings.source != "tiny":
            raise SettingError(f"--shape {args.shape} builds a random stand-in: add `-- model=tiny`.")
        settings = settings.replace(tiny={**settings.tiny, **SHAPES[args.shape]})
    return load_target(settings)


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """HF ``generate``'s greedy answer of exactly ``new_tokens`` tokens (EOS ignored)."""
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    import torch

    x = torch.tensor([ids], device=next(model.parameters()).device)
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None  # no early stop
    try:
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
                             pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = eos
    return out[0, len(ids):].tolist()


def timed(device, fn):
    """(seconds, fn()) with the device's queued work waited for on both sides."""
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec.decode.step import synchronize

    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def run_methods(model, prompts: list[list[int]], depths: list[int], new_tokens: int) -> tuple[dict, list]:
    """Per method (hf, plain, oracle-D), one row per prompt (seconds, tokens, target forwards), and every engine
    answer that differs from HF's."""
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec.decode.drafters import OracleDrafter, VanillaDrafter
    from selfspec.decode.engine import SpeculativeDecoder

    device = next(model.parameters()).device
    hf_greedy(model, prompts[0], new_tokens)  # warm-up
    rows = {"hf": [], "plain": [], **{f"oracle-{d}": [] for d in depths}}
    mismatches = []
    for i, ids in enumerate(prompts):
        s, answer = timed(device, lambda: hf_greedy(model, ids, new_tokens))
        rows["hf"].append({"s": s, "tokens": len(answer), "steps": len(answer)})
        for name in list(rows)[1:]:
            drafter = VanillaDrafter() if name == "plain" else OracleDrafter(answer, int(name.split("-")[1]))
            engine = SpeculativeDecoder(model, drafter, eos_token_ids=[], linear_kernel="auto")
            if i == 0:
                engine.generate(ids, max_new_tokens=8)  # warm-up
            s, result = timed(device, lambda: engine.generate(ids, max_new_tokens=new_tokens))
            rows[name].append({"s": s, "tokens": len(result.tokens), "steps": result.stats.steps + 1})
            if result.tokens != answer:
                first = next((j for j, (a, b) in enumerate(zip(answer, result.tokens)) if a != b),
                             min(len(answer), len(result.tokens)))
                mismatches.append({"prompt": i, "method": name, "first_difference": first})
    return rows, mismatches


def summarise(rows: dict) -> dict:
    """tokens/s, its ratio to HF's (overall and the per-prompt median) and tau, per method."""
    hf_rate = sum(r["tokens"] for r in rows["hf"]) / sum(r["s"] for r in rows["hf"])
    summary = {}
    for name, rs in rows.items():
        rate = sum(r["tokens"] for r in rs) / sum(r["s"] for r in rs)
        per_prompt = [(r["tokens"] / r["s"]) / (h["tokens"] / h["s"]) for r, h in zip(rs, rows["hf"])]
        summary[name] = {"tokens_per_s": rate, "x_hf": rate / hf_rate, "x_hf_median": statistics.median(per_prompt),
                         "tau": sum(r["tokens"] for r in rs) / sum(r["steps"] for r in rs)}
    return summary


def print_report(report: dict, curve: list[dict]) -> None:
    one = curve[0]["ms"]
    shape = f" (shapes of {report['shape']}, random weights)" if report["shape"] else ""
    print(f"{report['model']}{shape} on {report['device']} {report['device_name'] or ''} {report['dtype']}; verify "
          "over a 256-token cache, ms (x one token):")
    print("  " + ", ".join(f"{r['nodes']}: {r['ms']:.2f} ({r['ms'] / one:.2f})" for r in curve))
    print("| method | tokens/s | x HF generate | median per prompt | tau |")
    print("|---|---|---|---|---|")
    for name, s in report["methods"].items():
        print(f"| {name} | {s['tokens_per_s']:.1f} | {s['x_hf']:.2f} | {s['x_hf_median']:.2f} | {s['tau']:.2f} |")
    print(f"lossless: {'yes' if not report['mismatches'] else report['mismatches']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    # deferred: torch and the target only once the arguments are read, so --help answers at once
    import torch

    from selfspec.decode.adaptive import CURVE_SIZES, verify_cost_curve

    with reported_errors():
        target = load(args)
        model = target.model
        curve = verify_cost_curve(model, cache_length=256, sizes=CURVE_SIZES, repeats=args.curve_repeats,
                                  linear_kernel="auto")
        vocab = model.config.get_text_config(decoder=True).vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.prompts)]
        rows, mismatches = run_methods(model, prompts, [int(d) for d in args.depths.split(",")], args.new_tokens)

    device, param = next(model.parameters()).device, next(model.parameters())
    report = {"model": target.name, "shape": args.shape, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "dtype": str(param.dtype), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "cost_curve": curve, "methods": summarise(rows), "mismatches": mismatches}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print_report(report, curve)
    return report


if __name__ == "__main__":
    main()
