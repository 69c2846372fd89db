"""Wall-clock per optimizer step, asynchronous (S = 1) against synchronous rollouts, in one run.

(a) the demo config (configs/demo.yaml: 32 prompts x 8 samples, P3O, 2-digit addition);
(b) the same with a latency-bound reward: a verifier that waits 2 ms per completion (0.5 s per rollout
    of 256 completions), as remote sandboxes and judges do.
Goal for (b): async <= 0.6x sync. In (a) generation and training both compute on the same 2 CPU
cores, so overlapping them cannot make both faster; the number is reported as measured.

On `--devices` data-parallel ranks (DDP, default 2) async runs in both placements: colocated (a worker
process per rank, each generating its half) and dedicated (one worker process for the whole phase,
each rank receiving its share). Runs alternate sync / async for `--rounds` rounds, each a `lit-ess
fit` of `--steps` steps; the first 3 steps of each run are dropped (vLLM warm-up). Reported: the median
step time over all rounds, and each round's ratio (its async median over the same round's sync median)
with their median and range, so a machine shared with other jobs shows as spread; the load average
(1 min) before and after each case.

    .venv/bin/python benchmarks/async.py [--model runs/demo/sft] [--steps 25 --rounds 3 --devices 2] [--cases b]
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

ROOT = Path(__file__).resolve().parents[1]


MODES = {"sync": {"mode": "sync"}, "async colocated": {"mode": "async", "placement": "colocated", "max_staleness": 1},
         "async dedicated": {"mode": "async", "placement": "dedicated", "max_staleness": 1}}


def run(model: str, out: Path, mode: str, steps: int, reward: str, devices: int) -> list[float]:
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["model"]["init_args"]["model_path"] = model
    data = cfg["data"]["init_args"]
    data.update({**MODES[mode], "reward": reward, "val_source": None})
    times = out / f"{mode.replace(' ', '_')}.json"
    if devices > 1:
        cfg["trainer"]["strategy"] = "ddp"
    cfg["trainer"].update({"max_steps": steps, "logger": False, "enable_checkpointing": False, "devices": devices,
                           "default_root_dir": str(out), "enable_progress_bar": False, "check_val_every_n_epoch": 1,
                           "callbacks": [{"class_path": "lit_ess.callbacks.WeightSync"},
                                         {"class_path": "benchmarks.timing.StepTimes", "init_args": {"path": str(times)}}]})
    path = out / f"{mode.replace(' ', '_')}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # in the run's temporary folder: with logger: false LightningCLI saves its config.yaml in the cwd
    res = subprocess.run([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(path)], cwd=out, env=env,
                         capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"benchmarks/async.py: the {mode} run failed:\n{res.stderr[-3000:]}")
    t = json.loads(times.read_text())
    return [b - a for a, b in zip(t[3:], t[4:])]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="runs/demo/sft", help="policy folder (default: the demo's SFT model)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--devices", type=int, default=2, help="data-parallel ranks (DDP); 1: no placement to compare")
    p.add_argument("--cases", default="ab", help="which cases: a (demo config), b (latency-bound reward), or ab")
    p.add_argument("--placements", default="colocated,dedicated", help="the async placements to run beside sync")
    p.add_argument("--out", default="benchmarks/results/async.json")
    a = p.parse_args(argv)
    if bad := [x for x in a.placements.split(",") if f"async {x}" not in MODES]:
        p.error(f"--placements: {', '.join(bad)} is not colocated or dedicated")
    if not Path(a.model).is_dir():
        sys.exit(f"benchmarks/async.py: no model folder {a.model}: run `bash scripts/demo.sh` first, or pass --model")
    model = str(Path(a.model).resolve())
    results = {}
    cases = {"(a) demo config": "exact_match", "(b) latency-bound reward": "benchmarks.timing:waiting_exact_match"}
    cases = {k: v for k, v in cases.items() if k[1] in a.cases}
    with tempfile.TemporaryDirectory() as d:
        for case, reward in cases.items():
            modes = ["sync", *(f"async {x}" for x in a.placements.split(",") if a.devices > 1 or x == "colocated")]
            times = {m: [] for m in modes}
            rounds = {m: [] for m in modes}                  # each round's median
            load = [os.getloadavg()[0]]
            for r in range(a.rounds):
                for mode in modes:
                    out = Path(d) / f"{len(results)}-{r}-{mode.replace(' ', '_')}"
                    out.mkdir(parents=True, exist_ok=True)
                    t = run(model, out, mode, a.steps, reward, a.devices)
                    times[mode] += t
                    rounds[mode].append(statistics.median(t))
            load.append(os.getloadavg()[0])
            s = statistics.median(times["sync"])
            results[case] = {"sync_s_per_step": s, "steps_timed": len(times["sync"]),
                             "sync_round_medians": rounds["sync"], "load_avg_1min_before_after": load}
            goal = "  (goal <= 0.6)" if case.startswith("(b)") else ""
            for mode in modes[1:]:
                y = statistics.median(times[mode])
                key = mode.replace(" ", "_")
                per_round = [x / z for x, z in zip(rounds[mode], rounds["sync"])]
                results[case].update({f"{key}_s_per_step": y, f"{key}_ratio": y / s, f"{key}_round_medians": rounds[mode],
                                      f"{key}_round_ratios": per_round,
                                      f"{key}_round_ratio_median": statistics.median(per_round),
                                      f"{key}_round_ratio_range": [min(per_round), max(per_round)]})
                print(f"{case}, {a.devices} ranks: sync {s:.3f} s/step, {mode} S=1 {y:.3f} s/step, ratio {y / s:.2f}{goal}; "
                      f"per round {', '.join(f'{x:.2f}' for x in per_round)} (load {load[0]:.1f} -> {load[1]:.1f})",
                      flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"model": a.model, "steps": a.steps, "rounds": a.rounds, "devices": a.devices,
                                       "results": results}, indent=1))
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
