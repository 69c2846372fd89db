#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): lit-ess at Qwen2.5-0.5B's shape on one accelerator, one command,
# under 8 minutes on one H100. It installs lit-ess over the machine's own torch, Lightning, transformers
# and peft (no package index is reached: --no-index), with the wheels in .gpu_wheels/ for what that image
# lacks, then runs the check and writes benchmarks/results/gpu_check.json (and $OUT/gpu_check.json).
#
#   bash scripts/gpu_check.sh                  # on the GPU machine
#   bash scripts/gpu_check.sh --fetch-wheels   # here, before: download what the GPU image lacks to .gpu_wheels/
#   bash scripts/gpu_check.sh --cpu [--out F]  # the same code at a tiny shape on this CPU (the test suite runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(jsonargparse docstring-parser typeshed-client)    # LightningCLI's (jsonargparse[signatures]); the check itself imports none

if [ "${1:-}" = "--fetch-wheels" ]; then
  PIP=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
  "$PIP" -m pip download -q --no-deps -d .gpu_wheels "${WHEELS[@]}"
  ls .gpu_wheels
  exit 0
fi

if [ "${1:-}" = "--cpu" ]; then
  PY=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
  exec env OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" scripts/gpu_check.py "$@"
fi

PY=${PYTHON:-python3}
"$PY" -c "import torch, lightning, transformers, peft; print('gpu_check: torch', torch.__version__, '| lightning', lightning.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| cuda', torch.cuda.is_available())"
if [ -d .gpu_wheels ] && ls .gpu_wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps --no-index .gpu_wheels/*.whl 2>&1 | tail -2 || true
fi
# lit-ess itself, editable and without dependencies; where the image's setuptools cannot build it, the
# checkout is imported from PYTHONPATH (the same code).
if ! "$PY" -m pip install -q --no-deps --no-index --no-build-isolation -e . >/tmp/gpu_check_install.log 2>&1; then
  echo "gpu_check: pip install -e . failed here ($(tail -1 /tmp/gpu_check_install.log)); importing the checkout from PYTHONPATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 470 "$PY" scripts/gpu_check.py "$@"
