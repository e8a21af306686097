"""Regenerate training conversations with the target's own answers (see train/regenerate.py).

    python scripts/regenerate.py model=smollm2 data=sharegpt n=200 out=outputs/regen/sharegpt.jsonl
    python scripts/regenerate.py model=smollm2 prompts=../shared/data/mt_bench/question.jsonl n=null \
        out=outputs/regen/mt_bench.jsonl
    python scripts/regenerate.py model=tiny data=file data.path=convs.jsonl n=5 out=outputs/regen/tiny.jsonl
    selfspec-regenerate model=tiny data=file data.path=convs.jsonl n=5 out=outputs/regen/tiny.jsonl  # installed

Rerunning the same command resumes: ids already in `out` are skipped. Train on the result with
`data=file data.path=outputs/regen/sharegpt.jsonl`.
"""

from selfspec.train.cli import regenerate_main

if __name__ == "__main__":
    regenerate_main()
