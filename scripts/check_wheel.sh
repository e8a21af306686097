#!/usr/bin/env bash
# Build selfspec's wheel, install it into a fresh virtualenv outside the checkout, and run from there, by the console
# scripts alone, the main job's first steps (Medusa on the embedded default, SmolLM2-135M-Instruct and ShareGPT, both
# from PyPI; two steps on 64 conversations) and a decode with its heads:
# what a user who installs a released wheel gets. .ci/run runs it; by hand:
#
#   bash scripts/check_wheel.sh            # in a temporary folder, removed at the end
#   bash scripts/check_wheel.sh DIR        # in DIR (kept), e.g. to look at the wheel
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
work="${1:-}"
if [ -z "$work" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"
python3 -m pip wheel --quiet --no-deps -w "$work/dist" . >"$work/wheel.log" 2>&1 || { cat "$work/wheel.log"; exit 1; }
wheel="$(ls "$work"/dist/selfspec-*.whl)"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip 2>&1 | { grep -v "is ignored" || true; }
"$work/venv/bin/python" -m pip install --quiet -c "$repo/.ci/constraints.txt" "$wheel" 2>&1 | { grep -v "is ignored" || true; }
cd "$work"  # nothing of the checkout on the path: the wheel's own files only
export WANDB_MODE=offline
"$work/venv/bin/python" -c "import selfspec.core.config as c, sys; assert str(c.CONF_DIR).startswith(sys.prefix), c.CONF_DIR"
"$work/venv/bin/selfspec-train" medusa trainer.max_steps=2 trainer.eval_every=2 trainer.save_every=2 \
    trainer.eval_max_examples=4 data.max_records=64 speed_check.prompts=0 run_dir="$work/run"
test -f "$work/run/heads/config.json"
"$work/venv/bin/selfspec-decode" heads="$work/run/heads" prompt="Hello" max_new_tokens=8 | tee "$work/decode.log"
grep -q "tau" "$work/decode.log"
echo "wheel check: $(basename "$wheel") installed outside the checkout trained and decoded"
