"""vLLM's own server as the rollout engine against the in-process engine, at the demo's shape (32
prompts x 8 samples, <= 8 new tokens, fp32). Server and client share the machine's cores, as they do in
configs/demo_server.yaml.

(1) Engines alone, in this process: start-up seconds, seconds per generate call (the two engines
    alternate, `--rounds` calls each, the median kept; a prompt's group is one request in both, and
    whether both drew the same tokens is recorded per round) and seconds per weight update.
(2) Training, `lit-ess fit` of the demo config at the latency-bound shape (a verifier that waits 2 ms
    per completion, benchmarks.timing:waiting_exact_match): seconds per optimizer step of today's async
    worker (the in-process engine in its worker process, S = 1) against the server engine (the server
    of (1) by `urls`, its start not counted), async S = 1 with drained and with in-flight weight updates
    (their mean lag beside), and sync. The runs alternate for
    `--fit-rounds` rounds of `--fit-steps` steps; the first 3 steps of each run are dropped and the
    median kept. The load average is recorded before and after: the machine is shared.

    .venv/bin/python benchmarks/server.py [--model runs/demo/sft/model] [--rounds 5] [--fit-steps 15 --fit-rounds 1]
                                          [--new-tokens 8]
                                          [--out benchmarks/results/server.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
LATENCY_BOUND = "benchmarks.timing:waiting_exact_match"
FIT_MODES = {"async worker (in-process engine)": ({"class_path": "lit_ess.engines.VLLMConfig",
                                                    "init_args": {"max_model_len": 256}}, "async"),
             "async server engine": ("drain", "async"), "async server engine, in flight": ("in_flight", "async"),
             "sync server engine": ("drain", "sync")}


def fit_step_seconds(model: str, out: Path, engine: dict, mode: str, steps: int,
                     new_tokens: int) -> tuple[list[float], dict]:
    """Seconds per optimizer step of `lit-ess fit` on the demo config with `engine`, `mode` (async: S = 1)
    and the latency-bound reward, less the first 3 steps; and the run's lag: the mean of `train/policy_lag`
    (a row's oldest token) and of `rollout/multi_version_frac` (rows sampled by two versions) over all steps."""
    from lit_ess.report import read_scalars

    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["output_dir"] = None            # every path of the run is set below
    cfg["model"]["init_args"]["model_path"] = model
    cfg["data"]["init_args"]["sampling"]["max_new_tokens"] = new_tokens
    cfg["data"]["init_args"].update({"engine": engine, "reward": LATENCY_BOUND, "validation": {"source": None},
                                     "schedule": {"mode": mode, **({"max_staleness": 1} if mode == "async" else {})}})
    times = out / "times.json"
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
              "init_args": {"save_dir": str(out), "name": "tb", "version": "run"}}
    cfg["trainer"].update({"max_steps": steps, "logger": logger, "enable_checkpointing": False, "devices": 1,
                           "default_root_dir": str(out), "enable_progress_bar": False, "check_val_every_n_epoch": 1,
                           "callbacks": [{"class_path": "lit_ess.callbacks.WeightSync"},
                                         {"class_path": "benchmarks.timing.StepTimes", "init_args": {"path": str(times)}}]})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(out / "config.yaml")], cwd=out,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"benchmarks/server.py: the {mode} run failed:\n{res.stderr[-3000:]}")
    t = json.loads(times.read_text())
    sc = read_scalars(out / "tb" / "run")
    lag = {k: statistics.mean(v for _, v in sc[k]) if sc.get(k) else None
           for k in ("train/policy_lag", "rollout/multi_version_frac")}
    return [b - a for a, b in zip(t[3:], t[4:])], lag


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder; default: the tiny model, built in a temp folder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--fit-steps", type=int, default=15, help="steps per training run; 0: no training runs")
    p.add_argument("--fit-rounds", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=8, help="max_new_tokens of every call (the untrained tiny model "
                   "runs to the limit; in-flight updates matter when a phase outlasts a step)")
    p.add_argument("--out", default=None, help="JSON file for the results (default: print only)")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_ess.engines import VLLMConfig, VLLMServerConfig
    from lit_ess.sampling import SamplingConfig

    model = args.model or str(__import__("lit_ess.tiny", fromlist=["x"]).build_tiny_model(Path(tempfile.mkdtemp()) / "m"))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(f"{10 + 3 * i}+{20 + 7 * i}=")["input_ids"] for i in range(args.prompts)]
    s = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)

    t0 = time.perf_counter()
    server = VLLMServerConfig(max_model_len=256).build(model)
    server_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    local = VLLMConfig(max_model_len=256).build(model)
    local_start = time.perf_counter() - t0

    gen, same = {"server": [], "in_process": []}, []
    for r in range(args.rounds + 1):                                  # round 0 warms both up, not kept
        drawn = []
        for name, engine in (("server", server), ("in_process", local)):
            t0 = time.perf_counter()
            drawn.append([[c.token_ids for c in g] for g in engine.generate(prompts, args.samples, s, call_seed=r)])
            if r:
                gen[name].append(time.perf_counter() - t0)
        same.append(drawn[0] == drawn[1])               # the same seeds: the same tokens from both engines

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    update = {"server": [], "in_process": []}
    for v in range(1, args.rounds + 1):
        with torch.no_grad():
            for q in hf.parameters():
                q.add_(1e-3 * torch.randn_like(q))
        for name, engine in (("server", server), ("in_process", local)):
            t0 = time.perf_counter()
            engine.load_weights(hf.state_dict().items(), version=v)
            update[name].append(time.perf_counter() - t0)
    local.close()

    fit, lags = {name: [] for name in FIT_MODES}, {name: [] for name in FIT_MODES}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.fit_rounds if args.fit_steps > 3 else 0):
            for i, (name, (engine, mode)) in enumerate(FIT_MODES.items()):
                if isinstance(engine, str):                              # the server of (1), by URL
                    engine = {"class_path": "lit_ess.engines.VLLMServerConfig",
                              "init_args": {"urls": server.urls, "max_model_len": 256, "weight_update": engine}}
                times, lag = fit_step_seconds(model, Path(d) / f"{r}-{i}", engine, mode, args.fit_steps,
                                              args.new_tokens)
                fit[name] += times
                lags[name].append(lag)
                print(f"{name}: {statistics.median(fit[name]):.3f} s/step", flush=True)
    load.append(os.getloadavg()[0])
    server.close()

    med = {k: {name: statistics.median(xs) for name, xs in d.items()} for k, d in (("generate", gen), ("update", update))}
    result = {"model": model, "shape": f"{args.prompts}x{args.samples}, <= {args.new_tokens} new tokens", "rounds": args.rounds,
              "start_seconds": {"server": server_start, "in_process": local_start},
              "generate_seconds_median": med["generate"], "update_seconds_median": med["update"],
              "generate_ratio_server_over_in_process": med["generate"]["server"] / med["generate"]["in_process"],
              "same_tokens_per_round": same,
              "generate_seconds_all": gen, "update_seconds_all": update}
    if any(fit.values()):
        worker = statistics.median(fit["async worker (in-process engine)"])
        result["fit"] = {"reward": LATENCY_BOUND, "steps": args.fit_steps, "rounds": args.fit_rounds,
                         "cores": os.cpu_count(), "load_average_1min_before_after": load,
                         "seconds_per_step_median": {k: statistics.median(v) for k, v in fit.items()},
                         "ratio_over_async_worker": {k: statistics.median(v) / worker for k, v in fit.items()},
                         "seconds_per_step_all": fit,
                         "mean_lag_per_round": lags}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
