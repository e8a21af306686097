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
    selfspec-train layerskip exit_layer=8                    # the installed command: the same overrides

The target is frozen and never changed. Each exit is fitted to the target's own next-token distribution from its
layer-E hidden states (train/layerskip_method.py). At the end the run prints, per exit layer, its agreement with the
target and the expected tokens/s against plain decoding under this machine's measured costs, and keeps the best.

Outputs in outputs/<run_name>/: heads/ (decode with ``python decode/run.py heads=outputs/layerskip-smollm2/heads``),
exit_layers.json (the per-layer table), checkpoints/, config.yaml, metrics.jsonl.
"""

from selfspec.train.cli import main

if __name__ == "__main__":
    main("layerskip")
