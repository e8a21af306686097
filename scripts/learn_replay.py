"""Learner settings (learner.*: learning rate, steps, the guard) measured offline on a recorded stream. The stream is
decoded once and what learn=true records from each request saved to ``record=``; each run then replays it in order
through the learner, measuring every request's chain acceptance before it is learned from, beside the frozen heads'.
Writes replay.json and replay.md to ``out=`` (bench/learn_replay.py).

Takes the overrides of conf/decode/learn_replay.yaml (which includes conf/decode/decode.yaml: learner.*, dtype...).

    python scripts/learn_replay.py heads=outputs/dflash-smollm2-cpu1h/heads prompts=humaneval max_new_tokens=128 \\
        record=outputs/replay/humaneval.pt out=outputs/replay/default
    python scripts/learn_replay.py heads=outputs/dflash-smollm2-cpu1h/heads prompts=humaneval max_new_tokens=128 \\
        record=outputs/replay/humaneval.pt out=outputs/replay/no-guard learner.guard=false
"""

from selfspec.bench.cli import learn_replay as main  # main(argv) -> the report, for code that runs it (tests)
from selfspec.bench.cli import learn_replay_main

if __name__ == "__main__":
    learn_replay_main()
