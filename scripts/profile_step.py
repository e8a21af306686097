"""selfspec's plain decoding step against vLLM-CPU's, op by op: the same prompts (random token ids, EOS ignored)
decoded greedily in both engines under torch.profiler, each op's self CPU time summed into kinds (linear layers,
attention, norms, rotary, the LM head's sampling, KV cache and copies, other), per generated token, beside the wall time
per token; what no op accounts for is the framework and Python between ops.

    python scripts/profile_step.py                                  # SmolLM2 in both engines
    python scripts/profile_step.py --new-tokens 64 -- model=smollm2 dtype=float32

The profiler slows both engines alike (a few percent of an op's time); compare the kinds' shares and the ratios between
the two engines rather than the absolute times. vLLM runs in its own venv (scripts/make_vllm_venv.sh), its engine in
its worker's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the profiler sees its ops. Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

# op kinds by name (the first that matches); names are torch's (aten::...) and vLLM's custom ops (_C::..., vllm::...)
KINDS = [
    ("attention", r"attention|attn|sdpa|scaled_dot_product|flash|paged"),
    ("linear", r"linear|addmm|\bmm\b|::mm|matmul|bmm|gemm|onednn|mkldnn|dnnl|small_batch"),
    ("norm", r"norm|rsqrt|pow|mean"),  # HF's RMSNorm: pow, mean, rsqrt (its mul counts as activation)
    ("rotary", r"rotary|rope"),
    ("activation", r"silu|gelu|act_and_mul|sigmoid|\bmul\b|::mul"),
    ("sampling", r"argmax|topk|sort|sample|multinomial|softmax|max\b|::max"),
    ("cache and copies", r"cache|copy|index|cat|slice|select|view|reshape|contiguous|::to\b|_to_copy|empty|zeros|fill|"
                         r"stack|clone|expand|narrow|as_strided|unsqueeze|squeeze|transpose|permute|detach|item"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def by_kind(ops: list[dict], tokens: int) -> dict[str, float]:
    """Milliseconds of self CPU time per generated token, per kind (``ops``: name, self_us)."""
    out: dict[str, float] = {}
    for op in ops:
        if op["name"].startswith("ProfilerStep") or op["self_us"] <= 0:
            continue
        kind = kind_of(op["name"])
        out[kind] = out.get(kind, 0.0) + op["self_us"] / 1000 / tokens
    return out


def top_ops(ops: list[dict], tokens: int, n: int = 12) -> list[tuple[str, float, float]]:
    """The ``n`` ops with the most self time: (name, ms per token, calls per token)."""
    ranked = sorted(ops, key=lambda op: op["self_us"], reverse=True)[:n]
    return [(op["name"], op["self_us"] / 1000 / tokens, op["count"] / tokens) for op in ranked]


def profile_selfspec(model, prompts: list[list[int]], new_tokens: int) -> dict:
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    import torch
    from selfspec.decode.drafters import VanillaDrafter
    from selfspec.decode.engine import SpeculativeDecoder

    engine = SpeculativeDecoder(model, VanillaDrafter(), eos_token_ids=[], linear_kernel="auto")
    engine.generate(prompts[0], max_new_tokens=8)  # warm-up
    t0 = time.perf_counter()
    for ids in prompts:
        engine.generate(ids, max_new_tokens=new_tokens)
    plain_s = time.perf_counter() - t0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        tokens = sum(len(engine.generate(ids, max_new_tokens=new_tokens).tokens) for ids in prompts)
        profiled_s = time.perf_counter() - t0
    ops = [{"name": e.key, "self_us": e.self_cpu_time_total, "count": e.count} for e in prof.key_averages()]
    return {"tokens": tokens, "ms_per_token": 1000 * plain_s / tokens, "profiled_ms_per_token": 1000 * profiled_s / tokens,
            "ops": ops}


def profile_vllm(target, prompts: list[list[int]], new_tokens: int, venv: str | None) -> dict:
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec.serve.serving import run_vllm, served_target_dir

    model = target.model
    job = {"model": str(served_target_dir(target)), "dtype": str(model.dtype).removeprefix("torch."),
           "max_model_len": max(map(len, prompts)) + new_tokens + 8, "max_new_tokens": new_tokens,
           "prompts": prompts, "stop_token_ids": [], "ignore_eos": True, "warmup": [prompts[0][:8]],
           "runs": [{"name": "plain", "speculative_config": None},
                    {"name": "plain-profiled", "speculative_config": None, "profile": True}]}
    result = run_vllm(job, venv, one_process=True)
    plain, profiled = result["runs"]
    for run in (plain, profiled):
        if not run["loaded"] or run.get("error"):
            raise RuntimeError(f"vLLM: {run.get('error')}")
    tokens = sum(len(p["tokens"]) for p in profiled["prompts"])
    return {"vllm": result.get("vllm_version"), "tokens": tokens,
            "ms_per_token": 1000 * sum(p["seconds"] for p in plain["prompts"]) / sum(len(p["tokens"])
                                                                                    for p in plain["prompts"]),
            "profiled_ms_per_token": 1000 * sum(p["seconds"] for p in profiled["prompts"]) / tokens,
            "ops": profiled["profile"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vllm-venv", default=None)
    parser.add_argument("--out", default="outputs/profile-step.json")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --); default model=smollm2")
    args = parser.parse_args(argv)

    # deferred: torch and the target only once the arguments are read, so --help answers at once
    import torch
    from selfspec.core.target import load_target
    from selfspec.decode.settings import target_config_from_overrides

    target = load_target(target_config_from_overrides(args.overrides or ["model=smollm2"]))
    g = torch.Generator().manual_seed(0)
    vocab = target.model.config.vocab_size
    prompts = [torch.randint(100, vocab - 100, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.prompts)]
    with torch.no_grad():
        ours = profile_selfspec(target.model, prompts, args.new_tokens)
    theirs = profile_vllm(target, prompts, args.new_tokens, args.vllm_venv)
    report = {"model": target.name, "dtype": str(target.model.dtype), "threads": torch.get_num_threads(),
              "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "engines": {"selfspec": ours, "vllm": theirs}}
    kinds = {name: by_kind(e["ops"], e["tokens"]) for name, e in report["engines"].items()}
    report["by_kind_ms_per_token"] = kinds
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"{report['model']} ({report['dtype']}, {report['threads']} threads), {args.prompts} prompts of "
          f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens each; ms per generated token")
    print("| | selfspec | vLLM | selfspec / vLLM |\n|---|---|---|---|")
    rows = [("wall, unprofiled", ours["ms_per_token"], theirs["ms_per_token"]),
            ("wall, profiled", ours["profiled_ms_per_token"], theirs["profiled_ms_per_token"])]
    names = sorted(set(kinds["selfspec"]) | set(kinds["vllm"]), key=lambda k: -kinds["selfspec"].get(k, 0))
    rows += [(k, kinds["selfspec"].get(k, 0.0), kinds["vllm"].get(k, 0.0)) for k in names]
    rows.append(("outside any op", ours["profiled_ms_per_token"] - sum(kinds["selfspec"].values()),
                 theirs["profiled_ms_per_token"] - sum(kinds["vllm"].values())))
    for name, a, b in rows:
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x |" if b else f"| {name} | {a:.2f} | {b:.2f} | - |")
    for name, e in report["engines"].items():
        print(f"\n{name}'s top ops (ms per token, calls per token):")
        for op, ms, calls in top_ops(e["ops"], e["tokens"]):
            print(f"  {ms:7.3f}  {calls:6.1f}  {op}")
    print(f"\nwritten: {out}")
    return report


if __name__ == "__main__":
    main()
