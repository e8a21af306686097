"""The benchmarks: decoding (the library behind scripts/bench.py and scripts/sweep_trees.py; batch size 1), and
learning while decoding (stream_bench.py, learn_replay.py: scripts/stream_bench.py, scripts/learn_replay.py); their
commands are cli.py's. The one room that reads ``decode``, ``serve`` and ``train`` together.

- :func:`run_bench` (run.py): every decoding method (methods.py: HF generate, its prompt lookup and early-exit
  assistants, plain decoding in the engine, one drafter per heads folder, every training-free drafter of
  decode/registry.py, and vLLM's rows when named, vllm.py) on the same prompts (prompts.py), interleaved prompt by
  prompt, every output checked token by token against HF generate's (greedy);
- the early-exit assistant's layer, swept when not given (early_exit.py);
- what verifying and drafting cost here (cost.py): the verify cost curve and each drafter's own draft step;
- the figures (figures.py): tau, acceptance per draft depth, tokens/s, speedups, time split and peak memory per method,
  per category and per prompt source; written (report.py) as bench.json, bench.md and three PNG plots;
- :func:`sweep_decoders` (sweep.py): one target, several decoders (e.g. trees): what scripts/sweep_trees.py prints.
"""

from selfspec.bench.cost import cost_curves, draft_step_cost
from selfspec.bench.figures import source_groups, summarize_runs
from selfspec.bench.methods import HF_METHODS, METHOD_GROUPS, Method, build_methods, method_names
from selfspec.bench.prompts import load_prompts, source_name
from selfspec.bench.report import format_markdown, format_report, write_outputs
from selfspec.bench.run import check_lossless, first_difference, run_bench, run_prompts
from selfspec.bench.sweep import format_sweep, sweep_decoders

__all__ = [
    "HF_METHODS", "METHOD_GROUPS", "Method", "build_methods", "check_lossless", "cost_curves", "draft_step_cost",
    "first_difference", "format_markdown", "format_report", "format_sweep", "load_prompts", "method_names",
    "run_bench", "run_prompts", "source_groups", "source_name", "summarize_runs", "sweep_decoders", "write_outputs",
]
