"""Mean ESS and policy lag against the staleness bound S, asynchronous P3O on the demo task.

For S in --bounds it runs `lit-ess fit` on configs/demo_async.yaml (the demo's SFT model, 32 prompts x
8 samples, P3O) for --steps steps with `max_staleness: S`, and reads train/ess, train/policy_lag,
train/policy_lag_max and rollout/reward_mean back from its TensorBoard files.

    .venv/bin/python benchmarks/staleness.py [--model runs/demo/sft/model] [--steps 30] [--bounds 0 1 2 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from lit_ess.report import read_scalars

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="runs/demo/sft/model")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--bounds", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--out", default="benchmarks/results/staleness.json")
    a = p.parse_args(argv)
    if not Path(a.model).is_dir():
        sys.exit(f"benchmarks/staleness.py: no model folder {a.model}: run `bash scripts/demo.sh` first, or pass --model")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for S in a.bounds:
            cfg = yaml.safe_load((ROOT / "configs" / "demo_async.yaml").read_text())
            cfg["output_dir"] = None            # every path of the run is set below
            cfg["model"]["init_args"]["model_path"] = str(Path(a.model).resolve())
            cfg["data"]["init_args"]["schedule"]["max_staleness"] = S
            cfg["data"]["init_args"]["validation"] = {"source": None}
            cfg["trainer"].update({"max_steps": a.steps, "enable_checkpointing": False, "enable_progress_bar": False,
                                   "callbacks": [{"class_path": "lit_ess.callbacks.WeightSync"}],
                                   "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                              "init_args": {"save_dir": d, "name": "tb", "version": f"S{S}"}}})
            path = Path(d) / f"S{S}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            res = subprocess.run([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(path)], cwd=d,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"benchmarks/staleness.py: S={S} failed:\n{res.stderr[-3000:]}")
            s = read_scalars(Path(d) / "tb" / f"S{S}")
            v = {k: [x for _, x in s[k]] for k in ("train/ess", "train/policy_lag", "train/policy_lag_max",
                                                  "rollout/reward_mean", "rollout/stale_dropped")}
            rows.append({"S": S, "ess_mean": statistics.mean(v["train/ess"]), "ess_min": min(v["train/ess"]),
                         "lag_mean": statistics.mean(v["train/policy_lag"]), "lag_max": max(v["train/policy_lag_max"]),
                         "reward_mean": statistics.mean(v["rollout/reward_mean"]),
                         "stale_dropped": v["rollout/stale_dropped"][-1]})
            r = rows[-1]
            print(f"S={S}: ESS mean {r['ess_mean']:.4f} min {r['ess_min']:.4f}, lag mean {r['lag_mean']:.2f} "
                  f"max {r['lag_max']:.0f}, stale rows dropped {r['stale_dropped']:.0f}, reward mean {r['reward_mean']:.3f}",
                  flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"model": a.model, "steps": a.steps, "rows": rows}, indent=1))
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
