"""Train an EAGLE drafter (EAGLE-1, or EAGLE-3 with fused features and a reduced vocabulary) on a frozen target.

    python train/eagle.py                                    # EAGLE-1 on SmolLM2-135M + ShareGPT, ~15 min on 2 CPUs
    python train/eagle.py heads=eagle3                       # EAGLE-3: low/mid/high features, draft vocabulary
    python train/eagle.py experiment=debug                   # tiny random model, seconds
    python train/eagle.py heads=eagle3 experiment=cpu_1h     # ~1 hour on a 2-core CPU
    python train/eagle.py heads.unroll_steps=4 heads.draft_vocab_size=8192
    python train/eagle.py features=store                     # hidden states from an offline feature store
    python train/eagle.py trainer.resume=true                # continue this run from its last checkpoint
    python train/eagle.py logger=wandb run_name=my-run       # log to Weights & Biases (offline without a key)
    torchrun --nproc_per_node 2 train/eagle.py               # two processes (DDP; gloo on CPU)
    accelerate launch --config_file conf/accelerate/ddp.yaml train/eagle.py heads=eagle3 trainer=gpu

Outputs in outputs/<run_name>/ (run_name defaults to eagle-smollm2 / eagle3-smollm2): heads/ (load with
``heads.load(path, target)``; decode with ``python decode/run.py heads=outputs/eagle-smollm2/heads``),
checkpoints/, config.yaml, metrics.jsonl.
"""

import sys
from pathlib import Path

# Run as a script, Python puts train/ first on sys.path, where its modules (data, eagle, ...) would shadow
# installed packages of those names and `train` would not import without an install; put the repository root there.
_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _ROOT / "train":
    sys.path[0] = str(_ROOT)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from core.errors import reported_errors  # noqa: E402
from train.eagle_method import EagleMethod  # noqa: E402
from train.loop import train  # noqa: E402


@hydra.main(config_path="../conf", config_name="eagle", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported_errors():
        result = train(cfg, EagleMethod(cfg))
        from train.speed_check import after_training

        after_training(cfg, result.heads_dir)


if __name__ == "__main__":
    main()
