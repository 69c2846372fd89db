"""Every benchmark of benchmarks/, each in its own process, then one summary of all of them.

    .venv/bin/python benchmarks/run_all.py [--quick] [--model runs/demo/sft/model] [--only step overhead ...]

Each benchmark writes its JSON into --results (default benchmarks/results/; with --quick its quick/
folder, so the full runs' JSON stays), and this script reads them back into `summary.json` and
`summary.md` in --results: one row per measurement with its value (a ratio
within one run, or the quantity the benchmark is about), its goal, met / not met, and the command
that produced it. `--quick` shrinks every benchmark (fewer steps, repeats and rounds) so the suite
runs in minutes; its numbers are noisier.

The benchmarks that train RL from a warm start (async, staleness, ess_floor, vs_trl) need a policy
folder: --model (default runs/demo/sft/model, made by `bash scripts/demo.sh`). When it is missing, this
script makes one once: `lit-ess-tiny` and the demo's SFT warm start (configs/demo_sft.yaml) for
--sft-steps steps, into runs/bench/.

Benchmarks whose file is absent (e.g. memory.py on a branch without it) or whose optional dependency is
missing (vs_trl.py without TRL) are listed as skipped, with the reason.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


@dataclass
class Bench:
    name: str
    full: list[str]                       # arguments of a full run
    quick: list[str]                      # arguments of a --quick run
    rows: Callable[[dict], list[dict]]    # the summary rows of its JSON
    needs_model: bool = False
    needs: list[str] = field(default_factory=list)    # importable modules it requires
    script: str | None = None             # benchmarks/<script>.py, when not the name (one script, two shapes)

    @property
    def file(self) -> str:
        return f"{self.script or self.name}.py"


def row(measurement: str, value: float | None, goal: str | None, met: bool | None, fmt: str = "{:.3f}") -> dict:
    return {"measurement": measurement, "value": value, "display": "-" if value is None else fmt.format(value),
            "goal": goal or "reported", "met": met}


def _objectives(j):
    r = j["ratio_to_grpo"]["p3o"]
    return [row(f"objective fwd+bwd time, P3O / GRPO ([{j['B']}, {j['T']}] tokens)", r, "<= 1.10", r <= 1.10)]


def _step(j):
    out = []
    if "step" in j:
        r = j["step"]["ratio"]
        out.append(row("optimizer step time, Lightning PolicyModule / plain PyTorch loop", r, "<= 1.10", r <= 1.10))
    for label, g in j.get("generation", {}).items():
        out.append(row(f"generation tok/s, vLLM / transformers generate ({label})", g["ratio"], ">= 5", g["ratio"] >= 5,
                       "{:.1f}x"))
    return out


def _proximal(j):
    return [row(f"step time with proximal logprobs recomputed / without, steps_per_rollout {r['steps_per_rollout']} "
                f"(CPU seconds)", r["ratio"], None, None) for r in j["results"].values()]


def _async(j):
    out = []
    ranks = j.get("devices", 1)
    for case, r in j["results"].items():
        latency = case.startswith("(b)")
        ratios = {k[:-len("_ratio")].replace("_", " "): v for k, v in r.items() if k.endswith("_ratio")} or {"async": r["ratio"]}
        for mode, ratio in ratios.items():
            goal = 0.8 if "dedicated" in mode else 0.6        # issue 40: a server fleet at <= 0.8x sync
            out.append(row(f"s/step, {mode} S=1 / sync, {ranks} rank(s), {case}", ratio,
                           f"<= {goal}" if latency else None, ratio <= goal if latency else None))
    return out


def _staleness(j):
    out = []
    for r in j["rows"]:
        S = r["S"]
        out.append(row(f"async S={S}: max policy lag (mean ESS {r['ess_mean']:.4f}, stale rows dropped "
                       f"{r['stale_dropped']:.0f})", r["lag_max"], f"<= {S}", r["lag_max"] <= S, "{:.0f}"))
    return out


def _ess_floor(j):
    out = []
    exact = {"reference (fp32, T 1.0)", "top-p 0.9 (trainer replays it)"}    # the trainer scores exactly pi_b
    for r in j["rows"]:
        goal = r["setting"] in exact
        out.append(row(f"ESS floor at lag 0 (mean), {r['setting']}", r["ess_mean"], ">= 0.999" if goal else None,
                       r["ess_mean"] >= 0.999 if goal else None, "{:.4f}"))
    return out


def _memory(j):
    out = []
    goal = j.get("goal_state_ratio_max", 0.6)
    for alloc, res in j["runs"].items():
        q = res["ratios"]
        if alloc == "glibc default":
            out.append(row("step memory per rank, params+grads+AdamW, 2 ranks FSDP2 / 1 rank", q["state_bytes"],
                           f"<= {goal}", q["state_bytes"] <= goal))
        out.append(row(f"peak RSS of a step, 2 ranks FSDP2 / 1 rank ({alloc})", q["rss_peak_steps"], None, None))
    return out


def _overhead(j):
    w = j["weight_sync"]
    out = [row(f"weight sync to vLLM / one RL step (rollout {w['generate_s'] * 1e3:.0f} ms + optimizer step "
               f"{w['train_step_s'] * 1e3:.0f} ms; sync {w['sync_s'] * 1e3:.1f} ms)", w["ratio"],
               f"<= {j['goal_weight_sync_max']}", w["ratio"] <= j["goal_weight_sync_max"])]
    for m, r in j["ess_prepass"].items():
        out.append(row(f"ESS pre-pass: step time, ess_scope step / micro, {m} micro-batches", r["ratio"],
                       f"<= {j['goal_ess_prepass_max']}", r["ratio"] <= j["goal_ess_prepass_max"]))
    return out


def _vs_trl(j):
    if not j.get("available"):
        return [row(f"lit-ess vs TRL: {j.get('reason')}", None, None, None)]
    runs, trl = j["runs"], "TRL GRPOTrainer, transformers generate"
    shape = j.get("shape", "demo")
    b = j.get("batch", {"prompts": 32, "samples": 8, "new_tokens": 8})
    where = f"{shape} shape, {b['prompts']} x {b['samples']} x {b['new_tokens']} tokens"
    goal, goal_floor = j.get("goal_vs_trl", 1.0), j.get("goal_vs_floor")
    out = []
    for name, r in runs.items():
        curve = f"reward {r['reward_first']:.2f} -> {r['reward_last']:.2f}"
        split = ""
        if "phases_mean_s" in r:
            split = "; " + ", ".join(f"{p} {v:.2f}" for p, v in r["phases_mean_s"].items()) + " s"
        if name == trl:
            out.append(row(f"TRL {j['trl_version']} GRPOTrainer (transformers generate), {where}: s/step, {curve}"
                           f"{split}", r["s_per_step_median"], None, None, "{:.3f} s"))
            continue
        vllm = name == "lit-ess GRPO, vLLM"
        cpu = f"; CPU s/step {r['cpu_time_vs_trl']:.2f}x TRL's" if "cpu_time_vs_trl" in r else ""
        out.append(row(f"s/step, {name} / TRL GRPOTrainer, {where}; {curve}{cpu}{split}", r["time_vs_trl"],
                       f"<= {goal}" if vllm else None, r["time_vs_trl"] <= goal if vllm else None))
        if "phases_vs_trl" in r and r["phases_vs_trl"].get("generation") is not None:
            out.append(row(f"generation time, {name} / TRL (transformers generate), {where}",
                           r["phases_vs_trl"]["generation"], None, None))
        if vllm and goal_floor is not None:
            out.append(row(f"s/step / floor (training + generation), {name}, {where}", r["step_over_floor"],
                           f"<= {goal_floor}", r["step_over_floor"] <= goal_floor))
    return out


def _gen_settings(j):
    out = []
    for shape, r in j["shapes"].items():
        b = " x ".join(map(str, r["batch"]))
        for name, v in r["settings"].items():
            if name != "hf":
                out.append(row(f"generation CPU s, {name} / transformers generate ({shape} shape, {b})",
                               v["cpu_vs_hf"], None, None))
    return out


def _server(j):
    g, u = j["generate_seconds_median"], j["update_seconds_median"]
    return [row(f"generate s, vLLM server / in-process vLLM ({j['shape']})", j["generate_ratio_server_over_in_process"],
                None, None, "{:.2f}x"),
            row("weight update s, vLLM server (safetensors + reload_weights)", u["server"], None, None, "{:.2f} s"),
            row("vLLM server start s", j["start_seconds"]["server"], None, None, "{:.0f} s")]


def _lora(j):
    q, s = j["ratios"], j["sync"]
    where = f"{j['params'] / 1e6:.1f}M-parameter model, rank {j['rank']} on every linear layer"
    return [row(f"checkpointed weights, LoRA / full fine-tuning ({where})", q["checkpoint_weights_lora_over_full"], None, None),
            row(f"AdamW state, LoRA / full fine-tuning ({where})", q["optimizer_state_lora_over_full"], None, None),
            row(f"weight sync + 1-token request, lora.sync adapter / merged ({where}; the request alone "
                f"{s['adapter']['request_s']:.2f} s / {s['merged']['request_s']:.2f} s)", q["sync_adapter_over_merged"],
                None, None)]


def _logprob_memory(j):
    sh = j["shape"]
    where = f"vocabulary {sh['vocab']:,}, {sh['rows']} x {sh['tokens']}-token rows, chunk {sh['chunk']}"
    out = []
    for key, q in j["ratios_chunked_over_unchunked"].items():
        ckpt = "on" if key.endswith("True") else "off"
        out.append(row(f"peak memory of a step, chunked / full logits ({where}; checkpointing {ckpt})", q["peak"],
                       "<= 0.3", q["peak"] <= 0.3))
        out.append(row(f"time of a step, chunked / full logits ({where}; checkpointing {ckpt})", q["time"],
                       "<= 1.15", q["time"] <= 1.15))
    return out


BENCHMARKS = [
    Bench("objectives", ["--repeats", "50"], ["--repeats", "30"], _objectives),
    Bench("step", ["--steps", "30", "--rounds", "3"], ["--steps", "8", "--rounds", "1"], _step, needs=["vllm"]),
    Bench("overhead", ["--steps", "20", "--rounds", "2", "--syncs", "20"],
          ["--steps", "10", "--rounds", "2", "--syncs", "5"], _overhead, needs=["vllm"]),
    Bench("memory", ["--steps", "3"], ["--steps", "2"], _memory),
    Bench("logprob_memory", ["--steps", "2"], ["--quick"], _logprob_memory),
    Bench("proximal", ["--steps", "16", "--rounds", "2"], ["--steps", "8", "--rounds", "1"], _proximal),
    Bench("async", ["--steps", "25", "--rounds", "2"], ["--steps", "8", "--rounds", "1"], _async, needs_model=True,
          needs=["vllm"]),
    Bench("staleness", ["--steps", "30"], ["--steps", "8", "--bounds", "0", "1", "2"], _staleness, needs_model=True,
          needs=["vllm"]),
    Bench("ess_floor", ["--phases", "4"], ["--phases", "1"], _ess_floor, needs_model=True, needs=["vllm"]),
    Bench("vs_trl", ["--steps", "30", "--rounds", "2"], ["--steps", "10", "--rounds", "1"], _vs_trl, needs_model=True, needs=["trl", "vllm"]),
    Bench("gen_settings", ["--rounds", "3"], ["--rounds", "1"], _gen_settings, needs=["vllm"]),
    Bench("server", ["--rounds", "5"], ["--rounds", "2"], _server, needs=["vllm"]),
    Bench("vs_trl_long", ["--shape", "long", "--steps", "8", "--rounds", "2"],
          ["--shape", "long", "--steps", "6", "--rounds", "1"], _vs_trl, needs=["trl", "vllm"], script="vs_trl"),
    Bench("lora", ["--pushes", "10"], ["--pushes", "3", "--hidden-size", "256", "--num-layers", "4"], _lora,
          needs=["peft", "vllm"]),
]


def ensure_model(model: str, sft_steps: int, log) -> str:
    """The warm-started policy folder: `model` if it exists, else runs/bench/sft, made once."""
    if Path(model).is_dir():            # the benchmarks run in the repository root
        return os.path.relpath(Path(model).resolve(), ROOT)
    out = ROOT / "runs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    if (out / "sft" / "config.json").is_file():
        log(f"run_all: no {model}; using {out / 'sft'} (made earlier)")
        return os.path.relpath(out / "sft", ROOT)
    log(f"run_all: no {model}; making a warm start: lit-ess-tiny + configs/demo_sft.yaml for {sft_steps} steps")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "lit_ess.tiny", str(out / "init")], env=env, check=True, cwd=ROOT)
    # in runs/bench/: with logger false LightningCLI saves its config.yaml in the working directory
    subprocess.run([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(ROOT / "configs" / "demo_sft.yaml"),
                    "--model.init_args.model_path", str(out / "init"), "--trainer.max_steps", str(sft_steps),
                    "--output_dir", "null",                 # the export's folder is named below
                    "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                    "--trainer.callbacks", json.dumps([{"class_path": "lit_ess.callbacks.ExportHF",
                                                        "init_args": {"dirpath": str(out / "sft")}}])],
                   env=env, check=True, cwd=out)
    return os.path.relpath(out / "sft", ROOT)


def markdown(summary: dict) -> str:
    mode = "--quick" if summary["quick"] else "full"
    lines = [f"# Benchmark summary ({mode} run)", "",
             f"Made by `{summary['command']}` on {summary['finished']} in {summary['wall_s'] / 60:.1f} min: "
             f"{summary['cpu_count']} CPU cores, torch {summary['torch']}, OMP_NUM_THREADS="
             f"{summary['omp_num_threads'] or 'unset'}. Every value is measured in this run; ratios compare "
             f"two settings within one benchmark process (or one benchmark run), so other work on the machine "
             f"hits both alike. Each benchmark's own JSON is in `{summary['json_dir']}/`. Generated by "
             f"benchmarks/run_all.py: do not edit by hand.", "",
             "| benchmark | measurement | value | goal | met | command |", "|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        met = {True: "met", False: "**not met**", None: "-"}[r["met"]]
        lines.append(f"| {r['benchmark']} | {r['measurement']} | {r['display']} | {r['goal']} | {met} | "
                     f"`{r['command']}` |")
    skipped = {n: b for n, b in summary["benchmarks"].items() if b["status"] != "ok"}
    if skipped:
        lines += ["", "Not in the table:", ""]
        lines += [f"* `{n}`: {b['status']}: {b.get('reason', '')}" for n, b in skipped.items()]
    lines += ["", "Per benchmark wall-clock (s): " + ", ".join(
        f"{n} {b['wall_s']:.0f}" for n, b in summary["benchmarks"].items() if "wall_s" in b) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="shrink every benchmark (a few minutes in all)")
    p.add_argument("--model", default="runs/demo/sft/model", help="warm-started policy for the RL benchmarks")
    p.add_argument("--sft-steps", type=int, default=3000, help="SFT steps when --model must be made")
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--only", nargs="+", help="run only these benchmarks (the others' JSON is read as it is)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per benchmark")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every benchmark process (default: inherited). "
                   "On a machine shared with other jobs, 1 avoids OpenMP threads spinning against them")
    a = p.parse_args(argv)
    if a.list:
        for b in BENCHMARKS:
            present = (HERE / b.file).is_file()
            print(f"{b.name:11s} {'present' if present else 'absent'}  full: {' '.join(b.full)}  quick: {' '.join(b.quick)}")
        return
    results = Path(a.results)
    json_dir = results / "quick" if a.quick else results     # a quick run leaves the full runs' JSON alone
    json_dir.mkdir(parents=True, exist_ok=True)
    logs = ROOT / "runs" / "bench" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    command = "python benchmarks/run_all.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    model = None
    status, rows = {}, []
    for b in BENCHMARKS:
        script = HERE / b.file
        out = json_dir / f"{b.name}.json"
        args = list(b.quick if a.quick else b.full)
        if not script.is_file():
            status[b.name] = {"status": "skipped", "reason": f"benchmarks/{b.file} is not on this branch"}
            print(f"run_all: {b.name}: skipped ({status[b.name]['reason']})", flush=True)
            continue
        missing = [m for m in b.needs if importlib.util.find_spec(m) is None]
        if missing:
            status[b.name] = {"status": "skipped", "reason": f"not installed: {', '.join(missing)}"}
            print(f"run_all: {b.name}: skipped ({status[b.name]['reason']})", flush=True)
            continue
        if b.needs_model:
            model = model or ensure_model(a.model, a.sft_steps, print)
            args = ["--model", model] + args
        args += ["--out", str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out)]
        cmd = f"python benchmarks/{b.file} " + " ".join(args)
        if a.only and b.name not in a.only:
            if out.is_file():
                status[b.name] = {"status": "ok", "command": "(not rerun; JSON of an earlier run)"}
            else:
                status[b.name] = {"status": "skipped", "reason": "not selected by --only and no earlier JSON"}
                continue
        else:
            print(f"run_all: {cmd}", flush=True)
            t0 = time.time()
            with open(logs / f"{b.name}.log", "w") as log:
                try:
                    res = subprocess.run([sys.executable, str(script)] + args, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, timeout=a.timeout)
                    rc = res.returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            wall = time.time() - t0
            if rc != 0:
                tail = (logs / f"{b.name}.log").read_text()[-1500:]
                status[b.name] = {"status": "failed", "reason": f"exit {rc}, log runs/bench/logs/{b.name}.log",
                                  "wall_s": wall, "command": cmd, "log_tail": tail}
                print(f"run_all: {b.name} FAILED ({rc}):\n{tail}", flush=True)
                continue
            status[b.name] = {"status": "ok", "wall_s": wall, "command": cmd}
            print(f"run_all: {b.name} done in {wall:.0f} s", flush=True)
        j = json.loads(out.read_text())
        for r in b.rows(j):
            rows.append({"benchmark": b.name, **r, "command": status[b.name]["command"]})
        status[b.name]["result"] = j
    import torch

    summary = {"command": command, "quick": a.quick, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "wall_s": time.time() - t_start, "cpu_count": os.cpu_count(), "torch": torch.__version__,
               "omp_num_threads": env.get("OMP_NUM_THREADS"), "model": model,
               "json_dir": str(json_dir.relative_to(ROOT) if json_dir.is_relative_to(ROOT) else json_dir), "rows": rows,
               "benchmarks": status}
    (results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = markdown(summary)
    (results / "summary.md").write_text(md)
    print(md)
    print(f"written: {results / 'summary.json'}, {results / 'summary.md'}")


if __name__ == "__main__":
    main()
