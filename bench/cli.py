"""The benchmarks' commands: the decoding benchmark (``selfspec-bench``, scripts/bench.py) and the benchmarks of
learning while decoding (scripts/stream_bench.py, scripts/learn_replay.py), whose docstrings list the commands; the
installed one takes the same arguments.

    selfspec-bench heads=[outputs/medusa-smollm2/heads] prompts=../shared/data/mt_bench/question.jsonl limit=10

Each command's config is in conf/decode/ (bench.yaml, stream.yaml, learn_replay.yaml); its library is bench/.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from selfspec.core.config import CONF_DIR, compose
from selfspec.core.errors import reported_errors

DECODE_CONF = CONF_DIR / "decode"


# --- selfspec-bench: scripts/bench.py --------------------------------------------------------------------------------


def bench(argv: list[str] | None = None) -> dict:
    """Run the benchmark (conf/decode/bench.yaml with the overrides ``argv``); SystemExit(1) after writing the outputs
    if a method is not lossless."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = compose("bench", argv, config_dir=DECODE_CONF)  # first: a mistyped key is told at once
    from selfspec.bench import format_report, run_bench  # deferred: after the config, so a typo is told before torch

    report = run_bench(cfg, command=shlex.join(["python", "scripts/bench.py", *argv]))
    print(format_report(report))
    print("outputs: " + ", ".join(report["outputs"]))
    if report["mismatches"]:
        print(f"error: {len(report['mismatches'])} outputs differ from HF generate's (see above and bench.json)",
              file=sys.stderr)
        raise SystemExit(1)
    return report


def bench_main() -> None:
    with reported_errors():
        bench()


# --- scripts/stream_bench.py ------------------------------------------------------------------------------------------


def stream_bench(argv: list[str] | None = None) -> dict:
    """The learning stream benchmark (conf/decode/stream.yaml with the overrides ``argv``); SystemExit(1) after
    writing the outputs if a method's output differs from HF generate's."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = compose("stream", argv, config_dir=DECODE_CONF)  # first: a mistyped key is told at once
    from selfspec.bench.stream_bench import run_stream  # deferred: after the config, so a typo is told before torch

    report = run_stream(cfg, command=shlex.join(["python", "scripts/stream_bench.py", *argv]))
    print((Path(str(cfg.out)) / "stream.md").read_text())
    if report["mismatches"]:
        print(f"error: {len(report['mismatches'])} outputs differ from HF generate's (stream.json)", file=sys.stderr)
        raise SystemExit(1)
    return report


def stream_bench_main() -> None:
    with reported_errors():
        stream_bench()


# --- scripts/learn_replay.py ------------------------------------------------------------------------------------------


def learn_replay(argv: list[str] | None = None) -> dict:
    """Learner settings replayed on a recorded stream (conf/decode/learn_replay.yaml with the overrides ``argv``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = compose("learn_replay", argv, config_dir=DECODE_CONF)  # first: a mistyped key is told at once
    from selfspec.bench.learn_replay import run_replay  # deferred: after the config, so a typo is told before torch

    report = run_replay(cfg, command=shlex.join(["python", "scripts/learn_replay.py", *argv]))
    print((Path(str(cfg.out)) / "replay.md").read_text())
    return report


def learn_replay_main() -> None:
    with reported_errors():
        learn_replay()
