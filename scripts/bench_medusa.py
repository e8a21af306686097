"""Benchmark Medusa heads: per-head top-1/top-5 accuracy on held-out answers, training throughput, peak memory.

    python scripts/bench_medusa.py --heads outputs/medusa-smollm2/heads       # accuracy of trained heads
    python scripts/bench_medusa.py --train-steps 20                           # tokens/s and peak memory of training
    python scripts/bench_medusa.py --heads outputs/medusa-smollm2/heads --train-steps 20
    python scripts/bench_medusa.py --train-steps 10 -- experiment=debug heads=medusa2   # config overrides after --

The config is conf/medusa.yaml with the overrides after ``--``: the model, data and trainer of the run to measure.
Accuracy is measured on the data config's held-out ``eval`` split (the answers the heads did not train on when the
same data config trained them; ``--split train`` or another ``data=...`` for others), at every labelled position:
head k is right when its top-1 (top-5) token equals the answer's token k + 2 ahead. The expected accepted lengths
are derived from them (chain: sum_k prod_{j<=k} top-1 accuracy; a full top-5 tree likewise from top-5), assuming
independent heads; decoding measures the real acceptance.

Throughput is measured by training ``--train-steps`` steps into a temporary folder (no checkpoints, no eval) and
averaging tokens/s over the steps after the first ``--skip-steps``; peak memory is the CUDA peak allocated on a GPU,
else the peak resident memory of the process (target, data and training together).

Writes a JSON report (``--out``, default outputs/<run_name>/bench_medusa.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hydra import compose as hydra_compose, initialize_config_dir
from omegaconf import open_dict

from selfspec.core.config import CONF_DIR


def compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="medusa", overrides=overrides)


def measure_accuracy(cfg, heads_path: str, split: str, max_examples: int | None, batch_size: int) -> dict:
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec import heads
    from selfspec.core.target import load_target
    from selfspec.train.data import build_dataset
    from selfspec.train.medusa_method import evaluate_heads

    target = load_target(cfg.model)
    loaded = heads.load(heads_path, target)  # refuses heads of another target; applies a Medusa-2 adapter
    dataset = build_dataset(cfg.data, target.tokenizer)[split]
    if max_examples is not None and len(dataset) > max_examples:
        dataset = dataset.select(range(max_examples))
    if len(dataset) == 0:
        raise SystemExit(f"The {split} split is empty: raise data.eval_fraction or data.max_records, or use --split.")
    start = time.perf_counter()
    metrics = evaluate_heads(loaded.module, loaded.target, dataset, target.tokenizer.pad_token_id, batch_size,
                             decay=float(cfg.heads.decay))
    num_heads = loaded.config["num_heads"]
    return {
        "heads": str(heads_path),
        "base_model": loaded.config.get("base_model"),
        "method": loaded.config.get("method"),
        "trained_steps": loaded.config.get("steps"),
        "split": split,
        "examples": len(dataset),
        "positions": int(metrics["eval/positions"]),
        "acc1": [metrics[f"eval/acc1_head{k}"] for k in range(num_heads)],
        "acc5": [metrics[f"eval/acc5_head{k}"] for k in range(num_heads)],
        "loss": [metrics[f"eval/loss_head{k}"] for k in range(num_heads)],
        "expected_accept_length_chain": metrics["eval/accept_length_chain"],
        "expected_accept_length_top5_tree": metrics["eval/accept_length_top5_tree"],
        "seconds": time.perf_counter() - start,
    }


def measure_training(overrides: list[str], steps: int, skip: int) -> dict:
    # deferred: torch and the target only once the arguments are read, so --help answers at once
    import torch

    from selfspec.train.loop import train
    from selfspec.train.medusa_method import medusa_method

    with tempfile.TemporaryDirectory(prefix="bench-medusa-") as tmp:
        cfg = compose(overrides + [f"run_dir={tmp}", f"trainer.max_steps={steps}", "trainer.save_every=0",
                                   "trainer.eval_every=0", "trainer.eval_max_examples=0", "trainer.log_every=1"])
        with open_dict(cfg):
            cfg.trainer.resume = False
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        result = train(cfg, medusa_method(cfg))
    history = result.history[skip:] or result.history
    windows = [h["tokens_per_s"] for h in history] or [result.train_tokens_per_s]
    seen = [0] + [h["tokens_seen"] for h in result.history]
    step_tokens = [b - a for a, b in zip(seen, seen[1:])][skip:] or [0]
    step_seconds = [n / max(h["tokens_per_s"], 1e-9) for n, h in zip(step_tokens, history)]
    return {
        "steps": result.steps,
        "method": cfg.heads.type,
        "model": cfg.model.get("name_or_path") or cfg.model.source,
        "batch_size": cfg.trainer.batch_size,
        "gradient_accumulation_steps": cfg.trainer.gradient_accumulation_steps,
        "max_length": cfg.data.max_length,
        "features": cfg.features,
        "tokens_per_s": sum(windows) / len(windows),
        "tokens_per_s_all_steps": result.train_tokens_per_s,
        "seconds_per_step": sum(step_seconds) / max(len(step_seconds), 1),
        "peak_memory_gib": result.peak_memory_bytes / 2**30,
        "peak_memory_kind": "cuda_max_allocated" if torch.cuda.is_available() else "process_max_rss",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "first_loss": result.history[0]["loss"] if result.history else None,
        "last_loss": result.history[-1]["loss"] if result.history else None,
    }


def print_report(report: dict) -> None:
    acc = report.get("accuracy")
    if acc:
        print(f"\nHeads {acc['heads']} ({acc['method']}, {acc['trained_steps']} steps) on {acc['examples']} "
              f"{acc['split']} examples, {acc['positions']:,} positions:")
        print(f"  {'head':>6} {'top-1':>7} {'top-5':>7} {'loss':>7}")
        for k, (a1, a5, loss) in enumerate(zip(acc["acc1"], acc["acc5"], acc["loss"])):
            print(f"  {k:>6} {a1:>7.3f} {a5:>7.3f} {loss:>7.3f}")
        print(f"  expected accepted tokens per step: chain {acc['expected_accept_length_chain']:.3f}, "
              f"full top-5 tree {acc['expected_accept_length_top5_tree']:.3f} (tokens per target forward = 1 + this)")
    tr = report.get("training")
    if tr:
        print(f"\nTraining {tr['method']} on {tr['model']} ({tr['device']}, batch {tr['batch_size']} x "
              f"{tr['gradient_accumulation_steps']}, max_length {tr['max_length']}, features {tr['features']}): "
              f"{tr['tokens_per_s']:,.0f} tokens/s ({tr['seconds_per_step']:.2f} s/step) over {tr['steps']} steps, "
              f"peak memory {tr['peak_memory_gib']:.2f} GiB ({tr['peak_memory_kind']})")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--heads", help="a heads folder to measure accuracy of (outputs/<run>/heads)")
    parser.add_argument("--split", default="eval", choices=["eval", "train"])
    parser.add_argument("--max-examples", type=int, default=None, help="cap on examples for accuracy")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=0, help="training steps to time (0: skip)")
    parser.add_argument("--skip-steps", type=int, default=1, help="first steps left out of tokens/s (warm-up)")
    parser.add_argument("--out", help="JSON report path (default outputs/<run_name>/bench_medusa.json)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of conf/medusa.yaml, after --")
    args = parser.parse_args(argv)
    if not args.heads and not args.train_steps:
        parser.error("nothing to measure: give --heads and/or --train-steps")

    cfg = compose(args.overrides)
    report: dict = {"config_overrides": args.overrides}
    if args.heads:
        report["accuracy"] = measure_accuracy(cfg, args.heads, args.split, args.max_examples, args.batch_size)
    if args.train_steps:
        report["training"] = measure_training(args.overrides, args.train_steps, args.skip_steps)
    out = Path(args.out) if args.out else Path("outputs") / str(cfg.run_name) / "bench_medusa.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"\nreport: {out}")
    return report


if __name__ == "__main__":
    from selfspec.core.errors import reported_errors

    with reported_errors():  # a mistyped key or a bad setting: one error line, exit 2
        main()
