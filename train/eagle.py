"""Train an EAGLE drafter (EAGLE-1, or EAGLE-3 with fused features and a reduced vocabulary) on a frozen target.

    python train/eagle.py                                    # EAGLE-1 on SmolLM2-135M + ShareGPT
    python train/eagle.py heads=eagle3                       # EAGLE-3: low/mid/high features, draft vocabulary
    python train/eagle.py experiment=debug                   # tiny random model, seconds
    python train/eagle.py heads=eagle3 experiment=cpu_1h     # sized for an hour on a 2-core CPU
    python train/eagle.py heads.unroll_steps=4 heads.draft_vocab_size=8192
    python train/eagle.py features=store                     # hidden states from an offline feature store
    python train/eagle.py trainer.resume=true                # continue this run from its last checkpoint
    python train/eagle.py logger=wandb run_name=my-run       # log to Weights & Biases (offline without a key)
    torchrun --nproc_per_node 2 train/eagle.py               # two processes (DDP; gloo on CPU)
    accelerate launch --config_file conf/accelerate/ddp.yaml train/eagle.py heads=eagle3 trainer=gpu
    selfspec-train eagle3 experiment=debug                   # the installed command (eagle3: heads=eagle3)

Outputs in outputs/<run_name>/ (run_name defaults to eagle-smollm2 / eagle3-smollm2): heads/ (load with
``heads.load(path, target)``; decode with ``python decode/run.py heads=outputs/eagle-smollm2/heads``),
checkpoints/, config.yaml, metrics.jsonl.
"""

from selfspec.train.cli import main

if __name__ == "__main__":
    main("eagle")
