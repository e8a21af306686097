#!/usr/bin/env bash
# The GPU check, for the day a GPU machine is lent: one script, sized to finish in under 9 minutes on one H200.
#
#   bash scripts/gpu_prepare.sh                 # here, with network: wheels, the SmolLM2 GGUF in halves, data -> .gpu/
#   bash scripts/gpu_check.sh [OUT]             # there (after the carried files are in place): results under OUT
#   bash scripts/gpu_check.sh --dry-run [OUT]   # on a CPU: every step with tiny shapes, to check the script itself
#
# Steps, each under its own time limit, each writing OUT/<step>.log (a failed step is reported, the next one runs):
#   1. the test suites on the GPU: pytest --device cuda (-m "not vllm_archs"; vLLM has no venv there and skips)
#   2. training throughput, tokens/s on one GPU: EAGLE-3 and DFlash on a random-weight target of Llama-3.1-8B's
#      shape in bfloat16 (conf/model/llama8b.yaml's shape, model=tiny), online and from a feature store
#   3. the engine at the card's own target size: plain decoding and the verify cost curve against HF generate on a
#      random-weight target of model=llama3b's shape in bfloat16 (scripts/engine_ceiling.py --shape llama3b)
#   4. the real SmolLM2-135M-Instruct bench: every engine method (random Medusa heads, the training-free drafters), lossless against
#      HF generate (scripts/bench.py on 8 MT-bench questions)
# OUT/summary.txt lists each step's status and the figures to copy into docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out="${1:-outputs/gpu_check}"
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HYDRA_FULL_ERROR=1

if [ "$dry" = 1 ]; then
    device=cpu; dtype=float32
    shape8b="model.tiny.hidden_size=64 model.tiny.num_hidden_layers=4 model.tiny.num_attention_heads=4 model.tiny.num_key_value_heads=2 model.tiny.intermediate_size=128"
    steps=2; limit_tests=300; limit=300; records=64
    pytest_args=(--collect-only -q -n 0)
    engine_args=(--prompts 1 --prompt-tokens 16 --new-tokens 8 --depths 1,2 --curve-repeats 1 -- model=tiny)
    bench_args=(model=tiny limit=2 max_new_tokens=8 "methods=[hf,vanilla,heads,training_free]")
else
    device=cuda; dtype=bfloat16
    shape8b="model.tiny.vocab_size=128256 model.tiny.hidden_size=4096 model.tiny.num_hidden_layers=32 model.tiny.num_attention_heads=32 model.tiny.num_key_value_heads=8 model.tiny.intermediate_size=14336 model.tiny.max_position_embeddings=8192"
    steps=30; limit_tests=270; limit=90; records=2000
    pytest_args=(--device cuda -m "not vllm_archs" -n 8 -p no:cacheprovider)
    engine_args=(--shape llama3b --prompts 4 --prompt-tokens 128 --new-tokens 128 --depths 1,2,4,8 -- model=tiny device=cuda dtype=bfloat16)
    bench_args=(model=smollm2 limit=8 max_new_tokens=128 device=cuda)
    # what gpu_prepare.sh carried: the packages this machine lacks, the SmolLM2 GGUF (two halves), the data
    if ls .gpu/whl/*.whl >/dev/null 2>&1; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .gpu/whl/*.whl || exit 1
    fi
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
    export SELFSPEC_CACHE="${SELFSPEC_CACHE:-/tmp/selfspec-cache}"
    gguf="$SELFSPEC_CACHE/downloads/$("$py" -c 'from selfspec.core.embedded import SMOLLM2 as m; print(f"{m.downloads}/{m.gguf}")')"
    if [ ! -f "$gguf" ] && ls .gpu/gguf.part-* >/dev/null 2>&1; then
        mkdir -p "$(dirname "$gguf")" && cat .gpu/gguf.part-* > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$summary" 2>&1
fi
data=(data=file "data.path=$(pwd)/.gpu/conversations.jsonl")
[ -f .gpu/conversations.jsonl ] || data=()  # the embedded ShareGPT where its package is installed
prompts="$(pwd)/.gpu/question.jsonl"
[ -f "$prompts" ] || prompts="$(cd .. && pwd)/shared/data/mt_bench/question.jsonl"

step() {  # step NAME LIMIT_S COMMAND...: run, log, and record the status and the time taken
    local name="$1" secs="$2"; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$summary"
    return 0
}

step tests "$limit_tests" "$py" -m pytest "${pytest_args[@]}"
tail -n 3 "$out/tests.log" >> "$summary"

common=(model=tiny $shape8b "model.dtype=$dtype" "model.device=$device" "trainer.max_steps=$steps"
        trainer.eval_every=100000 trainer.save_every=100000 trainer.log_every=5 speed_check.prompts=0 "${data[@]}"
        "data.max_records=$records")
for family in eagle3 dflash; do
    entry=train/eagle.py; extra=(heads=eagle3)
    [ "$family" = dflash ] && { entry=train/dflash.py; extra=(); }
    step "train-$family-online" "$limit" "$py" "$entry" "${extra[@]}" "${common[@]}" "run_dir=$out/runs/$family-online"
    step "train-$family-store" "$((limit * 2))" "$py" "$entry" "${extra[@]}" "${common[@]}" features=store \
        "feature_store.dir=$out/runs/store-$family" "run_dir=$out/runs/$family-store"
done
grep -h "training done" "$out"/train-*.log >> "$summary"

step engine "$limit" "$py" scripts/engine_ceiling.py --out "$out/engine_ceiling.json" "${engine_args[@]}"
tail -n 12 "$out/engine.log" >> "$summary"

step bench "$((limit * 2))" "$py" scripts/bench.py "${bench_args[@]}" "prompts=$prompts" \
    "heads=[random]" "out=$out/bench"
tail -n 20 "$out/bench.log" >> "$summary"
echo "---"; cat "$summary"
