#!/usr/bin/env bash
# Create upstream speculators' environment (default .venv-speculators/ in the repository root, or $1),
# used only by bench/bench_04_recipe.py's upstream-* variants and bench/bench_04_train.py. Not part of CI. speculators 0.9.0 requires
# torchvision/torchaudio but never imports them; their PyPI builds are CUDA ones that do not load
# against the CPU torch, so they are removed as in setup_vllm_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-speculators}"
start=$(date +%s)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -r requirements-speculators.txt
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio 2>/dev/null || true
"$VENV/bin/python" -c "import speculators.train.trainer, transformers, torch; from importlib.metadata import version; print('speculators', version('speculators'), 'transformers', transformers.__version__, 'torch', torch.__version__)"
echo "speculators environment ready in $VENV ($(( $(date +%s) - start )) s)"
