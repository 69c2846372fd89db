#!/usr/bin/env bash
# The README's pictures from a real demo run: installs matplotlib and chromium if missing, runs the demo
# unless runs/demo exists (pass --rerun to force), then writes docs/img/demo_reward.png and
# docs/img/tensorboard.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -c "import matplotlib" 2>/dev/null || .venv/bin/python -m pip install -q -e ".[docs]" "torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"
command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
if [ "${1:-}" = "--rerun" ] || [ ! -d runs/demo/rl/logs ]; then bash scripts/demo.sh; fi
.venv/bin/python scripts/readme_figures.py --runs runs/demo --out docs/img
