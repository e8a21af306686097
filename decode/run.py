"""Decode with a drafter and tree verification (batch size 1); streams tokens as they are accepted, then prints
steps, tau (mean tokens per target forward, the target's own token included), tokens/s and the time split.

    # one prompt; untrained (random) Medusa heads on the embedded SmolLM2-135M-Instruct: a dry run
    python decode/run.py prompt="Write a haiku about the sea."
    # plain decoding, no drafter
    python decode/run.py heads=null prompt="Write a haiku about the sea."
    # trained heads; the target is the one the heads record (model=NAME to name it)
    python decode/run.py heads=outputs/medusa-smollm2/heads prompt="Write a haiku about the sea."
    # MT-bench questions (both turns, the conversation carried over); answers + stats in outputs/mt/answers.jsonl
    python decode/run.py heads=outputs/medusa-smollm2/heads prompts=../shared/data/mt_bench/question.jsonl \
        max_questions=10 max_new_tokens=128 run_name=mt
    # baselines in the same run: plain decoding in the same engine, or HF generate on the same prompts (speedup)
    python decode/run.py heads=... prompts=... drafter=vanilla
    python decode/run.py heads=... prompts=... baseline=hf
    # options
    python decode/run.py ... draft.tree=small_16 acceptance=sample temperature=0.7 top_p=0.9 seed=1 \
        stop='["\n\n"]' device=cuda dtype=bfloat16
    # the installed command takes the same overrides
    selfspec-decode heads=outputs/medusa-smollm2/heads prompt="Write a haiku about the sea."

The drafter is the one the heads were trained as (decode/registry.py); draft.* overrides the settings saved with
them (Medusa: draft.tree=small_16 | chain | chain-K; EAGLE: draft.depth, draft.top_k, draft.total_tokens).
acceptance=greedy and acceptance=sample keep the target's output (greedy: the same tokens; sample: the same
distribution); acceptance=typical is Medusa's typical acceptance and changes it (faster, lossy).
"""

from omegaconf import DictConfig

from selfspec.core.config import CONF_DIR, hydra_app
from selfspec.core.errors import reported_errors


def decode(cfg: DictConfig) -> None:
    # here, not at the top: a mistyped key is told before torch loads
    from selfspec.decode.answers import run
    from selfspec.train.online import online_learner  # learn=true: this command hands the session its learner

    with reported_errors():
        run(cfg, learner=online_learner)


def main() -> None:
    hydra_app(decode, "decode", job_name="run", config_dir=CONF_DIR / "decode")


if __name__ == "__main__":
    main()
