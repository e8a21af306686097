"""Train a DFlash block drafter (a few layers that draft a whole block in one forward) on a frozen target.

    python train/dflash.py                                   # SmolLM2-135M + ShareGPT, online features
    python train/dflash.py experiment=debug                  # tiny random model, seconds
    python train/dflash.py experiment=dflash_cpu_1h          # the hour recipe on a 2-core CPU, feature store included
    python train/dflash.py experiment=dflash_cpu_1h feature_store.dir=outputs/eagle3-smollm2-cpu1h/features
                                                             # reuse the EAGLE-3 recipe's store (same data and target)
    python train/dflash.py heads.block_size=16 heads.num_layers=2 heads.loss.token_loss=ce
    python train/dflash.py trainer.resume=true               # continue this run from its last checkpoint
    torchrun --nproc_per_node 2 train/dflash.py              # two processes (DDP; gloo on CPU)

Outputs in outputs/<run_name>/ (run_name defaults to dflash-smollm2): heads/ (load with
``heads.load(path, target=...)``), checkpoints/, config.yaml, metrics.jsonl.
"""

import sys
from pathlib import Path

# Run as a script, Python puts train/ first on sys.path, where its modules (data, dflash, ...) would shadow
# installed packages of those names and `train` would not import without an install; put the repository root there.
_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _ROOT / "train":
    sys.path[0] = str(_ROOT)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from core.errors import reported_errors  # noqa: E402
from train.dflash_method import DFlashMethod  # noqa: E402
from train.loop import train  # noqa: E402


@hydra.main(config_path="../conf", config_name="dflash", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported_errors():
        result = train(cfg, DFlashMethod(cfg))
        from train.speed_check import after_training

        after_training(cfg, result.heads_dir)


if __name__ == "__main__":
    main()
