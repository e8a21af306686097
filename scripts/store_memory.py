"""Peak memory of store-fed training against the target's depth: random Llama targets of one shape (hidden size,
vocabulary, heads, MLP) with 4 and with 32 decoder layers, each saved as a sharded safetensors checkpoint; a feature
store built from each (the store's hidden states depend on every layer, so each target builds its own); then
EAGLE-3 and DFlash trained from the store, each in a fresh process, whose peak resident set (VmHWM, the process's own
since it started) is reported. A store-fed trainer materialises only the target's embeddings, final norm and LM head
(core/target_parts.py), so its peak should not grow with the layers; the run that builds the store holds the whole
target while it builds, which shows what the layers would cost.

    python scripts/store_memory.py                                  # 4 and 32 layers, hidden 1024, vocab 32768
    python scripts/store_memory.py --layers 4,32 --hidden 1024 --vocab 32768 --steps 3 --out outputs/store_memory

Writes ``--out``/report.json and prints a Markdown table (docs/benchmarks.md, "Store-fed training memory").
tests/test_target_parts.py runs it at the default shape. The subcommands ``make-target`` and ``train`` are the
processes it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

PEAK = "store_memory peak_rss_bytes"


def make_target(out: Path, layers: int, hidden: int, vocab: int, shard: str) -> None:
    """A random Llama of the given shape (heads of 128, 4 query heads per key-value head, MLP 3.5x as Llama-3-8B's),
    saved with the byte-level tokenizer as a safetensors checkpoint in shards of ``shard``."""
    from selfspec.core.target import build_tiny

    heads = max(1, hidden // 128)
    model, tokenizer = build_tiny("llama", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                                  intermediate_size=int(3.5 * hidden), max_position_embeddings=512)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size=shard)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)  # whole or absent: a folder with config.json is a finished checkpoint


def conversations(path: Path, n: int = 32) -> None:
    """``n`` ShareGPT conversations of arithmetic sequences (the byte tokenizer: a token per character)."""
    rows = []
    for i in range(n):
        start, step = 3 + 7 * i, 2 + i % 5
        seq = [str(start + step * t) for t in range(30)]
        rows.append({"conversations": [{"from": "human", "value": "Continue: " + " ".join(seq[:4])},
                                       {"from": "gpt", "value": " ".join(seq[4:])}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def train_child(family: str, overrides: list[str]) -> None:
    """The training entry (selfspec-train FAMILY OVERRIDES...) in this process, printing its peak resident set last."""
    import atexit

    import torch

    from selfspec.core.runtime import peak_memory_bytes

    atexit.register(lambda: print(f"{PEAK} {peak_memory_bytes(torch.device('cpu'))}", flush=True))
    from selfspec.train.cli import main

    sys.argv = [sys.argv[0], *overrides]
    main(family)


def _run(args: list[str], log: Path) -> tuple[int | None, float]:
    """Run this script with ``args`` in a fresh process; (its peak resident set in bytes, seconds)."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=f, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:2])} failed (exit {proc.returncode}); see {log}")
    found = re.findall(rf"^{PEAK} (\d+)$", proc.stdout, re.M)
    return (int(found[-1]) if found else None), seconds


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="4,32", help="the decoder layer counts compared")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=2, help="training steps of each run")
    parser.add_argument("--families", default="eagle3,dflash")
    parser.add_argument("--out", default="outputs/store_memory")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "conversations.jsonl"
    conversations(data)
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": _machine(), "command": " ".join(sys.argv),
                    "shape": {"hidden": args.hidden, "vocab": args.vocab}, "runs": {}}
    from selfspec.heads.eagle import default_layer_ids

    for layers in map(int, args.layers.split(",")):
        folder = out / f"target-{layers}"
        if not (folder / "config.json").is_file():
            _run(["make-target", "--layers", str(layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
                  "--out", str(folder)], out / f"make-target-{layers}.log")
        eagle3 = default_layer_ids(layers)  # DFlash's are one less: the outputs of the layers before (one store)
        common = ["model.source=hub", f"model.name_or_path={folder}", "model.dtype=float32", "model.device=cpu",
                  "trainer.target_dtype=float32", "data=file", f"data.path={data}", "data.max_length=160",
                  "data.max_records=32", f"trainer.max_steps={args.steps}", "trainer.batch_size=4",
                  "trainer.warmup_steps=0", "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1",
                  "speed_check.prompts=null", "logger=none", "features=store", "feature_store.dtype=float16",
                  f"feature_store.dir={out / f'features-{layers}'}", "trainer.overwrite=true"]
        per_family = {"eagle3": [f"heads.layer_ids=[{','.join(map(str, eagle3))}]"],
                      "dflash": [f"heads.target_layer_ids=[{','.join(str(i - 1) for i in eagle3)}]"]}
        runs = {"checkpoint_bytes": _folder_bytes(folder)}
        families = args.families.split(",")
        for i, family in enumerate(families):
            name = f"{family}-{layers}"
            overrides = common + per_family[family] + [f"run_dir={out / 'runs' / name}"]
            if i == 0 and not (out / f"features-{layers}" / "meta.json").is_file():  # builds the store first
                peak, seconds = _run(["train", family, *overrides], out / f"build-{name}.log")
                runs["build_and_train"] = {"family": family, "peak_rss_bytes": peak, "seconds": seconds}
                print(f"[store_memory] {layers} layers: store built and {family} trained, peak "
                      f"{peak / 2**20:,.0f} MiB in {seconds:.0f} s", file=sys.stderr)
            peak, seconds = _run(["train", family, *overrides], out / f"{name}.log")
            runs[family] = {"peak_rss_bytes": peak, "seconds": seconds}
            print(f"[store_memory] {layers} layers: {family} from the store, peak {peak / 2**20:,.0f} MiB in "
                  f"{seconds:.0f} s", file=sys.stderr)
        report["runs"][str(layers)] = runs
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    return report


def table(report: dict) -> str:
    """The report as a Markdown table: a row per layer count, peak resident set of each run in MiB."""
    runs = report["runs"]
    families = [k for k in next(iter(runs.values())) if k not in ("checkpoint_bytes", "build_and_train")]
    head = ["layers", "checkpoint", "store build + training"] + [f"{f} from the store" for f in families]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mib = lambda b: f"{b / 2**20:,.0f} MiB" if b else "-"  # noqa: E731
    for layers, r in runs.items():
        build = r.get("build_and_train", {}).get("peak_rss_bytes")
        lines.append("| " + " | ".join([layers, mib(r["checkpoint_bytes"]), mib(build)]
                                       + [mib(r[f]["peak_rss_bytes"]) for f in families]) + " |")
    return "\n".join(lines)


def _machine() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        return f"{name.group(1) if name else platform.processor()}, {os.cpu_count()} cores"
    except OSError:
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    if sys.argv[1:2] == ["make-target"]:
        p = argparse.ArgumentParser()
        for key in ("--layers", "--hidden", "--vocab"):
            p.add_argument(key, type=int, required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--shard", default="200MB")
        a = p.parse_args(sys.argv[2:])
        make_target(Path(a.out), a.layers, a.hidden, a.vocab, a.shard)
    elif sys.argv[1:2] == ["train"]:
        train_child(sys.argv[2], sys.argv[3:])
    else:
        main()
