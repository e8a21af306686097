"""The learning stream benchmark: a stream of prompts of one domain the heads never trained on, in order; each
prompt decoded by the suffix drafter alone (with its memory of earlier answers), the heads frozen, and the heads
learning from every request (train/online.py), from the trained heads and from untrained ones; every output checked
against HF generate's. Per window of requests: tau, tokens/s (decoding, and with the learning time counted in), the
learning seconds per request and each drafter's own tau; on the stream's second half, the learning default decoder
against the suffix drafter alone, and the learning drafter's own tau over its first and last requests. Writes
stream.json, stream.md and stream.png to ``out=``; exits 1 if any output differs from HF generate's.

Takes the overrides of conf/decode/stream.yaml (which includes conf/decode/decode.yaml: learner.*, draft.*, dtype...).

    python scripts/stream_bench.py heads=outputs/dflash-smollm2-cpu1h/heads prompts=humaneval window=20 \\
        max_new_tokens=128 out=outputs/stream
    # a dry run on the tiny random model (heads saved untrained)
    python scripts/stream_bench.py model=tiny heads=<tiny heads folder> prompts=humaneval limit=6 window=3 \\
        max_new_tokens=16
"""

from selfspec.bench.cli import stream_bench as main  # main(argv) -> the report, for code that runs it (tests)
from selfspec.bench.cli import stream_bench_main

if __name__ == "__main__":
    stream_bench_main()
