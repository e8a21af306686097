"""Answer tokens/s of scripts/regenerate.py's two engines on the same prompts: engine=hf at several batch sizes and
engine=vllm, interleaved round by round (a drift of the machine's speed hits every engine alike). Each engine starts
once (not timed); a pass regenerates the prompts into a fresh file and is timed whole (templates, generation,
decoding, writing), after a warm-up pass of each. Greedy answers of vLLM and HF at batch 16 are counted equal or not
(tests/test_regenerate_vllm.py checks that those that differ do so at a float near-tie, on a tiny target).

    python scripts/bench_regenerate.py                                       # SmolLM2, 64 ShareGPT first turns, 128
    python scripts/bench_regenerate.py --hf-batch-sizes 16,32,64 --rounds 2 n=64 max_new_tokens=128
    python scripts/bench_regenerate.py --out outputs/bench_regenerate model=tiny n=8   # any conf/regenerate.yaml key

Writes ``--out``/report.json and prints a Markdown table (docs/benchmarks.md, "Regenerating data: HF vs vLLM-CPU").
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from selfspec.core.archs import context_limit
from selfspec.core.config import compose
from selfspec.core.vllm_env import VllmSettings
from selfspec.train.data import open_records, read_records
from selfspec.train.regenerate import (
    AnswerEngine,
    Answering,
    HFEngine,
    answering_of,
    iter_prompts,
    open_vllm_engine,
    regenerate,
    usable_length,
)

DEFAULTS = ["n=64", "max_new_tokens=128", "max_turns=1"]


class Counting(AnswerEngine):
    """An engine that counts the answer tokens it gives."""

    def __init__(self, engine: AnswerEngine):
        self.engine, self.batch_size, self.tokens = engine, engine.batch_size, 0

    def answer(self, prompts, budgets, seeds, answering):
        answers = self.engine.answer(prompts, budgets, seeds, answering)
        self.tokens += sum(len(a) for a in answers)
        return answers


def one_pass(engine: AnswerEngine, tokenizer, prompts, answering: Answering, out: Path) -> dict:
    counting = Counting(engine)
    out.unlink(missing_ok=True)
    start = time.perf_counter()
    report = regenerate(counting, tokenizer, iter(prompts), out, answering=answering, progress=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": counting.tokens, "written": report.written,
            "tokens_per_s": counting.tokens / seconds}


def answers(path: Path) -> dict:
    lines = [line for line in path.read_text().split("\n") if line.strip()]  # not splitlines: a U+2028 in a text
    return {r["id"]: r["messages"] for r in map(json.loads, lines)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-batch-sizes", default="16,32,64", help="engine=hf batch sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every engine, interleaved")
    parser.add_argument("--out", default="outputs/bench_regenerate", help="report.json and vLLM's log go here")
    args, overrides = parser.parse_known_args()
    cfg = compose("regenerate", DEFAULTS + overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = read_records(cfg.prompts) if cfg.get("prompts") else open_records(cfg.data)
    prompts = []
    for prompt in iter_prompts(records, {}, cfg.get("max_turns")):
        prompts.append(prompt)
        if cfg.n is not None and len(prompts) >= int(cfg.n):
            break

    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec.core.target import load_target
    from selfspec.core.vllm_env import served_model

    target = load_target(cfg.model)
    answering = answering_of(cfg, usable_length(cfg.data.get("max_length"), context_limit(target.model.config),
                                                int(cfg.max_new_tokens)))
    engines: dict[str, AnswerEngine] = {f"hf, batch {b}": HFEngine(target.model, target.tokenizer, int(b))
                                        for b in args.hf_batch_sizes.split(",")}
    path, tokenizer = served_model(cfg.model)
    t = time.perf_counter()
    vllm = open_vllm_engine(path, tokenizer, cfg.model, VllmSettings.from_config(cfg.vllm), answering,
                            log_path=out / "vllm.log")
    engines["vllm"] = vllm
    start_s = time.perf_counter() - t
    print(f"[bench_regenerate] vLLM {vllm.session.vllm_version} started in {start_s:.1f} s; {len(prompts)} prompts, "
          f"{answering.max_new_tokens} new tokens, {args.rounds} rounds", file=sys.stderr)
    results: dict[str, list[dict]] = {name: [] for name in engines}
    names = list(engines)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in (names[0], "vllm"):  # warm-up, not reported (the HF engines share one model)
                one_pass(engines[name], target.tokenizer, prompts[:2], answering, Path(tmp) / "warmup.jsonl")
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:  # each round starts elsewhere
                    file = Path(tmp) / f"{name.replace(', ', '-').replace(' ', '')}.jsonl"
                    result = one_pass(engines[name], target.tokenizer, prompts, answering, file)
                    results[name].append(result)
                    print(f"[bench_regenerate] round {r + 1} {name}: {result['tokens_per_s']:.1f} tokens/s "
                          f"({result['tokens']} tokens, {result['seconds']:.1f} s)", file=sys.stderr)
                    if name in ("vllm", "hf, batch 16"):
                        (out / file.name).write_text(file.read_text())
    finally:
        vllm.close()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
              "command": " ".join(sys.argv), "prompts": len(prompts), "max_new_tokens": answering.max_new_tokens,
              "vllm_version": vllm.session.vllm_version, "vllm_start_s": start_s, "results": results}
    if (out / "vllm.jsonl").exists() and (out / "hf-batch16.jsonl").exists():
        a, b = answers(out / "vllm.jsonl"), answers(out / "hf-batch16.jsonl")
        report["greedy_equal"] = [sum(a[i] == b.get(i) for i in a), len(a)] if answering.temperature == 0 else None
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    means = {name: sum(x["tokens_per_s"] for x in rows) / len(rows) for name, rows in results.items()}
    base = means.get("hf, batch 16")
    print("| engine | tokens/s per round | mean | vs hf, batch 16 |\n|---|---|---|---|")
    for name, rows in results.items():
        per_round = " / ".join(f"{x['tokens_per_s']:.1f}" for x in rows)
        ratio = f"{means[name] / base:.2f}x" if base else ""
        print(f"| {name} | {per_round} | {means[name]:.1f} | {ratio} |")
    if report.get("greedy_equal") is not None:
        print("greedy answers equal between vllm and hf, batch 16: {} of {}".format(*report["greedy_equal"]))


if __name__ == "__main__":
    from selfspec.core.errors import reported_errors

    with reported_errors():  # a mistyped key or a bad setting: one error line, exit 2
        main()
