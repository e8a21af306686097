"""Build time of a training run's feature store with its two engines on the same examples: the target's forward here
(``feature_store.engine=hf``, at several batch sizes) and vLLM (``feature_store.engine=vllm``), round by round in turn
(a drift of the machine's speed hits every engine alike). Each pass builds the store from nothing into a fresh folder
and is timed whole, vLLM's engine start included (a store is built once per run, so its start is part of the cost),
and reported apart. The stores are EAGLE-3's (its three layers and the last hidden state), which DFlash's default
layers read too.

    python scripts/bench_features.py                                   # SmolLM2, 256 ShareGPT examples, float16
    python scripts/bench_features.py --hf-batch-sizes 8,16 --rounds 2 data.max_records=512
    python scripts/bench_features.py model=tiny data.max_records=16     # any conf/eagle.yaml key

Writes ``--out``/report.json and prints a Markdown table (docs/benchmarks.md, "Feature stores: HF vs vLLM-CPU").
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from selfspec.core.config import compose
from selfspec.core.target import load_target
from selfspec.train.data import collate

DEFAULTS = ["heads=eagle3", "features=store", "data.max_records=256"]


def one_pass(cfg, target, splits, folder: Path) -> dict:
    """Build the store of ``cfg`` for ``splits`` into ``folder``; its seconds and tokens."""
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from accelerate import Accelerator

    from selfspec.train.eagle_method import EagleMethod
    from selfspec.train.feature_store import read_meta

    shutil.rmtree(folder, ignore_errors=True)
    cfg.feature_store.dir = str(folder)
    method = EagleMethod(cfg)
    method.features.run_dir = folder.parent
    collate_fn = functools.partial(collate, pad_token_id=target.tokenizer.pad_token_id)  # as train/loaders.py
    start = time.perf_counter()
    method.prepare_data(splits, target, Accelerator(cpu=True), collate_fn)
    seconds = time.perf_counter() - start
    meta = read_meta(folder)
    tokens = sum(s["num_tokens"] for s in meta["splits"].values())
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "bytes": meta["bytes"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-batch-sizes", default="8,16", help="feature_store.batch_size values of engine=hf")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="outputs/bench_features")
    parser.add_argument("overrides", nargs="*", help="conf/eagle.yaml keys, e.g. data.max_records=512")
    args = parser.parse_args(argv)
    overrides = DEFAULTS + args.overrides
    cfg = compose("eagle", overrides)
    target = load_target(cfg.model)
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec.train.data import build_dataset

    splits = {"train": build_dataset(cfg.data, target.tokenizer, verbose=False)["train"], "eval": None}
    engines = [(f"hf, batch {b}", ["feature_store.engine=hf", f"feature_store.batch_size={b}"])
               for b in map(int, args.hf_batch_sizes.split(","))]
    engines.append(("vllm", ["feature_store.engine=vllm"]))
    passes: dict[str, list[dict]] = {name: [] for name, _ in engines}
    work = Path(tempfile.mkdtemp(prefix="bench-features-"))
    try:
        for r in range(args.rounds):
            for name, extra in engines:
                one = one_pass(compose("eagle", overrides + extra), target, splits, work / "store")
                passes[name].append(one)
                print(f"[bench] round {r + 1}, {name}: {one['tokens']:,} tokens in {one['seconds']:.1f} s "
                      f"({one['tokens_per_s']:.0f} tokens/s)", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = {name: min(p["seconds"] for p in ps) for name, ps in passes.items()}
    best_hf = min(v for k, v in best.items() if k.startswith("hf"))
    report = {"machine": platform.processor() or platform.machine(), "overrides": overrides,
              "examples": len(splits["train"]), "passes": passes, "best_seconds": best,
              "vllm_vs_best_hf": best_hf / best["vllm"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    tokens = passes["vllm"][0]["tokens"]
    print(f"| engine | seconds per store (best of {args.rounds}) | tokens/s | vs best HF |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.1f} | {tokens / seconds:.0f} | {best_hf / seconds:.2f}x |")
    return report


if __name__ == "__main__":
    from selfspec.core.errors import reported_errors

    with reported_errors():  # a mistyped key or a bad setting: one error line, exit 2
        main()
