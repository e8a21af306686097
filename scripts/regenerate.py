"""Regenerate training conversations with the target's own answers (see train/regenerate.py).

    python scripts/regenerate.py model=smollm2 data=sharegpt n=200 out=outputs/regen/sharegpt.jsonl
    python scripts/regenerate.py model=smollm2 prompts=../shared/data/mt_bench/question.jsonl n=null \
        out=outputs/regen/mt_bench.jsonl
    python scripts/regenerate.py model=tiny data=file data.path=convs.jsonl n=5 out=outputs/regen/tiny.jsonl

Rerunning the same command resumes: ids already in `out` are skipped. Train on the result with
`data=file data.path=outputs/regen/sharegpt.jsonl`.
"""

import hydra
from omegaconf import DictConfig

from core.errors import reported_errors
from train.regenerate import run


@hydra.main(config_path="../conf", config_name="regenerate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported_errors():
        run(cfg)


if __name__ == "__main__":
    main()
