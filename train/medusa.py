"""Train Medusa heads (Medusa-1, or Medusa-2 with LoRA on the target) on a frozen Hugging Face target.

    python train/medusa.py                                   # SmolLM2-135M + ShareGPT, ~15 min on a 2-core CPU
    python train/medusa.py experiment=debug                  # tiny random model, seconds
    python train/medusa.py experiment=cpu_1h                 # ~1 hour on a 2-core CPU, better heads
    python train/medusa.py heads=medusa2                     # Medusa-2: LoRA on the target, trained jointly
    python train/medusa.py heads.loss=kl                     # self-distillation on the target's distribution
    python train/medusa.py features=store                    # hidden states from an offline feature store
    python train/medusa.py trainer.resume=true               # continue this run from its last checkpoint
    python train/medusa.py trainer.overwrite=true            # start this run over (deletes its old checkpoints)
    python train/medusa.py logger=wandb run_name=my-run      # log to Weights & Biases (offline without a key)
    torchrun --nproc_per_node 2 train/medusa.py              # two processes (DDP; gloo on CPU)
    accelerate launch --config_file conf/accelerate/ddp.yaml train/medusa.py experiment=medusa_llama8b_gpu
    accelerate launch --config_file conf/accelerate/zero2.yaml train/medusa.py trainer=gpu

Outputs in outputs/<run_name>/: heads/ (load with ``heads.load(path, target)``), checkpoints/, config.yaml,
metrics.jsonl.
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
from train.loop import train  # noqa: E402
from train.medusa_method import medusa_method  # noqa: E402


@hydra.main(config_path="../conf", config_name="medusa", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported_errors():
        result = train(cfg, medusa_method(cfg))  # Medusa-1 or Medusa-2, by heads.type
        from train.speed_check import after_training

        after_training(cfg, result.heads_dir)


if __name__ == "__main__":
    main()
