"""Methods compared prompt by prompt with every engine kept open: each vLLM method in an engine of its own (a worker
process each, started once, untimed) and selfspec's plain engine in this process, every prompt decoded by each in a
rotated order, wall time per request from the caller. Ratios are geometric means over prompts.

    python scripts/ab_engines.py --methods vanilla,vllm
    python scripts/ab_engines.py --methods vllm_hybrid,vllm_selfspec_suffix,vllm_suffix \\
        --heads outputs/dflash-smollm2-cpu1h/heads --humaneval 12

scripts/bench.py starts an engine per vLLM method and round, and on a 2-core CPU one vLLM process can run 10-15%
faster than the next with the same settings (docs/benchmarks.md): its ratios between two vLLM methods carry that. Here
each engine is one process for all prompts and the methods alternate prompt by prompt, so a drift of the machine hits
all alike. Methods: ``vanilla`` (selfspec's engine, plain), ``selfspec`` (its default decoder: ``--heads`` with the
suffix drafter, as scripts/bench.py's ``hybrid`` row), ``selfspec_unspliced`` (that decoder with
``draft.splice=false``), scripts/bench.py's vLLM methods (bench/vllm.py: ``vllm``, ``vllm_ngram``, ``vllm_suffix``,
``vllm_selfspec_suffix``, ``vllm_heads``, ``vllm_hybrid``; the last two with ``--heads``), each drafting what its
bench row drafts, and variants of a vLLM method, each an engine of its own beside that method's:
``vllm_hybrid_unspliced`` (the hybrid with ``SELFSPEC_VLLM_HYBRID_SPLICE=0``, no spliced chains: serve/vllm_hybrid.py),
``vllm_hybrid_unmeasured`` and ``vllm_selfspec_suffix_unmeasured`` (``SELFSPEC_VLLM_COST_MEASURE=0``: chains chosen by
selfspec's own verify cost curve, not by the engine's measured one: serve/vllm_suffix.py). Prompts: every
``--mt-every``-th MT-bench first turn from the ``--mt-start``-th, and ``--humaneval`` HumanEval problems from the
``--humaneval-start``-th (0: the first). The tokens of every method are compared; any difference is reported and the
script exits 1. Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def rotated(names: list[str], i: int) -> list[str]:
    """The order the methods decode prompt ``i`` in: rotated by one every two prompts, the second of each two reversed,
    so that over 2 x len(names) prompts each method takes each place twice."""
    k = (i // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if i % 2 else order


def geometric_ratio(a: list[float], b: list[float]) -> tuple[float, int]:
    """(the geometric mean of a[i] / b[i], how many i have a[i] > b[i])."""
    if not a or len(a) != len(b):
        raise ValueError("geometric_ratio needs two equally long, non-empty lists")
    return math.exp(sum(math.log(x / y) for x, y in zip(a, b)) / len(a)), sum(x > y for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="vanilla,vllm", help="comma-separated; the first is the reference")
    parser.add_argument("--heads", default=None, help="a heads folder, for vllm_heads and vllm_hybrid")
    parser.add_argument("--mt-bench", default="../shared/data/mt_bench/question.jsonl")
    parser.add_argument("--mt-every", type=int, default=5)
    parser.add_argument("--mt-start", type=int, default=2)
    parser.add_argument("--humaneval", type=int, default=0)
    parser.add_argument("--humaneval-start", type=int, default=0, help="the first HumanEval problem taken (unseen sets)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--speculative-tokens", type=int, default=3, help="scripts/bench.py's vllm_speculative_tokens")
    parser.add_argument("--suffix-tokens", type=int, default=8, help="scripts/bench.py's vllm_suffix_tokens")
    parser.add_argument("--vllm-venv", default=None)
    parser.add_argument("--out", default="outputs/ab-engines.json")
    args = parser.parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]

    # deferred: torch, vLLM's venv and the target only once the arguments are read, so --help answers at once
    from selfspec.bench import load_prompts
    from selfspec.bench.vllm import VLLM_METHODS, vllm_runs
    from selfspec.core.archs import context_limit
    from selfspec.core.vllm_env import VllmSession, selfspec_pythonpath
    from selfspec.decode.prompts import prompt_ids
    from selfspec.decode.session import load_session
    from selfspec.decode.settings import decode_config
    from selfspec.serve.serving import needs_selfspec, proposer_env, served_target_dir
    from selfspec.serve.vllm_hybrid import SPLICE_ENV
    from selfspec.serve.vllm_suffix import MEASURE_ENV

    own = ("vanilla", "selfspec", "selfspec_unspliced")  # selfspec's engine: plain, its default decoder, and that
    # decoder without spliced branches (draft.splice=false)
    variants = {"vllm_hybrid_unspliced": ("vllm_hybrid", {SPLICE_ENV: "0"}),  # a method's engine again, with its
                "vllm_hybrid_unmeasured": ("vllm_hybrid", {MEASURE_ENV: "0"}),  # environment changed
                "vllm_selfspec_suffix_unmeasured": ("vllm_selfspec_suffix", {MEASURE_ENV: "0"})}
    unknown = [m for m in names if m not in own and m not in VLLM_METHODS and m not in variants]
    if unknown or len(names) < 2:
        print(f"error: --methods: two or more of {', '.join(own + VLLM_METHODS + tuple(variants))} "
              f"(not {', '.join(unknown)})",
              file=sys.stderr)
        return 2
    for variant, (base, _) in variants.items():
        if variant in names and base not in names:
            print(f"error: --methods {variant} goes beside {base} (add it to --methods)", file=sys.stderr)
            return 2
    if ("selfspec" in names or "selfspec_unspliced" in names) and not args.heads:
        print("error: --methods selfspec: give --heads (its default decoder drafts with them)", file=sys.stderr)
        return 2
    session = load_session(decode_config({"max_new_tokens": args.max_new_tokens,
                                          **({"heads": args.heads} if args.heads else {"family": "vanilla"})}))
    plain = session.decoder_for("vanilla")
    decoders = {"vanilla": plain, "selfspec": session.decoder}
    if "selfspec_unspliced" in names:
        decoders["selfspec_unspliced"] = session.decoder_for(draft={"splice": False})
    questions = load_prompts(args.mt_bench)[args.mt_start::args.mt_every]
    if args.humaneval:
        questions += load_prompts("humaneval", args.humaneval_start + args.humaneval)[args.humaneval_start:]
    prompts = [prompt_ids(session.target.tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in questions]
    eos = sorted(session.decoder.eos_token_ids)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(args.heads or ".").resolve()
    heads = {(folder.parent if folder.name == "heads" else folder).name: (session, args.heads)} if args.heads else {}
    runs = vllm_runs([m for m in names if m not in own and m not in variants], heads,
                     out.parent / (out.stem + "-exports"), served_target_dir(session.target), args.speculative_tokens,
                     args.suffix_tokens)
    for variant, (base, variant_env) in variants.items():
        if variant in names:
            run = next(r for r in runs if r["name"].split(":")[0] == base)
            runs.append({**run, "name": run["name"].replace(base, variant, 1), "env": variant_env})
    env = (proposer_env(session.target.model, session.decoder.linear_kernel, args.suffix_tokens,
                        args.speculative_tokens) if needs_selfspec(runs) else {})
    engine = {"model": str(served_target_dir(session.target)), "dtype": str(session.target.model.dtype).removeprefix(
        "torch."), "max_model_len": min(context_limit(session.target.model.config),
                                        max(map(len, prompts)) + args.max_new_tokens + args.suffix_tokens + 8)}
    # selfspec's kernel plan and cost curve are timed on its first decode: before vLLM's engines start beside it
    for decoder in [decoders[n] for n in decoders if n == "vanilla" or n in names]:
        decoder.generate(prompts[0][:8], max_new_tokens=4)
    sessions = {run["name"]: VllmSession({**engine, "speculative_config": run["speculative_config"],
                                          **(run.get("engine") or {})}, args.vllm_venv,
                                         replica_env=[{**env, **run.get("env", {})}],
                                         pythonpath=[selfspec_pythonpath()], log_path=out.parent / f"{run['name']}.log")
                for run in runs}
    # the methods in the order given (a heads method's engine is named after its heads: vllm_hybrid:<heads>)
    order_names = [n for m in names for n in ([m] if m in own else
                                               [r["name"] for r in runs if r["name"].split(":")[0] == m])]

    def request(ids: list[int]) -> dict:
        return {"prompt_token_ids": ids, "max_tokens": args.max_new_tokens, "temperature": 0.0, "top_p": 1.0,
                "seed": None, "stop_token_ids": eos}

    def decode(name: str, ids: list[int]) -> list[int]:
        if name in own:
            return list(decoders[name].generate(ids, max_new_tokens=args.max_new_tokens).tokens)
        return list(sessions[name].generate([request(ids)])[0])

    try:
        for name in order_names:  # warm-up, untimed
            decode(name, prompts[0][:8])
        speed: dict[str, list[float]] = {n: [] for n in order_names}
        differ = []
        for i, ids in enumerate(prompts):
            tokens = {}
            for name in rotated(order_names, i):
                start = time.perf_counter()
                tokens[name] = decode(name, ids)
                speed[name].append(len(tokens[name]) / (time.perf_counter() - start))
            if len({tuple(t) for t in tokens.values()}) > 1:
                differ.append(questions[i]["question_id"])
            print(f"{i} {questions[i]['question_id']}: " + ", ".join(f"{n} {speed[n][-1]:.1f}" for n in order_names)
                  + " tokens/s", file=sys.stderr, flush=True)
    finally:
        for s in sessions.values():
            s.close()
    reference = order_names[0]
    sources = sorted({q["source"] for q in questions})
    report = {"methods": order_names, "prompts": [q["question_id"] for q in questions], "tokens_per_s": speed,
              "differ": differ, "ratios": {}}
    print(f"| against {reference} | all {len(prompts)} | " + " | ".join(sources) + " |")
    print("|---|---|" + "---|" * len(sources))
    for name in order_names[1:]:
        cells = []
        for source in [None, *sources]:
            keep = [i for i, q in enumerate(questions) if source is None or q["source"] == source]
            ratio, faster = geometric_ratio([speed[name][i] for i in keep], [speed[reference][i] for i in keep])
            report["ratios"].setdefault(name, {})[source or "all"] = ratio
            cells.append(f"{ratio:.3f}x ({faster} of {len(keep)})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    out.write_text(json.dumps(report, indent=1))
    print(("tokens differ on " + ", ".join(map(str, differ))) if differ else "tokens equal in every method",
          f"written: {out}", sep="\n")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
