"""Wall-clock per optimizer step, asynchronous (S = 1) against synchronous rollouts, in one run.

(a) the demo config (configs/demo.yaml: 32 prompts x 8 samples, P3O, 2-digit addition);
(b) the same with a latency-bound reward: a verifier that waits 2 ms per completion (0.5 s per rollout
    of 256 completions), as remote sandboxes and judges do.
Goal for (b): async <= 0.6x sync colocated, <= 0.8x on the dedicated server (issue 40). In (a)
generation and training both compute on the same 2 CPU cores, so overlapping them cannot make both
faster; the number is reported as measured.

On `--devices` data-parallel ranks (DDP, default 2) async runs in both placements: colocated (a worker
process per rank, each with its own in-process vLLM generating its half) and dedicated (every rank's
worker sends its half to the one vLLM server rank 0 launches: configs/demo_server.yaml's engine). Runs alternate sync / async for `--rounds` rounds, each a `lit-ess
fit` of `--steps` steps; the first 3 steps of each run are dropped (vLLM warm-up). Reported: the median
step time over all rounds, and each round's ratio (its async median over the same round's sync median)
with their median and range, so a machine shared with other jobs shows as spread; the load average
(1 min) before and after each case; and each run's split (`phase_split_per_round`, means over its timed
steps of what it logs to TensorBoard): generation and reward seconds of a phase, training and weight-sync
seconds of a step, the share of the step the trainer waited for data and the worker sat idle; and the
floor (`cpu_floor_ratio_*`): the sync step's computing (generation + training + weight push) over the
sync step, the lowest ratio any overlap can reach when the engine and the trainer share the cores.

    .venv/bin/python benchmarks/async.py [--model runs/demo/sft/model] [--steps 25 --rounds 3 --devices 2] [--cases b]
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


SERVER = yaml.safe_load((ROOT / "configs" / "demo_server.yaml").read_text())["data"]["init_args"]["engine"]
MODES = {"sync": {"schedule": {"mode": "sync"}},
         "async colocated": {"schedule": {"mode": "async", "placement": "colocated", "max_staleness": 1}},
         "async dedicated": {"schedule": {"mode": "async", "placement": "dedicated", "max_staleness": 1}, "engine": SERVER}}


SPLIT = {"gen_s": "rollout/gen_seconds", "reward_s": "rollout/reward_seconds", "train_s": "perf/train_seconds",
         "weight_sync_s": "perf/weight_sync_seconds", "trainer_wait_frac": "perf/trainer_wait_frac",
         "worker_idle_frac": "perf/worker_idle_frac", "lag": "train/policy_lag"}


def split(logdir: Path) -> dict[str, float]:
    """Means over the timed steps (the first 3 dropped) of what the run logged: the phase's generation and
    reward seconds, the step's training and weight-sync seconds, the share of the step the trainer waited
    for data and the worker sat idle, the policy lag."""
    from lit_ess.report import read_scalars

    s = read_scalars(logdir)
    return {k: statistics.mean(v for step, v in s[tag] if step >= 3) for k, tag in SPLIT.items()
            if any(step >= 3 for step, _ in s.get(tag, []))}


def busy(sync_split: dict[str, float]) -> float:
    """The seconds of a synchronous step in which the cores compute: generation, training and the weight
    push (each rank on its own core, the ranks at the same time); the rest is the reward's wait. Async can
    hide the wait, not the computing, when generation and training share the cores: this over the sync
    step is the lowest async / sync ratio the machine allows."""
    return sync_split["gen_s"] + sync_split["train_s"] + sync_split.get("weight_sync_s", 0.0)


def run(model: str, out: Path, mode: str, steps: int, reward: str, devices: int) -> tuple[list[float], dict]:
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["output_dir"] = None            # every path of the run is set below
    cfg["model"]["init_args"]["model_path"] = model
    data = cfg["data"]["init_args"]
    data.update({**MODES[mode], "reward": reward, "validation": {"source": None}})
    times = out / f"{mode.replace(' ', '_')}.json"
    if devices > 1:
        cfg["trainer"]["strategy"] = "ddp"
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
              "init_args": {"save_dir": str(out), "name": "tb", "version": "run"}}
    cfg["trainer"].update({"max_steps": steps, "logger": logger, "enable_checkpointing": False, "devices": devices,
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
    return [b - a for a, b in zip(t[3:], t[4:])], split(out / "tb" / "run")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="runs/demo/sft/model", help="policy folder (default: the demo's SFT model)")
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
            splits = {m: [] for m in modes}                  # each round's phase split
            load = [os.getloadavg()[0]]
            for r in range(a.rounds):
                for mode in modes:
                    out = Path(d) / f"{len(results)}-{r}-{mode.replace(' ', '_')}"
                    out.mkdir(parents=True, exist_ok=True)
                    t, phases = run(model, out, mode, a.steps, reward, a.devices)
                    times[mode] += t
                    splits[mode].append(phases)
                    print(f"  round {r + 1}, {mode}: {statistics.median(t):.3f} s/step; "
                          + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()), flush=True)
                    rounds[mode].append(statistics.median(t))
            load.append(os.getloadavg()[0])
            s = statistics.median(times["sync"])
            floor = [busy(sp) / m for sp, m in zip(splits["sync"], rounds["sync"])]
            results[case] = {"sync_s_per_step": s, "steps_timed": len(times["sync"]),
                             "cpu_floor_ratio_per_round": floor, "cpu_floor_ratio_median": statistics.median(floor),
                             "sync_round_medians": rounds["sync"], "load_avg_1min_before_after": load,
                             "phase_split_per_round": splits}
            for mode in modes[1:]:
                goal = f"  (goal <= {0.8 if 'dedicated' in mode else 0.6})" if case.startswith("(b)") else ""
                y = statistics.median(times[mode])
                key = mode.replace(" ", "_")
                per_round = [x / z for x, z in zip(rounds[mode], rounds["sync"])]
                results[case].update({f"{key}_s_per_step": y, f"{key}_ratio": y / s, f"{key}_round_medians": rounds[mode],
                                      f"{key}_round_ratios": per_round,
                                      f"{key}_round_ratio_median": statistics.median(per_round),
                                      f"{key}_round_ratio_range": [min(per_round), max(per_round)]})
                print(f"{case}, {a.devices} ranks: sync {s:.3f} s/step, {mode} S=1 {y:.3f} s/step, ratio {y / s:.2f}{goal}, "
                      f"floor {statistics.median(floor):.2f}; "
                      f"per round {', '.join(f'{x:.2f}' for x in per_round)} (load {load[0]:.1f} -> {load[1]:.1f})",
                      flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"model": a.model, "steps": a.steps, "rounds": a.rounds, "devices": a.devices,
                                       "results": results}, indent=1))
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
