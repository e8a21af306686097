"""Train a DFlash block drafter (a few layers that draft a whole block in one forward) on a frozen target.

    python train/dflash.py                                   # SmolLM2-135M + ShareGPT, online features
    python train/dflash.py experiment=debug                  # tiny random model, seconds
    python train/dflash.py experiment=dflash_cpu_1h          # the hour recipe on a 2-core CPU, feature store included
    python train/dflash.py experiment=dflash_cpu_1h feature_store.dir=outputs/eagle3-smollm2-cpu1h/features
                                                             # reuse the EAGLE-3 recipe's store (same data and target)
    python train/dflash.py heads.block_size=16 heads.num_layers=2 heads.loss.token_loss=ce
    python train/dflash.py trainer.resume=true               # continue this run from its last checkpoint
    torchrun --nproc_per_node 2 train/dflash.py              # two processes (DDP; gloo on CPU)
    selfspec-train dflash experiment=debug                   # the installed command: the same overrides

Outputs in outputs/<run_name>/ (run_name defaults to dflash-smollm2): heads/ (load with
``heads.load(path, target=...)``), checkpoints/, config.yaml, metrics.jsonl.
"""

from selfspec.train.cli import main

if __name__ == "__main__":
    main("dflash")
