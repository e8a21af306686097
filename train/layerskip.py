"""Train layer-skip early exits on a frozen Hugging Face target, for self-speculative decoding.

    python train/layerskip.py                                # exit_layer=auto: exits at 5 layers, the best kept
    python train/layerskip.py exit_layer=8                   # one exit after layer 8
    python train/layerskip.py exit.form=head                 # no adapter block: the exit is a norm and an LM head
    python train/layerskip.py exit.draft_vocab_size=null     # score the whole vocabulary
    python train/layerskip.py exit.candidates=[2,3,4,6]      # the layers exit_layer=auto tries
    python train/layerskip.py experiment=debug               # tiny random model, seconds
    python train/layerskip.py features=store                 # hidden states from an offline feature store
    python train/layerskip.py trainer.resume=true            # continue this run from its last checkpoint
    torchrun --nproc_per_node 2 train/layerskip.py           # two processes (DDP; gloo on CPU)

The target is frozen and never changed. Each exit is fitted to the target's own next-token distribution from its
layer-E hidden states (train/layerskip_method.py). At the end the run prints, per exit layer, its agreement with the
target and the expected tokens/s against plain decoding under this machine's measured costs, and keeps the best.

Outputs in outputs/<run_name>/: heads/ (decode with ``python decode/run.py heads=outputs/layerskip-smollm2/heads``),
exit_layers.json (the per-layer table), checkpoints/, config.yaml, metrics.jsonl.
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
from train.layerskip_method import LayerSkipMethod  # noqa: E402
from train.loop import train  # noqa: E402


@hydra.main(config_path="../conf", config_name="layerskip", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported_errors():
        result = train(cfg, LayerSkipMethod(cfg))
        from train.speed_check import after_training

        after_training(cfg, result.heads_dir)


if __name__ == "__main__":
    main()
