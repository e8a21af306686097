"""Train Medusa heads (Medusa-1, or Medusa-2 with LoRA on the target) on a frozen Hugging Face target.

    python train/medusa.py                                   # SmolLM2-135M + ShareGPT: the newcomer's main job
    python train/medusa.py experiment=debug                  # tiny random model, seconds
    python train/medusa.py experiment=cpu_1h                 # sized for an hour on a 2-core CPU, better heads
    python train/medusa.py heads=medusa2                     # Medusa-2: LoRA on the target, trained jointly
    python train/medusa.py heads.loss=kl                     # self-distillation on the target's distribution
    python train/medusa.py features=store                    # hidden states from an offline feature store
    python train/medusa.py trainer.resume=true               # continue this run from its last checkpoint
    python train/medusa.py trainer.overwrite=true            # start this run over (deletes its old checkpoints)
    python train/medusa.py logger=wandb run_name=my-run      # log to Weights & Biases (offline without a key)
    torchrun --nproc_per_node 2 train/medusa.py              # two processes (DDP; gloo on CPU)
    accelerate launch --config_file conf/accelerate/ddp.yaml train/medusa.py experiment=medusa_llama8b_gpu
    accelerate launch --config_file conf/accelerate/zero2.yaml train/medusa.py trainer=gpu
    selfspec-train medusa heads=medusa2 experiment=debug     # the installed command: the same overrides

Outputs in outputs/<run_name>/: heads/ (load with ``heads.load(path, target)``), checkpoints/, config.yaml,
metrics.jsonl.
"""

from selfspec.train.cli import main

if __name__ == "__main__":
    main("medusa")
