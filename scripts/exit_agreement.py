"""How often an early exit's top token equals the full model's, per exit layer, on held-out answers.

    python scripts/exit_agreement.py                          # SmolLM2, the target's own final norm and LM head
    python scripts/exit_agreement.py -- model=tiny data.max_records=64 --examples 8

The config is conf/medusa.yaml with the overrides after ``--`` (its model and data); the positions are the labelled
answer tokens of the data's held-out ``eval`` split (the first ``--examples`` conversations, ``--max-tokens`` tokens
each). Per layer E it prints the agreement and, per confidence threshold, the share of positions where the exit is
that sure and how often it is right there (decode/layerskip.py:exit_agreement). Writes the rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from selfspec.core.config import CONF_DIR
from selfspec.core.errors import reported_errors


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--thresholds", default="0.5,0.8")
    parser.add_argument("--out", default="outputs/exit_agreement.json")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args(argv)

    # deferred: torch and the target only once the arguments are read, so --help answers at once
    from selfspec.decode.layerskip import exit_agreement
    from selfspec.core.target import load_target
    from selfspec.train.data import build_dataset

    with reported_errors():
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="medusa", overrides=args.overrides)
        target = load_target(cfg.model)
        split = build_dataset(cfg.data, target.tokenizer, verbose=False)["eval"]
        examples = [{k: ex[k][: args.max_tokens] for k in ("input_ids", "labels")}
                    for ex in list(split)[: args.examples]]
        thresholds = [float(t) for t in args.thresholds.split(",")]
        rows = exit_agreement(target.model, examples, thresholds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"{rows[0]['positions']} answer positions of {len(examples)} held-out conversations")
    print("| exit layer | agreement | " + " | ".join(f"share p>={t} | right there" for t in thresholds) + " |")
    print("|---" * (2 + 2 * len(thresholds)) + "|")
    for r in rows:
        print(f"| {r['exit_layer']} | {r['agreement']:.3f} | "
              + " | ".join(f"{r[f'share_p>={t}']:.3f} | {r[f'right_p>={t}']:.3f}" for t in thresholds) + " |")
    return rows


if __name__ == "__main__":
    main()
