"""Peak memory of store-fed training against the target's depth: random Llama targets of one shape (hidden size,
vocabulary, heads, MLP as Llama-3-8B's in proportion) with 4 and with 32 decoder layers, each saved as a sharded
safetensors checkpoint, and a feature store built from each (its hidden states depend on every layer, so each target
builds its own); then EAGLE-3 and DFlash trained from the store, each in a fresh process (the entry point, as
``selfspec-train eagle3 features=store ...`` runs), whose peak resident set is reported: VmHWM, the process's own
since it started. A store-fed trainer materialises only the target's embeddings, final norm and LM head
(core/target_parts.py), so its peak should not grow with the layers; the table also gives what the layers weigh.

    python scripts/store_memory.py                                  # 4 and 32 layers, hidden 1024, vocab 32768
    python scripts/store_memory.py --layers 4,32 --hidden 1024 --vocab 32768 --out outputs/store_memory

Writes ``--out``/report.json and prints a Markdown table (docs/benchmarks.md, "Store-fed training memory").
tests/test_target_parts.py runs it at the default shape. The processes it starts are this script's subcommands
``prepare`` (the targets and their stores, in one process whose memory is not measured) and ``train FAMILY
OVERRIDES...`` (one measured run); the measured runs go ``--jobs`` at a time (memory is per process).
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
from typing import Any

PEAK = "store_memory peak_rss_bytes"


def make_target(out: Path, layers: int, hidden: int, vocab: int, shard_bytes: int = 200 * 2**20) -> None:
    """A random Llama of the given shape (heads of 128, 4 query heads per key-value head, MLP 3.5x the hidden size as
    Llama-3-8B's), saved with the byte-level tokenizer as a safetensors checkpoint in shards of about
    ``shard_bytes``: random normal matrices (scaled as build_tiny scales them), norms at one."""
    # deferred: each process of this script imports what its part needs (the measured one's peak counts every import)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from selfspec.core.target import build_tiny_tokenizer

    heads = max(1, hidden // 128)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 4), intermediate_size=int(3.5 * hidden),
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict] = [{}]
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensor = torch.ones(shape)
        else:  # as selfspec.core.target.build_tiny scales them: peaked, varied next-token distributions
            std = 1.0 if "embed" in name else 0.4 if "lm_head" in name else 0.08
            tensor = torch.randn(shape, generator=gen) * std
        if sum(t.numel() * 4 for t in shards[-1].values()) + tensor.numel() * 4 > shard_bytes and shards[-1]:
            shards.append({})
        shards[-1][name] = tensor
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, tensors in zip(files, shards):
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * 4 for s in shards for t in s.values())},
             "weight_map": {name: file for file, s in zip(files, shards) for name in s}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(tmp)
    build_tiny_tokenizer().save_pretrained(tmp)
    os.replace(tmp, out)  # whole or absent: a folder with config.json is a finished checkpoint


def conversations(path: Path, n: int) -> None:
    """``n`` short ShareGPT conversations of arithmetic sequences (the byte tokenizer: a token per character, ~40 in
    all with the chat template)."""
    rows = []
    for i in range(n):
        start, step = 3 + 7 * i, 2 + i % 5
        seq = [str(start + step * t) for t in range(7)]
        rows.append({"conversations": [{"from": "human", "value": "Go: " + " ".join(seq[:2])},
                                       {"from": "gpt", "value": " ".join(seq[2:])}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def overrides_for(out: Path, layers: int, family: str, examples: int) -> list[str]:
    """The training overrides of ``family`` on the ``layers``-layer target: from its store, one step, no speed check.
    EAGLE-3 fuses the inputs of its default layers, DFlash the outputs of the layers before them: one store."""
    # deferred: each process of this script imports what its part needs (the measured one's peak counts every import)
    from selfspec.heads.eagle import default_layer_ids

    eagle3 = default_layer_ids(layers)
    common = ["model.source=hub", f"model.name_or_path={out / f'target-{layers}'}", "model.dtype=float32",
              "model.device=cpu", "trainer.target_dtype=float32", "data=file", f"data.path={out / 'data.jsonl'}",
              "data.max_length=48", f"data.max_records={examples}", "data.eval_fraction=0", "trainer.max_steps=1",
              "trainer.batch_size=4",
              "trainer.warmup_steps=0", "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1",
              "speed_check.prompts=null", "logger=none", "features=store", "feature_store.dtype=float16",
              f"feature_store.dir={out / f'features-{layers}'}", "trainer.overwrite=true",
              f"run_dir={out / 'runs' / f'{family}-{layers}'}"]
    if family == "eagle3":
        return common + [f"heads.layer_ids=[{','.join(map(str, eagle3))}]"]
    if family == "dflash":
        return common + [f"heads.target_layer_ids=[{','.join(str(i - 1) for i in eagle3)}]",
                         "heads.anchors_per_sequence=4"]
    raise SystemExit(f"--families: eagle3 or dflash, not {family!r}")


def prepare(out: Path, layer_counts: list[int], hidden: int, vocab: int, family: str, examples: int) -> None:
    """Each target (when missing) and its store (a run of ``family`` that builds it, when missing), in this process."""
    # deferred: each process of this script imports what its part needs (the measured one's peak counts every import)
    from selfspec.core.config import compose
    from selfspec.core.families import FAMILIES
    from selfspec.train.families import METHODS
    from selfspec.train.loop import train

    chosen = FAMILIES[family]
    for layers in layer_counts:
        folder = out / f"target-{layers}"
        if not (folder / "config.json").is_file():
            make_target(folder, layers, hidden, vocab)
        if not (out / f"features-{layers}" / "meta.json").is_file():
            cfg = compose(chosen.train_conf, chosen.train_overrides() + overrides_for(out, layers, family, examples))
            train(cfg, METHODS[family](cfg))


def train_child(family: str, overrides: list[str]) -> None:
    """The training entry (selfspec-train FAMILY OVERRIDES...) in this process, printing its peak resident set last."""
    # deferred: each process of this script imports what its part needs (the measured one's peak counts every import)
    import atexit

    import torch

    from selfspec.core.runtime import peak_memory_bytes

    atexit.register(lambda: print(f"{PEAK} {peak_memory_bytes(torch.device('cpu'))}", flush=True))
    # deferred: each process of this script imports what its part needs (the measured one's peak counts every import)
    from selfspec.train.cli import main

    sys.argv = [sys.argv[0], *overrides]
    main(family)


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen, float, Any]:
    f = open(log, "w")
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=f, text=True), \
        time.perf_counter(), f


def _finish(started: tuple[subprocess.Popen, float, Any], log: Path) -> tuple[int | None, float]:
    """(the peak resident set a started run printed, its seconds); exits with where to look when it failed."""
    proc, start, f = started
    stdout, _ = proc.communicate()
    seconds = time.perf_counter() - start
    f.close()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(proc.args[2:4])} failed (exit {proc.returncode}); see {log}")
    found = re.findall(rf"^{PEAK} (\d+)$", stdout, re.M)
    return (int(found[-1]) if found else None), seconds


def _sizes(folder: Path) -> tuple[int, int]:
    """(bytes of a checkpoint's tensors, of its decoder layers), read from the safetensors headers."""
    # deferred: each process of this script imports what its part needs (the measured one's peak counts every import)
    from safetensors import safe_open

    total = layers = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                size = {"F32": 4, "F16": 2, "BF16": 2}.get(sl.get_dtype(), 4)
                for d in sl.get_shape():
                    size *= d
                total += size
                layers += size if ".layers." in key else 0
    return total, layers


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="4,32", help="the decoder layer counts compared")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--examples", type=int, default=6, help="conversations (the store's examples)")
    parser.add_argument("--families", default="eagle3,dflash")
    parser.add_argument("--jobs", type=int, default=4, help="measured runs at a time")
    parser.add_argument("--out", default="outputs/store_memory")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    conversations(out / "data.jsonl", args.examples)
    families, counts = args.families.split(","), [int(n) for n in args.layers.split(",")]
    started = time.perf_counter()
    log = out / "prepare.log"
    _finish(_start(["prepare", "--out", str(out), "--layers", args.layers, "--hidden", str(args.hidden), "--vocab",
                    str(args.vocab), "--examples", str(args.examples), "--family", families[0]], log), log)
    prepared = time.perf_counter() - started
    print(f"[store_memory] targets and stores ready in {prepared:.0f} s", file=sys.stderr)
    runs = [(layers, family) for layers in counts for family in families]
    peaks: dict[tuple[int, str], tuple[int | None, float]] = {}
    for i in range(0, len(runs), max(1, args.jobs)):
        batch = runs[i:i + max(1, args.jobs)]
        logs = {run: out / f"{run[1]}-{run[0]}.log" for run in batch}
        live = {run: _start(["train", run[1], *overrides_for(out, *run, args.examples)], logs[run]) for run in batch}
        for run, handle in live.items():
            peaks[run] = _finish(handle, logs[run])
            print(f"[store_memory] {run[0]} layers, {run[1]} from the store: peak {peaks[run][0] / 2**20:,.0f} MiB "
                  f"({peaks[run][1]:.0f} s)", file=sys.stderr)
    report: dict = {
        "date": time.strftime("%Y-%m-%d"), "machine": _machine(), "families": families,
        "command": "python scripts/store_memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": {"hidden": args.hidden, "vocab": args.vocab}, "prepare_seconds": prepared, "runs": {}}
    for layers in counts:
        total, layer_bytes = _sizes(out / f"target-{layers}")
        report["runs"][str(layers)] = {
            "target_bytes": total, "layers_bytes": layer_bytes,
            **{f: {"peak_rss_bytes": peaks[(layers, f)][0], "seconds": peaks[(layers, f)][1]} for f in families}}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    return report


def table(report: dict) -> str:
    """The report as a Markdown table: a row per layer count, the target's sizes and each run's peak resident set."""
    head = ["layers", "target (float32)", "its decoder layers"] + [f"{f} from the store: peak RSS"
                                                                   for f in report["families"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    for layers, r in report["runs"].items():
        lines.append("| " + " | ".join([layers, mib(r["target_bytes"]), mib(r["layers_bytes"])]
                                       + [mib(r[f]["peak_rss_bytes"]) for f in report["families"]]) + " |")
    return "\n".join(lines)


def _machine() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        return f"{name.group(1) if name else platform.processor()}, {os.cpu_count()} cores"
    except OSError:
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        p = argparse.ArgumentParser()
        p.add_argument("--out", required=True)
        p.add_argument("--layers", required=True)
        for key in ("--hidden", "--vocab", "--examples"):
            p.add_argument(key, type=int, required=True)
        p.add_argument("--family", required=True)
        a = p.parse_args(sys.argv[2:])
        prepare(Path(a.out), [int(n) for n in a.layers.split(",")], a.hidden, a.vocab, a.family, a.examples)
    elif sys.argv[1:2] == ["train"]:
        train_child(sys.argv[2], sys.argv[3:])
    else:
        main()
