"""Tau against training data: EAGLE-3 and DFlash drafters trained on growing amounts of data from two sources (the
data's own answers, and answers the target regenerated with vLLM), each measured alone on the same held-out prompts
in one benchmark run, a fitted curve, and the data each tau would take if the trend holds.

    python scripts/tau_curve.py                                  # SmolLM2, 500-4000 conversations, both sources
    python scripts/tau_curve.py --sizes 250,500,1000,2000 --families dflash --epochs 2
    python scripts/tau_curve.py --sizes 8,16,32,64 --out /tmp/curve model=tiny model.tiny.hidden_size=128   # a dry run

Each run is one command of the project's own (printed before it runs, so any cell can be rerun by hand), and a rerun
skips what is done: the regenerated file resumes (scripts/regenerate.py engine=vllm, first turns, ``n`` = the largest
size), one feature store per source and size serves both families (feature_store.engine=vllm by default), a run
whose heads exist is not trained again. The families are those whose rows read target layers (core/families.py:
``reads_layers``), unless ``--families`` names others. Every run is ``selfspec-train <family>`` (``python -m
selfspec.train.cli``) with the family's CPU hour recipe (experiment=<family>_cpu_1h) for ``--epochs`` passes over its data instead of an hour. Then one ``scripts/bench.py`` run decodes every drafter
alone (no suffix drafter) at its full depth every step (``draft.adaptive=false``: the default decoder's adaptive depth
drafts nothing where drafts do not pay on this machine, and its tau would then say 1.0 of a drafter that accepts
something), interleaved prompt by prompt, and the curve is fitted per family and source as tau = a + b log2(training
tokens).

Writes ``--out``/curve.json, curve.md (the table, the fit, the commands) and curve.png.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

from selfspec.core.config import compose
from selfspec.core.families import FAMILIES
from selfspec.train.features import layer_readers

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("original", "regenerated")
MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"


def fit_curve(points: list[tuple[float, float]]) -> dict:
    """Least squares tau = a + b log2(tokens) over ``points`` (tokens, tau); with the tokens that would reach tau 2
    and 3 on that line (None where the slope is not positive)."""
    xs = [math.log2(t) for t, _ in points]
    ys = [tau for _, tau in points]
    n = len(points)
    if n < 2:
        raise ValueError("a curve needs at least two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    reach = {str(goal): (2 ** ((goal - a) / b) if b > 0 else None) for goal in (2, 3)}
    return {"a": a, "b_per_doubling": b, "tokens_for_tau": reach}


def steps_for(examples: int, epochs: float, batch_size: int) -> int:
    """Optimizer steps for ``epochs`` passes over ``examples`` in batches of ``batch_size`` (at least one)."""
    return max(1, math.ceil(epochs * examples / batch_size))


def run(cmd: list[str], log: Path) -> None:
    print(f"[tau_curve] {shlex.join(cmd)}", file=sys.stderr)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        code = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"error: that command failed (exit {code}); its output is in {log}")


def data_overrides(source: str, size: int, regenerated: Path) -> list[str]:
    if source == "original":
        return [f"data.max_records={size}"]
    return ["data=file", f"data.path={regenerated}", f"data.max_records={size}"]


def store_tokens(store: Path) -> int:
    meta = json.loads((store / "meta.json").read_text())
    return int(meta["splits"]["train"]["num_tokens"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="500,1000,2000,4000", help="conversations per run (each twice the last)")
    parser.add_argument("--sources", default=",".join(SOURCES))
    parser.add_argument("--families", default=",".join(layer_readers()),
                        help="trained families (default: those whose rows read target layers, which one feature "
                        "store per source and size serves)")
    parser.add_argument("--epochs", type=float, default=3.0, help="passes over each run's data")
    parser.add_argument("--store-engine", default="vllm", choices=("hf", "vllm"))
    parser.add_argument("--regenerated", default=None, help="the regenerated JSONL (default: <out>/regenerated.jsonl)")
    parser.add_argument("--prompts", default=f"[{MT_BENCH},humaneval]", help="bench prompts (held out from training)")
    parser.add_argument("--limit", type=int, default=16, help="questions of each prompt source (0: all)")
    parser.add_argument("--out", default="outputs/tau_curve")
    parser.add_argument("--bench-args", default="", help="more scripts/bench.py keys (e.g. \"dtype=bfloat16\"); the "
                        "target comes from the heads")
    parser.add_argument("overrides", nargs="*",
                        help="keys regeneration and training take (model=..., data.max_length=...)")
    args = parser.parse_args(argv)

    unknown = [f for f in args.families.split(",") if f not in FAMILIES or not FAMILIES[f].trains]
    if unknown:
        parser.error(f"--families: {unknown[0]!r} is not a family that trains: one of "
                     f"{', '.join(n for n, f in FAMILIES.items() if f.trains)}")

    sizes = sorted(int(s) for s in args.sizes.split(","))
    sources, families = args.sources.split(","), args.families.split(",")
    out = Path(args.out).resolve()
    regenerated = Path(args.regenerated).resolve() if args.regenerated else out / "regenerated.jsonl"
    py = sys.executable
    if "regenerated" in sources:
        run([py, "scripts/regenerate.py", "engine=vllm", f"n={sizes[-1]}", "max_turns=1", f"out={regenerated}",
             *args.overrides], out / "logs" / "regenerate.log")
    runs = []
    for source in sources:
        for size in sizes:
            store = out / "stores" / f"{source}-{size}"
            for family in families:
                row = FAMILIES[family]
                name = f"{family}-{source}-{size}"
                run_dir = out / "runs" / name
                base = [f"experiment={family}_cpu_1h", *data_overrides(source, size, regenerated), *args.overrides]
                cfg = compose(row.train_conf, [*row.train_overrides(), *base])  # as selfspec-train composes it
                common = ["features=store", f"feature_store.engine={args.store_engine}", f"feature_store.dir={store}",
                          f"run_dir={run_dir}", "trainer.max_minutes=null", "trainer.eval_every=0",
                          "speed_check.prompts=0"]
                if not (run_dir / "heads" / "config.json").is_file():
                    examples = size  # an upper bound before the data is read: the split's own count sets the steps
                    if (store / "meta.json").is_file():
                        examples = json.loads((store / "meta.json").read_text())["splits"]["train"]["num_examples"]
                    steps = steps_for(examples, args.epochs, int(cfg.trainer.batch_size))
                    run([py, "-m", "selfspec.train.cli", family, *base, *common, f"trainer.max_steps={steps}"],
                        out / "logs" / f"{name}.log")
                runs.append({"name": name, "family": family, "source": source, "conversations": size,
                             "train_tokens": store_tokens(store), "heads": str(run_dir / "heads")})
    bench_out = out / "bench"
    run([py, "scripts/bench.py", f"heads=[{','.join(r['heads'] for r in runs)}]", "methods=[hf,heads]",
         f"prompts={args.prompts}", *([f"limit={args.limit}"] if args.limit else []), "max_new_tokens=128",
         "draft.adaptive=false", f"out={bench_out}",
         *shlex.split(args.bench_args)], out / "logs" / "bench.log")
    report = json.loads((bench_out / "bench.json").read_text())
    groups = [g for g in next(iter(report["figures"].values())) if g.startswith("all ")] or ["overall"]
    for r in runs:
        method = next(m for m in report["figures"] if m.endswith(f":{r['name']}"))
        r["tau"] = {g: report["figures"][method][g]["tau"] for g in [*groups, "overall"]}
    fits = {}
    for family in families:
        for source in sources:
            for g in [*groups, "overall"]:
                points = [(r["train_tokens"], r["tau"][g]) for r in runs
                          if r["family"] == family and r["source"] == source and r["tau"][g]]
                if len(points) >= 2:
                    fits[f"{family} {source} {g}"] = fit_curve(points)
    result = {"runs": runs, "fits": fits, "epochs": args.epochs, "overrides": args.overrides,
              "command": shlex.join(["python", "scripts/tau_curve.py", *(argv if argv is not None else sys.argv[1:])])}
    (out / "curve.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, groups, out / "curve.md")
    plot(result, groups, out / "curve.png")
    print((out / "curve.md").read_text())
    return result


def write_markdown(result: dict, groups: list[str], path: Path) -> None:
    lines = [f"| family | source | conversations | training tokens | {' | '.join(f'tau, {g}' for g in groups)} |",
             "|---|---|---|---|" + "---|" * len(groups)]
    for r in result["runs"]:
        taus = " | ".join("-" if r["tau"][g] is None else f"{r['tau'][g]:.3f}" for g in groups)
        lines.append(f"| {r['family']} | {r['source']} | {r['conversations']:,} | {r['train_tokens']:,} | {taus} |")
    lines += ["", "| fit | tau gained per doubling | tokens for tau 2 | tokens for tau 3 |", "|---|---|---|---|"]
    for name, f in result["fits"].items():
        reach = [("-" if v is None else f"{v:.3g}") for v in f["tokens_for_tau"].values()]
        lines.append(f"| {name} | {f['b_per_doubling']:+.3f} | {reach[0]} | {reach[1]} |")
    lines += ["", f"`{result['command']}`"]
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, groups: list[str], path: Path) -> None:
    # deferred: matplotlib (slow to import) only when the plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    # deferred: matplotlib (slow to import) only when the plot is drawn
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, g in zip(axes[0], groups):
        for key in sorted({(r["family"], r["source"]) for r in result["runs"]}):
            pts = sorted((r["train_tokens"], r["tau"][g]) for r in result["runs"]
                         if (r["family"], r["source"]) == key and r["tau"][g])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" ".join(key))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training tokens")
        ax.set_ylabel("tau (drafter alone)")
        ax.set_title(g)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    from selfspec.core.errors import reported_errors

    with reported_errors():  # a mistyped key or a bad setting: one error line, exit 2
        main()
