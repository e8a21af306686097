"""Benchmark decoding: the verify cost curve, then tree decoding (one or more heads) vs plain decoding vs HF generate
on MT-bench prompts.

Takes the overrides of conf/decode/decode.yaml (heads, model, drafter, draft.*, device, dtype, max_new_tokens, acceptance,
...) plus a few flags of its own. Uses the first turn of each question.

    # quick check on CPU (2 questions, short answers)
    python scripts/bench_decode.py prompts=../shared/data/mt_bench/question.jsonl max_questions=2 max_new_tokens=32
    # trained heads on a GPU, a longer run
    python scripts/bench_decode.py heads=outputs/medusa-smollm2/heads device=cuda dtype=bfloat16 \
        prompts=../shared/data/mt_bench/question.jsonl max_questions=80 max_new_tokens=256
    # Medusa and EAGLE heads of one target, vanilla and HF generate, prompt by prompt in one run; figures as JSON
    python scripts/bench_decode.py heads=outputs/medusa-smollm2/heads --also eagle=outputs/eagle-smollm2/heads \
        prompts=../shared/data/mt_bench/question.jsonl --out outputs/bench/decode.json
    # the engine with PyTorch's own linear layers instead of the small-batch ones it uses on a CPU (decode/kernels.py)
    python scripts/bench_decode.py heads=outputs/medusa-smollm2/heads linear_kernel=torch \
        prompts=../shared/data/mt_bench/question.jsonl
    # only the verify cost curve (cache of 256 tokens, trees of 1..64 nodes)
    python scripts/bench_decode.py --curve-only model=smollm2 --cache-length 256
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402

from decode.bench import compare_on_prompts, format_comparison, format_cost_curve, verify_cost_curve  # noqa: E402
from decode.pipeline import DecodeSetupError, load_session, read_questions  # noqa: E402
from heads.errors import reported_errors  # noqa: E402
from heads.target import check_fingerprint  # noqa: E402


def tree_name(session) -> str:
    """The session's drafter and its settings, e.g. ``medusa tree=mc_sim_7b_63``."""
    settings = " ".join(f"{k}={v}" for k, v in session.draft_settings.items())
    return f"{session.drafter} {settings}".strip()


def compose_decode(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf" / "decode"), version_base="1.3"):
        return compose(config_name="decode", overrides=overrides)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-length", type=int, default=256, help="KV cache length for the cost curve")
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64", help="tree sizes (nodes) for the cost curve")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per size (median reported)")
    parser.add_argument("--curve-only", action="store_true", help="skip the prompt comparison")
    parser.add_argument("--also", action="append", default=[], metavar="[NAME=]HEADS",
                        help="other heads on the same target decoded in the same run (repeatable; NAME defaults to "
                             "the heads' type), e.g. --also eagle=outputs/eagle-smollm2/heads")
    parser.add_argument("--out", help="also write the figures as JSON here")
    args, overrides = parser.parse_known_args(argv)
    cfg = compose_decode(overrides)
    if not args.curve_only and not cfg.prompts:
        raise DecodeSetupError("Give prompts=FILE.jsonl (MT-bench form), or --curve-only.")
    session = load_session(cfg)
    device = next(session.target.model.parameters()).device
    print(f"target {session.target.name} on {device}, {next(session.target.model.parameters()).dtype}; "
          f"drafter {type(session.decoder.drafter).__name__}, tree {tree_name(session)}, "
          f"acceptance {cfg.acceptance}")
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = verify_cost_curve(session.target.model, args.cache_length, sizes, args.repeats)
    print("linear layers: PyTorch's own (what HF generate runs)\n" + format_cost_curve(rows, args.cache_length))
    report = {"target": session.target.name, "device": str(device), "heads": str(cfg.heads),
              "tree": tree_name(session), "linear_kernel": str(cfg.linear_kernel), "cost_curve": rows}
    if session.decoder.small_batch:  # what the engine runs (linear_kernel=auto on a CPU)
        rows = verify_cost_curve(session.target.model, args.cache_length, sizes, args.repeats,
                                 linear_kernel="small_batch")
        print("linear layers: small-batch (what the engine runs here)\n" + format_cost_curve(rows, args.cache_length))
        report["cost_curve_small_batch"] = rows
    if not args.curve_only:
        others = {}
        for spec in args.also:
            name, _, path = spec.rpartition("=")
            other_cfg = compose_decode(overrides + [f"heads={path}"])
            other = load_session(other_cfg)
            if other.heads_config:  # heads for another target are refused (TargetMismatchError)
                check_fingerprint(other.heads_config["target_fingerprint"], session.target.model, f"--also {spec}")
            others[name or (other.heads_config or {}).get("head_type", "random")] = other
        questions = read_questions(cfg.prompts, cfg.max_questions)
        print(f"\n{len(questions)} prompts (first turns), max_new_tokens={cfg.max_new_tokens}")
        ways = compare_on_prompts(session, questions, others=others)
        print(format_comparison(ways, cfg.acceptance))
        report.update(prompts=len(questions), max_new_tokens=cfg.max_new_tokens, acceptance=cfg.acceptance,
                      others={name: str(spec) for name, spec in zip(others, args.also)}, ways=ways)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    with reported_errors():
        main()
