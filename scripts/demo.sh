#!/usr/bin/env bash
# The CPU demo, end to end: install, build a tiny model, warm-start it with SFT, then RL with P3O.
# Everything lands in runs/demo/: one folder per run, init/, sft/ and rl/ (TensorBoard: .venv/bin/tensorboard
# --logdir runs/demo). rm -rf runs/demo first: the demo always starts over (a fit into a folder that holds a
# run refuses to start).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rm -rf runs/demo
.venv/bin/lit-ess-tiny runs/demo/init
echo "== 1/2 supervised warm start (configs/demo_sft.yaml)"
.venv/bin/lit-ess fit --config configs/demo_sft.yaml
echo "== 2/2 RL with P3O (configs/demo.yaml)"
.venv/bin/lit-ess fit --config configs/demo.yaml
echo "== summary (from the TensorBoard event files)"
.venv/bin/python -m lit_ess.report runs/demo/rl/logs
